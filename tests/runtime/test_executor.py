"""The executor in one process: each rank's actions run in a thread over an in-memory transport, and the gradients
equal one process's; a receive with nothing sent times out instead of hanging."""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Hashable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pipedream.runtime.communication.microbatch import flatten, split, unflatten
from lightning_pipedream.runtime.execution.executor import Executor
from lightning_pipedream.runtime.stages.stage import Stage
from lightning_pipedream.schedule.builders import build_schedule


class MemoryTransport:
    """The executor's view of a transport, over queues shared by the ranks of one process: a send copies the
    tree's leaves (a receiver gets leaves of its own, requiring grad where the sender's did), a receive blocks."""

    def __init__(self, rank: int, mailboxes: dict, timeout: float = 10.0) -> None:
        self.rank = rank
        self.mailboxes = mailboxes
        self.timeout = timeout
        self.sends = 0

    def _box(self, src: int, dst: int, channel: Hashable) -> queue.Queue:
        return self.mailboxes.setdefault((src, dst, channel), queue.Queue())

    def send(self, tree: Any, peer: int, where: str = "stage output", channel: Hashable = None) -> None:
        leaves, spec = flatten(tree, where)
        copies = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
        self._box(self.rank, peer, channel).put(unflatten(copies, spec))
        self.sends += 1

    def recv(self, peer: int, channel: Hashable = None) -> Any:
        try:
            return self._box(peer, self.rank, channel).get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(f"rank {self.rank}: nothing from rank {peer} on {channel}") from None

    def post_recv(self, peer: int, channel: Hashable = None) -> None:
        pass  # the queue holds what was sent

    def global_rank(self, peer: int | None) -> int | None:
        return peer


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
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            executor = Executor(Stage(stages[r], r, 2), MemoryTransport(r, mailboxes), rank=r)
            executor.run(
                schedule.actions[r],
                inputs=lambda mb: xs[mb],
                loss=lambda mb, out: nn.functional.cross_entropy(out, ys[mb]) * (len(ys[mb]) / len(y)),
                optimizer_step=lambda action: None,
            )
        except BaseException as err:  # noqa: BLE001  (the test thread reports it)
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
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
