"""The executor in one process: each rank's actions run in a thread over an in-memory transport, and the gradients
equal one process's; a receive with nothing sent times out instead of hanging."""

from __future__ import annotations

import copy

import pytest
import torch
from thread_ranks import MemoryTransport, run_in_threads
from torch import nn

from lightning_pipedream.runtime.communication.microbatch import split
from lightning_pipedream.runtime.execution.executor import Executor
from lightning_pipedream.runtime.stages.stage import Stage
from lightning_pipedream.schedule.builders import build_schedule


def layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def run_ranks(schedule_name: str, chunks: int, x: torch.Tensor, y: torch.Tensor) -> list[nn.Module]:
    """Two stages ([0:2] and [2:5]) run one training step in two threads; returns the stages with their grads."""
    model = layers()
    stages = [copy.deepcopy(model[:2]), copy.deepcopy(model[2:])]
    schedule = build_schedule(schedule_name, 2, chunks)
    mailboxes: dict = {}
    xs, ys = split(x, chunks), split(y, chunks)

    def rank(r: int) -> None:
        executor = Executor(Stage(stages[r], r, 2), MemoryTransport(r, mailboxes), rank=r)
        executor.run(
            schedule.actions[r],
            inputs=lambda mb: xs[mb],
            loss=lambda mb, out: nn.functional.cross_entropy(out, ys[mb]) * (len(ys[mb]) / len(y)),
            optimizer_step=lambda action: None,
        )

    run_in_threads(rank)
    return stages


@pytest.mark.parametrize(("schedule", "chunks"), [("gpipe", 1), ("gpipe", 4), ("1f1b", 4), ("zb-h1", 3),
                                                  ("1f1b", 5)])
def test_two_ranks_on_an_in_memory_transport_equal_one_process(schedule: str, chunks: int) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    reference = layers()
    nn.functional.cross_entropy(reference(x), y).backward()
    stages = run_ranks(schedule, chunks, x, y)
    piped = dict(stages[0].named_parameters()) | dict(stages[1].named_parameters())
    for name, param in reference.named_parameters():
        torch.testing.assert_close(piped[name].grad, param.grad, rtol=1e-5, atol=1e-6)


def test_a_receive_that_never_comes_raises_instead_of_hanging() -> None:
    schedule = build_schedule("1f1b", 2, 2)
    executor = Executor(Stage(layers()[2:], 1, 2), MemoryTransport(1, {}, timeout=0.2), rank=1)
    with pytest.raises(TimeoutError, match="rank 1: nothing from rank 0"):
        executor.run(schedule.actions[1], inputs=lambda mb: None, loss=lambda mb, out: out.sum(),
                     optimizer_step=lambda action: None)
