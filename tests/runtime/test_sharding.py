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


def train_every_case(rank: int, world: int) -> dict:
    """Each case in turn on these 4 processes: the merged weights' share, the losses, the measured bytes of
    parameters + gradients + optimizer state (before the last update's gradients are dropped), and the number
    of reduce-scatters this rank ran."""
    import torch.distributed as dist

    calls = [0]
    def counting(original):
        def counted(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)
        return counted

    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):  # what FSDP2 calls, by torch release
        if hasattr(dist, name):
            setattr(dist, name, counting(getattr(dist, name)))
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


@pytest.mark.multiprocess
def test_two_stages_of_two_shards_equal_one_process_with_half_the_training_state():
    reference = mlp()
    want, want_losses = train_one_process(reference, momentum(reference.parameters()), batches())
    results = run_local(train_every_case, 4, timeout=180)
    for case in CASES:
        state = {k: v for rank in results for k, v in rank[case][0].items()}
        assert state.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(state[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {key}: {m}")
        # each pipeline's last stage (ranks 2 and 3) has its shard's share of every step's loss
        assert [a + b for a, b in zip(results[2][case][1], results[3][case][1])] == pytest.approx(want_losses, 1e-5)
    for schedule in ("gpipe", "1f1b"):
        replicated = [rank[(None, schedule)][2] for rank in results]
        for shard in ("full", "grad_op"):
            sharded = [rank[(shard, schedule)][2] for rank in results]
            # measured on each rank: parameters, gradients, momentum; each of the two replicas keeps half
            assert all(abs(s / r - 0.5) < 0.01 for s, r in zip(sharded, replicated)), (shard, sharded, replicated)
            # one reduce-scatter per parameter unit (each Linear) per step, not one per micro-batch (4 per step)
            assert [rank[(shard, schedule)][3] for rank in results] == [2 * STEPS] * 4
        assert [rank[(None, schedule)][3] for rank in results] == [0] * 4


@pytest.mark.parametrize(("shard", "schedule", "replicas", "words"), [
    ("half", "1f1b", [2, 2], r"shard='half' is not a sharding mode: use 'full' \(parameters, gradients and optimizer "
                             r"state sharded\), 'grad_op'"),
    ("full", "1f1b", None, r"shard='full' shards each stage over its replicas: give every stage the same number of "
                           r"replicas, at least 2 \(replicas=\[2, 2\]"),
    ("full", "1f1b", [2, 1], r"same number of replicas, at least 2 .*not \[2, 1\]"),
    ("full", "pipedream", [2, 2], r"shard='full' with schedule='pipedream': weight stashing keeps several versions "
                                  r".* Use 1f1b or gpipe, or shard=None"),
    ("grad_op", "zb-h1", [2, 2], r"the split backward's two halves cannot keep FSDP's gathered parameters between "
                                 r"them. Use 1f1b or gpipe, or shard=None"),
])
def test_what_sharding_cannot_run_is_refused_with_the_way_out(shard, schedule, replicas, words):
    from lightning_pipedream.schedule.specs import spec_of

    spec = spec_of(schedule)
    with pytest.raises(ValueError, match=words):
        check_shard(shard, schedule, asynchronous=spec.asynchronous, splits_backward=spec.splits_backward,
                    replicas=replicas)
