"""Every schedule with every feature that issues a collective, for more steps than any periodic check's period, under
the model of NCCL's rules with collectives (lightning_pipedream/testing/nccl_model.py): no circle, on 2 to 4 stages
(issue #52). A planted copy of the SIGTERM check that hung the language-model recipe (a broadcast over every rank at
every 32nd batch boundary, no drain) must deadlock in it.

Each rank is a thread that does what a rank of a fit does, in the strategy's order: the pipeline's step (tied weights'
all-reduce at each update; under the synchronous schedules the gradient norm's and the fp16 overflow flag's
all-reduces over the pipeline), the step summaries (lagged point-to-point under pipedream and 2bw, a broadcast
otherwise), the SIGTERM flags (strategy/reporting/stop_signal.py), and at every log interval the collectives a hook issues
(``self.log(sync_dist=True)``, ``self.all_gather``), after a drain and the staleness all-gather under the
asynchronous schedules, as the strategy does.

Replicated stages run on the groups a non-uniform layout makes with ``new_group`` (the model has no DeviceMesh; a
uniform layout's mesh makes groups of the same members). Sharded stages (FSDP2) cannot run in the model: FSDP2 needs a
DeviceMesh over a real process group. They are run by a stand-in that issues a collective on the stage's replica group
wherever FSDP2 issues one under ``shard="full"``. That is an all-gather before each unit's forward and before its
backward, and the step's reduce-scatter at the ALLREDUCE_GRAD action that replaces the replicas' all-reduce (see
runtime/stages/sharding.py).
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_pipedream.runtime.faults.termination import termination
from lightning_pipedream.runtime.pipeline import Pipeline
from lightning_pipedream.runtime.stages.ties import TiedParameters
from lightning_pipedream.schedule.specs import SCHEDULES, spec_of
from lightning_pipedream.strategy.reporting.stop_signal import StopRequests
from lightning_pipedream.strategy.reporting.summaries import LaggedSummaries, LoggedValue, StepSummary, SummaryChannel
from lightning_pipedream.testing.nccl_model import DeadlockError, PointToPointModel

STEPS = 50  # more than the old SIGTERM check's period (32), 10 log intervals and 2 drains
LOG_EVERY, DRAIN_EVERY, SIGTERM_AT = 5, 20, 45
CPU = torch.device("cpu")


def layers(count: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(count - 1):
        mods += [nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*mods, nn.Linear(8, 8))


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(steps)]


def fit(rank: int, world: int, schedule: str, *, ties: bool, replicas: list[int] | None = None,
        planted: bool = False, sigterm: bool = True, shard: bool = False) -> int | None:
    """One rank's fit; returns the step at which training stopped for the SIGTERM (None: it ran to the end)."""
    spec = spec_of(schedule)
    stages = world if replicas is None else len(replicas)
    virtual = 2 if spec.virtual_stages else 1
    chunks = 1 if schedule == "pipedream" else 2 * stages if schedule == "dualpipev" else 2  # dualpipev: >= 2 x ranks
    model = layers(2 * stages * virtual)
    pipe = Pipeline(copy.deepcopy(model), loss_fn=nn.functional.mse_loss,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.01), schedule=schedule, chunks=chunks,
                    transport="directional", reverse_group="reverse", replicas=replicas, virtual_stages=virtual)
    stage = pipe.stage_index
    if shard:
        assert replicas is not None and not spec.asynchronous
        stand_in_for_fsdp2(pipe, pipe.groups.data_group, replicas[stage])
    tied = None
    if ties:  # the first Linear's weight and the last's, on the first and the last stage: a tie between them
        weights = [n for n, _ in pipe.module.named_parameters() if n.endswith("weight")]
        here = weights[0] if stage == 0 else weights[-1]
        tied = TiedParameters(pipe.module, {"tie": [0, stages - 1]}, stage, names={"tie": here})

    def before_update() -> None:
        if tied is not None:
            tied.allreduce_grads()
        if not spec.asynchronous:  # clipping by the whole model's norm, and the fp16 overflow flag: synchronous only
            square = sum((p.grad.float() ** 2).sum() for p in pipe.module.parameters() if p.grad is not None)
            dist.all_reduce(torch.as_tensor(square).reshape(1).clone())
            dist.all_reduce(torch.zeros(1), op=dist.ReduceOp.MAX)

    pipe.before_update = before_update
    channel = SummaryChannel(stage, stages, CPU, source=0 if spec.v_shape else stages - 1)  # the loss's rank
    lagged = None
    if replicas is None and spec.asynchronous:
        group, reverse = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
        lagged = LaggedSummaries(channel, group, source=stages - 1, receivers=list(range(stages - 1)),
                                 lag=stages - 1, is_source=stage == stages - 1, reverse_group=reverse)
    stop = StopRequests(dist.new_group(list(range(world))), rank, world, CPU, stage)
    is_last = pipe.is_last

    def drain() -> None:
        pipe.drain()
        if spec.asynchronous:  # the staleness figures' all-gather after every drain
            every = [torch.zeros(3) for _ in range(world)]
            dist.all_gather(every, torch.tensor([float(stage), 0.0, 0.0]))

    for t, (x, y) in enumerate(data(STEPS)):
        if planted and t % 32 == 0:  # Lightning's old check: a broadcast over every rank at the batch boundary
            dist.broadcast(torch.zeros(1), src=0)
        loss = pipe.step(x, y)
        summary = StepSummary(float(loss or 0.0), {}, [LoggedValue("loss", float(loss or 0.0), {})]) if (
            is_last and replicas is None) else None
        if lagged is not None:
            lagged.step(summary)
        elif replicas is None:
            channel.exchange(summary)
        if sigterm and rank == 0 and t == SIGTERM_AT:
            termination().request("SIGTERM")
        if stop.after_step():
            drain()
            if lagged is not None:
                lagged.take_all()
            stop.forget()
            return t
        if (t + 1) % DRAIN_EVERY == 0:  # mid-epoch validation
            drain()
        if (t + 1) % LOG_EVERY == 0:  # a hook's self.log(sync_dist=True) and self.all_gather
            if spec.asynchronous:
                drain()
            dist.all_reduce(torch.ones(1))
            dist.all_gather([torch.zeros(1) for _ in range(world)], torch.full((1,), float(rank)))
    drain()
    if lagged is not None:
        lagged.take_all()
    stop.settle()
    return None


