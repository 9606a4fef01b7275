"""Ranks of one process, each in a thread: an in-memory transport over queues, and the harness that starts the ranks,
joins them and fails the test when a rank raised or never ended (tests/runtime/test_executor.py,
tests/runtime/test_device_timing.py)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

from lightning_pipedream.runtime.communication.microbatch import flatten, unflatten


class MemoryTransport:
    """The executor's view of a transport, over queues shared by the ranks of one process: a send copies the
    tree's leaves (a receiver gets leaves of its own, requiring grad where the sender's did), a receive blocks.
    ``device``: the device the transport says it is on (a name only: nothing moves); None leaves the attribute
    out, as a transport that names no device does."""

    def __init__(self, rank: int, mailboxes: dict, timeout: float = 10.0, device: torch.device | None = None) -> None:
        self.rank = rank
        self.mailboxes = mailboxes
        self.timeout = timeout
        if device is not None:
            self.device = device

    def _box(self, src: int, dst: int, channel: Hashable) -> queue.Queue:
        return self.mailboxes.setdefault((src, dst, channel), queue.Queue())

    def send(self, tree: Any, peer: int, where: str = "stage output", channel: Hashable = None) -> None:
        leaves, spec = flatten(tree, where)
        copies = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
        self._box(self.rank, peer, channel).put(unflatten(copies, spec))

    def recv(self, peer: int, channel: Hashable = None) -> Any:
        try:
            return self._box(peer, self.rank, channel).get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(f"rank {self.rank}: nothing from rank {peer} on {channel}") from None

    def post_recv(self, peer: int, channel: Hashable = None) -> None:
        pass  # the queue holds what was sent

    def global_rank(self, peer: int | None) -> int | None:
        return peer


def run_in_threads(rank: Callable[[int], None], world: int = 2, timeout: float = 60.0) -> None:
    """``rank(r)`` for each of ``world`` ranks, each in a thread named ``rank{r}``; waits for them (an outer hang
    limit of ``timeout`` s each) and fails if a rank raised (with its errors) or is still running."""
    errors: list[BaseException] = []

    def guarded(r: int) -> None:
        try:
            rank(r)
        except BaseException as err:  # noqa: BLE001  (the test thread reports it)
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
