"""Sharded stage replicas (pipeline x FSDP2) in the standalone Pipeline: 2 stages x 2 shards on 4 processes equal one
process on the union batch, reduce-scatter once per step, and hold half the replicated path's training state."""

from __future__ import annotations

import pytest
import torch
from pipedream_reference import train_one_process
from torch import nn

from lightning_pipedream.runtime.faults.launch import run_local
from lightning_pipedream.runtime.pipeline import Pipeline
from lightning_pipedream.runtime.stages.sharding import check_shard, training_state_bytes

WIDTH, STEPS = 64, 3


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g)) for _ in range(STEPS)]


def momentum(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


CASES = [(shard, schedule) for shard in (None, "full", "grad_op") for schedule in ("gpipe", "1f1b")]


COLLECTIVES = {"gather": ("all_gather_single", "all_gather_into_tensor"),  # what FSDP2 calls, by torch release
               "reduce": ("reduce_scatter_single", "reduce_scatter_tensor")}


def watch_collectives(seen) -> None:
    """In this process from now on, ``seen(kind, args, kwargs)`` before each all-gather ("gather") and reduce-scatter
    ("reduce") FSDP2 starts."""
    import torch.distributed as dist

    def watched(kind, original):
        def call(*args, **kwargs):
            seen(kind, args, kwargs)
            return original(*args, **kwargs)
        return call

    for kind, names in COLLECTIVES.items():
        for name in names:
            if hasattr(dist, name):
                setattr(dist, name, watched(kind, getattr(dist, name)))


def train_every_case(rank: int, world: int) -> dict:
    """Each case in turn on these 4 processes: the merged weights' share, the losses, the measured bytes of
    parameters + gradients + optimizer state (before the last update's gradients are dropped), and the number
    of reduce-scatters this rank ran."""
    calls = [0]

    def count(kind, args, kwargs):
        calls[0] += kind == "reduce"

    watch_collectives(count)
    out = {}
    for shard, schedule in CASES:
        calls[0] = 0
        pipe = Pipeline(mlp(), loss_fn=nn.functional.mse_loss, optimizer=momentum, schedule=schedule, chunks=4,
                        replicas=[2, 2], shard=shard)
        peak = [0]
        update = pipe._update

        def measured_update(minibatch: int, pipe=pipe, update=update) -> None:
            peak[0] = max(peak[0], training_state_bytes(pipe.module, pipe.optimizer))
            update(minibatch)

        pipe._update = measured_update  # what Pipeline.step hands the engine
        losses = [pipe.step(x, y) for x, y in batches()]
        out[(shard, schedule)] = (pipe.state_dict(), losses, peak[0], calls[0])
    return out


def assert_trained_as_one_process(results: list[dict], case: tuple, last: list[int]) -> None:
    """The ranks' merged weights equal one process trained on the union batches, and the ranks in ``last`` (each
    pipeline's last stage) hold their share of every step's loss."""
    reference = mlp()
    want, want_losses = train_one_process(reference, momentum(reference.parameters()), batches())
    state = {k: v for rank in results for k, v in rank[case][0].items()}
    assert state.keys() == want.keys(), case
    for key in want:
        torch.testing.assert_close(state[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {key}: {m}")
    assert [sum(step) for step in zip(*(results[r][case][1] for r in last))] == pytest.approx(want_losses, 1e-5)


@pytest.mark.multiprocess
def test_two_stages_of_two_shards_equal_one_process_with_half_the_training_state():
    results = run_local(train_every_case, 4, timeout=180)
    for case in CASES:
        assert_trained_as_one_process(results, case, last=[2, 3])  # Pipeline's layout: stage 1 on ranks 2 and 3
    for schedule in ("gpipe", "1f1b"):
        replicated = [rank[(None, schedule)][2] for rank in results]
        for shard in ("full", "grad_op"):
            sharded = [rank[(shard, schedule)][2] for rank in results]
            # measured on each rank: parameters, gradients, momentum; each of the two replicas keeps half
            assert all(abs(s / r - 0.5) < 0.01 for s, r in zip(sharded, replicated)), (shard, sharded, replicated)
            # one reduce-scatter per parameter unit (each Linear) per step, not one per micro-batch (4 per step)
            assert [rank[(shard, schedule)][3] for rank in results] == [2 * STEPS] * 4
        assert [rank[(None, schedule)][3] for rank in results] == [0] * 4


# ------------------------------------------------------------------ data-parallel copies: zero bubble and interleaved
# Pipeline runs replicated stages with the schedules that take replicas (gpipe, 1f1b); zb-h1 and interleaved run with
# shards on data-parallel copies of a pipeline, which the strategy builds: built here the same way, engine by engine.
COPY_CASES = [("full", "zb-h1", 1), ("grad_op", "zb-h1", 1), ("full", "interleaved", 2), ("full", "1f1b", 1)]


def train_copies(rank: int, world: int) -> dict:
    """Two copies of a 2-stage pipeline (ranks 0-1 and 2-3), stage s sharded over ranks s and s + 2, each case in
    turn: the merged weights' share, the last stage's losses, and the all-gathers and reduce-scatters this rank ran
    in its steps."""
    import torch.distributed as dist

    from lightning_pipedream.plan.balance import stage_slice
    from lightning_pipedream.runtime.communication.transport import Transport
    from lightning_pipedream.runtime.execution.engine import PipelineEngine
    from lightning_pipedream.runtime.stages.sharding import ShardedStep, full_state, shard_stage

    calls = {"gather": 0, "reduce": 0}
    events: list[str] = []  # "gather", and "recv act" / "recv grad": the order this rank started them in

    def count(kind, args, kwargs):
        calls[kind] += 1
        events.append(kind)

    watch_collectives(count)
    receive = Transport.recv

    def recorded_receive(self, peer, channel=None):
        events.append(f"recv {channel[0]}")
        return receive(self, peer, channel)

    Transport.recv = recorded_receive
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group, in one order
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    copy, stage_index = divmod(rank, 2)
    out = {}
    for shard, schedule, v in [*COPY_CASES, ("full", "1f1b-unprefetched", 1)]:
        ShardedStep.prefetch_ahead = not schedule.endswith("-unprefetched")
        schedule = schedule.removesuffix("-unprefetched")
        balance = [len(mlp()) // (2 * v)] * (2 * v)
        chunks = [shard_stage(stage_slice(mlp(), balance, c * 2 + stage_index), replicas[stage_index], shard,
                              torch.device("cpu")) for c in range(v)]
        optimizer = momentum([p for chunk in chunks for p in chunk.parameters()])
        engine = PipelineEngine(chunks if v > 1 else chunks[0], stage_index, 2,
                                Transport(group=pipelines[copy]), schedule=schedule, chunks=4, virtual_stages=v,
                                sharded_step=ShardedStep(chunks, 2, shard, split_backward=schedule == "zb-h1"))

        def update(minibatch: int) -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        calls.update(gather=0, reduce=0)
        losses, step_events = [], []
        for x, y in batches():  # this copy's rows of the union batch, in 4 micro-batches; each loss its share
            events.clear()
            xs, ys = x[copy::2].tensor_split(4), y[copy::2].tensor_split(4)
            result = engine.train_step(lambda mb: xs[mb],
                                       lambda mb, out: nn.functional.mse_loss(out, ys[mb]) * len(ys[mb]) / len(y),
                                       update)
            losses.append(float(sum(result.losses.values())))
            step_events.append(list(events))
        counted = dict(calls)
        state = {k: v for chunk in chunks for k, v in full_state(chunk).items()}
        out[(shard, schedule, ShardedStep.prefetch_ahead)] = (state, losses, counted, step_events)
    return out


@pytest.mark.multiprocess
def test_zero_bubble_and_interleaved_copies_with_shards_equal_one_process_reducing_once_per_step():
    results = run_local(train_copies, 4, timeout=180)
    for shard, schedule, v in COPY_CASES:
        case = (shard, schedule, True)
        # each copy's second rank holds its last stage (stage 1; interleaved: stage 3)
        assert_trained_as_one_process(results, case, last=[1, 3])
        counts = [rank[case][2] for rank in results]
        # Each Linear is a unit: a reduce-scatter per unit and step, not per micro-batch (4 per step). Zero bubble
        # keeps the weights gathered through the step: one all-gather per unit and step as well.
        units = 2 // v  # Linears per model chunk
        assert [c["reduce"] for c in counts] == [units * v * STEPS] * 4, (case, counts)
        if schedule == "zb-h1":
            assert [c["gather"] for c in counts] == [units * STEPS] * 4, (case, counts)
    # Prefetching: from the second step on, before each blocking receive a sharded "full" stage starts the all-gather
    # of the unit its compute needs first (stage 1's forwards, stage 0's backwards), so one more gather has been
    # started at every receive than without prefetching; none is added over the step: 2 units x (4 forwards + 4
    # backwards), none wasted (FSDP2's default backward prefetch gathered one unit more per step on stage 0, of a
    # micro-batch whose forward came next). The first step gathers when it computes (FSDP2 sets its roots up in their
    # first forward).
    for rank in range(4):
        steps = results[rank][("full", "1f1b", True)][3]
        unprefetched = results[rank][("full", "1f1b", False)][3]
        assert [e.count("gather") for e in steps] == [e.count("gather") for e in unprefetched] == [16] * STEPS
        ahead = [[a - b for a, b in zip(gathers_at_receives(e), gathers_at_receives(u))]
                 for e, u in zip(steps, unprefetched)]
        assert ahead == [[0] * 4] + [[1] * 4] * (STEPS - 1), (rank, ahead)
    # NCCL runs a process group's collectives in the order they are called: each stage's two replicas (ranks 0 and 2,
    # 1 and 3) start the same all-gathers and reduce-scatters in the same order, step by step, gathers started ahead
    # included, in every case.
    for case in results[0]:
        for a, b in ((0, 2), (1, 3)):
            started = [[[e for e in step if not e.startswith("recv")] for step in results[r][case][3]] for r in (a, b)]
            assert started[0] == started[1] and all(started[0]), (case, a, b)
    want_state = results[0][("full", "1f1b", False)][0]
    assert all(torch.equal(results[0][("full", "1f1b", True)][0][k], want_state[k]) for k in want_state)


def gathers_at_receives(events: list[str]) -> list[int]:
    """For each receive in ``events``, how many all-gathers had been started before it."""
    return [events[:i].count("gather") for i, e in enumerate(events) if e.startswith("recv")]


@pytest.mark.parametrize(("shard", "schedule", "replicas", "words"), [
    ("half", "1f1b", [2, 2], r"shard='half' is not a sharding mode: use 'full' \(parameters, gradients and optimizer "
                             r"state sharded\), 'grad_op'"),
    ("full", "1f1b", None, r"shard='full' shards each stage over its replicas: give every stage the same number of "
                           r"replicas, at least 2 \(replicas=\[2, 2\]"),
    ("full", "1f1b", [2, 1], r"same number of replicas, at least 2 .*not \[2, 1\]"),
    ("full", "pipedream", [2, 2], r"shard='full' with schedule='pipedream': weight stashing keeps several versions "
                                  r".* Use 1f1b or gpipe, or shard=None"),
])
def test_what_sharding_cannot_run_is_refused_with_the_way_out(shard, schedule, replicas, words):
    from lightning_pipedream.schedule.specs import spec_of

    with pytest.raises(ValueError, match=words):
        check_shard(shard, schedule, asynchronous=spec_of(schedule).asynchronous, replicas=replicas)


# ------------------------------------------------------------------ bf16 mixed precision, the FSDP2 way
MIXED_CHUNKS = 4


def normed() -> nn.Sequential:
    """Linears, LayerNorms and Tanhs: under autocast alone a LayerNorm keeps its float32 weights (CPU autocast runs
    it in its input's dtype with them), while the FSDP2 policy gathers them in bfloat16: the runs tell the two
    apart."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Tanh())])


def mixed_one_process(model: nn.Module, optimizer: torch.optim.Optimizer, gathered: torch.dtype | None,
                      ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process with the sharded pipeline's precision semantics: each of a step's pieces (2 replicas' shards x
    MIXED_CHUNKS micro-batches) runs under bf16 autocast at the parameters cast to ``gathered`` (None: as they are,
    float32: autocast alone), its loss counting its share of the batch; each replica's micro-batch gradients add up
    in float32, the replicas' sums add up (the reduce-scatter), and the optimizer steps the float32 weights."""
    from torch.func import functional_call

    from lightning_pipedream.runtime.execution.shares import BatchShares

    losses = []
    for x, y in batches():
        inputs, targets = BatchShares.of(x, MIXED_CHUNKS, 2), BatchShares.of(y, MIXED_CHUNKS, 2)
        sums, loss_sum = [], 0.0
        for replica in range(2):
            total: list[torch.Tensor] | None = None
            for chunk in range(MIXED_CHUNKS):
                piece = replica * MIXED_CHUNKS + chunk
                params = {n: p.detach().to(gathered or p.dtype).requires_grad_() for n, p in model.named_parameters()}
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = functional_call(model, params, (inputs.parts[piece],))
                    loss = nn.functional.mse_loss(out, targets.parts[piece]) * (targets.sizes[piece] / targets.total)
                grads = torch.autograd.grad(loss, list(params.values()))
                loss_sum += float(loss.detach())
                if total is None:
                    total = [g.float() for g in grads]
                else:
                    for t, g in zip(total, grads):
                        t += g
            sums.append(total)
        for p, a, b in zip(model.parameters(), *sums):
            p.grad = a + b
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss_sum)
    return model.state_dict(), losses


MIXED_CASES = [("full", "1f1b"), ("grad_op", "gpipe")]


def train_mixed(rank: int, world: int) -> dict:
    """Each sharded case with param_dtype=torch.bfloat16, steps under bf16 autocast: the merged weights' share, the
    losses, and the dtypes FSDP2 gathered and reduce-scattered in."""

    seen: dict[str, set] = {"gather": set(), "reduce": set()}
    watch_collectives(lambda kind, args, kwargs: seen[kind].add(
        next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)).dtype))
    out = {}
    for shard, schedule in MIXED_CASES:
        pipe = Pipeline(normed(), loss_fn=nn.functional.mse_loss, optimizer=momentum, schedule=schedule,
                        chunks=MIXED_CHUNKS, replicas=[2, 2], shard=shard, param_dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = [pipe.step(x, y) for x, y in batches()]
        out[(shard, schedule)] = (pipe.state_dict(), losses)
    out["dtypes"] = {k: sorted(str(d) for d in v) for k, v in seen.items()}
    return out


@pytest.mark.multiprocess
def test_bf16_gathered_shards_equal_one_process_with_the_same_precision_bit_for_bit():
    """param_dtype=torch.bfloat16 under bf16 autocast: the shards train exactly as one process that computes each
    piece at its bf16-cast weights and adds the gradients in float32, in the same order (tolerance 0: the same
    operations on the same values), and differ from autocast alone and from float32 by far more."""
    results = run_local(train_mixed, 4, timeout=180)
    # The ranks compute on one thread; on more, a bf16 LayerNorm's weight gradient sums in another order (one
    # bf16 unit apart, 7e-6 in the weights after 3 steps).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = normed()
        want, want_losses = mixed_one_process(model, momentum(model.parameters()), torch.bfloat16)
        model = normed()
        autocast_only, _ = mixed_one_process(model, momentum(model.parameters()), None)
        model = normed()
        float32, _ = train_one_process(model, momentum(model.parameters()), batches())
    finally:
        torch.set_num_threads(threads)
    for case in MIXED_CASES:
        state = {k: v for rank in results for k, v in rank[case][0].items()}
        assert state.keys() == want.keys()
        for key in want:
            assert state[key].dtype == torch.float32  # the master weights
            torch.testing.assert_close(state[key], want[key], rtol=0, atol=0, msg=lambda m: f"{case} {key}: {m}")
        # the loss of each step: the last stages' shares, summed in another order than the reference's
        assert [a + b for a, b in zip(results[2][case][1], results[3][case][1])] == pytest.approx(want_losses, 1e-6)
    # what tolerance 0 tells apart: the LayerNorms' weights used in float32 (autocast alone: 1.7e-4 off after 3
    # steps) or everything in float32 (2.3e-4)
    for other in (autocast_only, float32):
        assert max((other[k] - want[k]).abs().max().item() for k in want) > 1e-4
    # FSDP2 gathered in bfloat16 and reduce-scattered in float32, on every rank
    assert all(rank["dtypes"] == {"gather": ["torch.bfloat16"], "reduce": ["torch.float32"]} for rank in results)


@pytest.mark.parametrize(("shard", "param_dtype", "words"), [
    (None, torch.bfloat16, r"param_dtype=torch.bfloat16 is the dtype sharded stages gather their parameters in, but "
                           r"shard=None keeps whole parameters as they are. Pass shard='full' or 'grad_op' with it, or "
                           r"drop param_dtype and run step\(\) under torch.autocast for mixed precision."),
    ("full", torch.int8, r"param_dtype=torch.int8 is not a floating-point dtype: sharded stages gather their "
                         r"parameters in it for compute. Use torch.bfloat16 \(mixed precision\) or None"),
])
def test_a_gather_dtype_without_shards_or_not_floating_is_refused(shard, param_dtype, words):
    with pytest.raises(ValueError, match=words):
        check_shard(shard, "1f1b", asynchronous=False, replicas=[2, 2], param_dtype=param_dtype)