GATHERS: list[int] = []  # the stand-in's all-gathers, by rank (a check that it ran)


def stand_in_for_fsdp2(pipe: Pipeline, group: object, replicas: int) -> None:
    """Issue FSDP2's collectives of a ``shard="full"`` stage where FSDP2 issues them, on the replicas' group: an
    all-gather before every unit's forward and before its backward (parameters freed after each), and the step's
    reduce-scatter of the gradients at the ALLREDUCE_GRAD action."""

    def gather(*_: object) -> None:
        GATHERS.append(pipe.rank)
        dist.all_gather([torch.zeros(1) for _ in range(replicas)], torch.zeros(1), group=group)

    for unit in pipe.module.children():
        if any(p.requires_grad for p in unit.parameters()):
            unit.register_forward_pre_hook(gather)
            unit.register_full_backward_pre_hook(gather)

    def reduce_scatter(average: bool = False) -> None:
        dist.all_reduce(torch.zeros(replicas), group=group)  # the model's stand-in for a reduce-scatter

    pipe.engine.allreduce = reduce_scatter


def run(world: int, schedule: str, **options: object) -> list[int | None]:
    model = PointToPointModel(world, watchdog_s=60)
    try:
        # Replicas' groups from new_group (see the module's text): the model has no DeviceMesh.
        with mock.patch("lightning_pipedream.runtime.stages.replicas._has_device_mesh", return_value=False):
            return model.run(lambda rank: fit(rank, world, schedule, **options), timeout=300)
    finally:
        termination().reset()


def cases() -> list[tuple[str, int, bool]]:
    out = []
    for schedule in SCHEDULES:
        spec = spec_of(schedule)
        for stages in (2, 3, 4):
            # A tie between the first and the last stage's ranks (a V schedule's loss stage is rank 0's: none there).
            out.append((schedule, stages, not spec.virtual_stages))
    return out


@pytest.mark.parametrize(("schedule", "stages", "ties"), cases())
def test_every_collective_of_a_fit_meets_its_group_at_one_point_of_the_schedule(schedule, stages, ties):
    stopped = run(stages, schedule, ties=ties)
    assert stopped == [SIGTERM_AT + 1] * stages  # every rank stopped at the same step, one after rank 0's SIGTERM


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b", "gpipe"])
def test_replicated_stages_with_their_all_reduce(schedule):
    # PipeDream's 1F1B-RR: stage 0 on two replicas (their gradients' all-reduce at each update), stage 1 on one
    assert run(3, schedule, ties=False, replicas=[2, 1]) == [SIGTERM_AT + 1] * 3


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b", "gpipe"])
def test_two_replicas_of_every_stage(schedule):
    # Two data-parallel copies of a 2-stage pipeline: each stage's replicas all-reduce at its update.
    assert run(4, schedule, ties=False, replicas=[2, 2]) == [SIGTERM_AT + 1] * 4


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_sharded_stages_with_their_gathers_and_reduce_scatter(schedule):
    # shard="full" over two replicas of each stage (the asynchronous schedules refuse shards): FSDP2's collectives
    # on the replicas' group, among the pipeline's transfers, ties-free, summaries, SIGTERM flags and hooks.
    GATHERS.clear()
    assert run(4, schedule, ties=False, replicas=[2, 2], shard=True) == [SIGTERM_AT + 1] * 4
    # Every rank gathered before each of its units' forwards and backwards: 2 chunks a step, 2 units per stage.
    assert sorted(set(GATHERS)) == [0, 1, 2, 3]
    assert all(GATHERS.count(r) >= (SIGTERM_AT + 1) * 2 * 2 * 2 for r in range(4)), [GATHERS.count(r) for r in range(4)]


@pytest.mark.parametrize("stages", [2, 3])
def test_the_old_sigterm_check_at_a_batch_boundary_closes_a_circle_with_the_tie(stages):
    with pytest.raises(DeadlockError) as caught:
        run(stages, "pipedream", ties=True, planted=True, sigterm=False)
    words = str(caught.value)
    assert "broadcast from rank 0 #" in words and "all_reduce #" in words, words
