"""Compute orders of the V-shape schedules (ZB-V, DualPipeV): which chunk computes what, in which order, per rank.

In a V placement the model is cut into ``2P`` stages and rank r holds stages r (its chunk 0, on the
way down) and ``2P-1-r`` (its chunk 1, on the way back up): stage ``P-1`` hands over to stage ``P``
on rank ``P-1`` without a message, and the loss is computed on rank 0. Both schedules split each
backward into its input-gradient half (B: what the previous stage waits for) and its weight-gradient
half (W: nobody waits for it, so it can fill a bubble).

The orders follow the published per-rank orders, as ``torch.distributed.pipelining`` builds them
(``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``); the builders (``builders.py``) add the messages.
An item is ``(kind, stage, micro-batch)`` with kind ``"F"``, ``"B"`` or ``"W"``.
"""

from __future__ import annotations

from collections import deque

Item = tuple[str, int, int]


class _Counts:
    """Per (kind, stage): the next micro-batch number; each rank computes each kind in micro-batch order."""

    def __init__(self) -> None:
        self.next: dict[tuple[str, int], int] = {}
        self.order: list[Item] = []

    def add(self, kind: str, stage: int) -> int:
        mb = self.next.get((kind, stage), 0)
        self.next[(kind, stage)] = mb + 1
        self.order.append((kind, stage, mb))
        return mb

    def count(self, kind: str, stage: int) -> int:
        return self.next.get((kind, stage), 0)


def zero_bubble_v_order(num_ranks: int, chunks: int, rank: int) -> list[Item]:
    """ZB-V (Qi et al., ICLR'24, section 6) on ``rank`` of ``num_ranks``, ``chunks`` micro-batches.

    Warm-up: ``2(P-r)-1`` forwards of chunk 0, then ``r`` pairs (chunk 1, chunk 0), then ``P-r`` rounds of
    chunk 1's F, B, W. Steady state: F, B, W of chunk 0, then of chunk 1. Cool-down: the B's of both chunks
    race back, with chunk 0's W's between the last ``P-r`` of them; the W's left run last. With fewer
    than ``2P-1`` micro-batches the order is that of ``2P-1`` with the missing ones left out.
    """
    p, down, up = num_ranks, rank, 2 * num_ranks - 1 - rank
    n = max(2 * p - 1, chunks)
    c = _Counts()
    for _ in range(2 * (p - rank) - 1):
        c.add("F", down)
    for _ in range(rank):
        c.add("F", up)
        c.add("F", down)
    for _ in range(p - rank):
        c.add("F", up)
        c.add("B", up)
        c.add("W", up)
    while c.count("F", up) < c.count("F", down) or c.count("F", down) < n:
        if c.count("F", down) < n:
            c.add("F", down)
        for stage in (down, up):
            if stage == up:
                c.add("F", up)
            c.add("B", stage)
            c.add("W", stage)
    for _ in range(rank):  # the input gradients first; their weight halves wait
        c.add("B", down)
        c.add("B", up)
    for _ in range(p - rank):
        c.add("B", down)
        c.add("W", down)
    for stage in (up, down):
        while c.count("W", stage) < c.count("B", stage):
            c.add("W", stage)
    return [item for item in c.order if item[2] < chunks]


def dualpipe_v_order(num_ranks: int, chunks: int, rank: int) -> list[Item]:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto P ranks) on ``rank``; needs ``chunks >= 2P``.

    Eight phases: forwards of chunk 0; pairs of forwards (chunk 0, chunk 1); chunk 1's B, a pending W,
    chunk 1's F; the main phase, where a forward of one chunk and a whole backward of the other run as a
    pair (on a GPU they overlap to hide communication; here one after the other, the forward first);
    chunk 1's backward paired with chunk 0's; the last backwards, the second half of them split so that
    their W's fill the cool-down; the W's left. A whole backward is written B then W at once.
    """
    p, down, up = num_ranks, rank, 2 * num_ranks - 1 - rank
    c = _Counts()
    pending: deque[tuple[int, int]] = deque()  # (stage, micro-batch) of B's whose W waits

    def backward(stage: int, split: bool) -> None:
        mb = c.add("B", stage)
        if split:
            pending.append((stage, mb))
        else:
            c.add("W", stage)

    def weight() -> None:
        if pending:
            stage, mb = pending.popleft()
            c.next[("W", stage)] = c.count("W", stage) + 1
            c.order.append(("W", stage, mb))

    for _ in range(2 * (p - rank - 1)):
        c.add("F", down)
    for _ in range(rank + 1):
        c.add("F", down)
        c.add("F", up)
    for _ in range(p - rank - 1):
        backward(up, split=True)
        weight()
        c.add("F", up)
    for _ in range(chunks - 2 * p + rank + 1):
        c.add("F", down)
        backward(up, split=False)
        c.add("F", up)
        backward(down, split=False)
    for _ in range(p - rank - 1):
        backward(up, split=False)
        c.add("F", up)
        backward(down, split=False)
    split = False
    half = (rank + 1) // 2
    for i in range(rank + 1):
        if i == half and rank % 2 == 1:
            split = True
        backward(up, split)
        if i == half and rank % 2 == 0:
            split = True
        backward(down, split)
    for _ in range(p - rank - 1):
        weight()
        backward(down, split)
    for _ in range(rank + 1):
        weight()
    return c.order
