"""Replicated stages on the standalone engine (gloo): data-parallel pipelines and a 2-1 plan equal one process."""

from __future__ import annotations

import pytest
import torch
from pipedream_reference import train_one_process
from torch import nn

from lightning_pipedream.runtime.faults.launch import run_local
from lightning_pipedream.runtime.pipeline import Pipeline
from lightning_pipedream.runtime.stages.replicas import GradientReducer

pytestmark = pytest.mark.multiprocess  # starts several processes: not in the fast suite

LR, MOMENTUM, WIDTH = 0.1, 0.9, 6


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())


def batches(n: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, WIDTH, generator=g), torch.randn(size, WIDTH, generator=g)) for _ in range(n)]


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def train_replicated(rank: int, world: int, replicas: list[int], schedules: list[str], chunks: int, steps: int):
    """Train one Pipeline per schedule in these processes; return each one's weights, losses and group members."""
    out = {}
    for schedule in schedules:
        pipe = Pipeline(mlp(), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule=schedule, chunks=chunks,
                        replicas=replicas)
        losses = [pipe.step(x, y) for x, y in batches(steps)]
        pipe.drain()
        groups = pipe.groups
        out[schedule] = (pipe.stage_index, pipe.state_dict(), losses, groups.group_members(), pipe.reducer.calls,
                         groups.mesh is not None)
    return out


def single_process(steps: int) -> tuple[dict, list[float]]:
    model = mlp()
    return train_one_process(model, sgd(model.parameters()), batches(steps))


def check_equal_to_one_process(results: list[dict], replicas: list[int], schedule: str, steps: int) -> None:
    want, want_losses = single_process(steps)
    first = 0
    for stage, count in enumerate(replicas):
        ranks = list(range(first, first + count))
        first += count
        for rank in ranks:
            stage_index, state, losses, members, calls, mesh = results[rank][schedule]
            assert stage_index == stage
            assert mesh == (len(set(replicas)) == 1)  # uniform layouts name their groups with a DeviceMesh
            assert members == ranks, f"stage {stage}'s all-reduce group is {members}, not its replicas {ranks}"
            assert calls == (steps if count > 1 else 0)
            for key, value in state.items():
                torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
            if stage == len(replicas) - 1 and count == 1:
                assert losses == pytest.approx(want_losses, rel=1e-5)


def test_two_stages_two_replicas_equal_one_process():
    """Two data-parallel copies of a 2-stage pipeline on 4 processes, gpipe and 1f1b."""
    results = run_local(train_replicated, 4, [2, 2], ["gpipe", "1f1b"], 2, 3, timeout=60)
    for schedule in ("gpipe", "1f1b"):
        check_equal_to_one_process(results, [2, 2], schedule, 3)


def test_two_one_plan_equals_one_process():
    """A 2-1 plan on 3 processes: stage 0 replicated, stage 1 alone takes both shards' micro-batches."""
    results = run_local(train_replicated, 3, [2, 1], ["gpipe", "1f1b"], 2, 3, timeout=60)
    for schedule in ("gpipe", "1f1b"):
        check_equal_to_one_process(results, [2, 1], schedule, 3)


def test_pipedream_two_one_keeps_replicas_identical():
    results = run_local(train_replicated, 3, [2, 1], ["pipedream"], 1, 5, timeout=60)
    a, b = results[0]["pipedream"][1], results[1]["pipedream"][1]
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # 5 steps admit 10 minibatches: each replica ran 5 backwards and 5 all-reduce rounds.
    assert results[0]["pipedream"][4] == results[1]["pipedream"][4] == 5
    assert all(loss is not None and loss > 0 for loss in results[2]["pipedream"][2])


def reduce_with_a_missing_gradient(rank: int, world: int):
    import torch.distributed as dist

    param = nn.Parameter(torch.zeros(3))
    if rank == 0:
        param.grad = torch.tensor([2.0, 4.0, 6.0])
    reducer = GradientReducer([param], dist.group.WORLD, bucket_bytes=8)
    count = reducer.reduce(average=True)
    return count, param.grad.tolist()


def test_reducer_averages_over_contributors_only():
    results = run_local(reduce_with_a_missing_gradient, 2, timeout=30)
    assert results == [(1, [2.0, 4.0, 6.0]), (1, [2.0, 4.0, 6.0])]
