"""One Chrome/Perfetto trace of a whole pipeline run: every rank's measured actions on one clock, beside the plan's.

Rank 0 assembles it from what each rank sends (:class:`RankTrace`: its actions with their times, already on rank 0's
clock). In the file:

- one process per stage (and replica), with lanes ``compute`` (forwards, backwards, weight passes, the update),
  ``send``, ``receive`` (the transfer part of each receive) and ``waiting`` (the part of a receive before the peer's
  send began: the bubble);
- a flow arrow from each send to the receive that took it;
- a process per stage named ``predicted: stage k``: the schedule simulator's timeline of the same steps with the
  plan's stage times (a ghost track), starting where the measured window starts;
- ``metadata``: the clock offsets used and the check that no receive ends before its send began.

Every measured event keeps its action in ``args`` (as :func:`~.timeline.to_chrome_trace` does) with ``rank``, so
:func:`~.timeline.from_chrome_trace` reads the measured actions back (``python -m lightning_pipedream show --trace``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_pipedream.schedule.actions import Op
from lightning_pipedream.schedule.timeline import TimedAction

LANES = {"compute": 1, "send": 2, "receive": 3, "waiting": 4}
PREDICTED_PID = 10_000  # + rank: the ghost track's processes

_COMPUTE = {Op.FORWARD.value, Op.BACKWARD.value, Op.BACKWARD_WEIGHT.value, Op.OPTIMIZER_STEP.value}
_SENDS = {Op.SEND_ACT.value: Op.RECV_ACT.value, Op.SEND_GRAD.value: Op.RECV_GRAD.value}


@dataclass
class RankTrace:
    """One rank's recorded actions: ``events`` rows ``[op, stage, microbatch, peer (global rank), step, start, end,
    sent_at]`` in seconds on rank 0's clock (``sent_at``: a receive's send start, or None)."""

    rank: int
    stage: int
    replica: int
    offset: float  # seconds added to this rank's clock to read rank 0's
    events: list[list[Any]] = field(default_factory=list)
    layers: dict[str, float] = field(default_factory=dict)  # each layer's forward seconds per traced step, if timed

    def to_json(self) -> dict:
        return {"rank": self.rank, "stage": self.stage, "replica": self.replica, "offset": self.offset,
                "events": self.events, "layers": self.layers}

    @classmethod
    def from_json(cls, data: dict) -> RankTrace:
        return cls(int(data["rank"]), int(data["stage"]), int(data["replica"]), float(data["offset"]),
                   list(data["events"]), {str(k): float(v) for k, v in (data.get("layers") or {}).items()})


def _args(row: list[Any], rank: int) -> dict[str, Any]:
    op, stage, mb, peer, step = row[:5]
    return {"op": op, "stage": stage, "microbatch": mb, "peer": peer, "step": step, "rank": rank}


def match_sends(ranks: list[RankTrace]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each receive's send: ``((sender rank, event index), (receiver rank, event index))``. A receive takes the
    send of the same edge (activations into stage s / gradients into stage s), micro-batch and pair of ranks that
    began last before it ended, or, where the clocks disagree, the nearest one."""
    sends: dict[tuple, list[tuple[float, int, int]]] = {}
    for r in ranks:
        for i, row in enumerate(r.events):
            op, stage, mb, peer = row[:4]
            if op in _SENDS:
                into = stage + 1 if op == Op.SEND_ACT.value else stage - 1
                sends.setdefault((_SENDS[op], into, mb, r.rank, peer), []).append((row[5], r.rank, i))
    pairs = []
    for r in ranks:
        for i, row in enumerate(r.events):
            op, stage, mb, peer = row[:4]
            if op not in (Op.RECV_ACT.value, Op.RECV_GRAD.value) or peer is None or peer == r.rank:
                continue
            found = sends.get((op, stage, mb, peer, r.rank))
            if not found:
                continue
            at = row[7] if row[7] is not None else row[6]
            before = [s for s in found if s[0] <= row[6]]
            start, rank, index = max(before) if before else min(found, key=lambda s: abs(s[0] - at))
            pairs.append(((rank, index), (r.rank, i)))
    return pairs


def clock_check(ranks: list[RankTrace]) -> dict[str, Any]:
    """Whether every receive ended after its send began (the clocks' alignment holds): counts and the worst gap."""
    by_rank = {r.rank: r for r in ranks}
    pairs = match_sends(ranks)
    worst = 0.0
    bad = 0
    for (s_rank, s_i), (r_rank, r_i) in pairs:
        gap = by_rank[r_rank].events[r_i][6] - by_rank[s_rank].events[s_i][5]
        if gap < 0:
            bad += 1
            worst = min(worst, gap)
    return {"messages": len(pairs), "receives_before_their_send": bad, "worst_s": worst}


def merged_chrome_trace(ranks: list[RankTrace], predicted: list[TimedAction] | None = None,
                        metadata: dict[str, Any] | None = None) -> dict:
    """The merged trace (module text); ``predicted``: simulated actions (seconds from 0) drawn from the measured
    window's start."""
    ranks = sorted(ranks, key=lambda r: (r.stage, r.replica, r.rank))
    replicated = len({(r.stage, r.replica) for r in ranks}) != len({r.stage for r in ranks})
    out: list[dict[str, Any]] = []
    origin = min((row[5] for r in ranks for row in r.events), default=0.0)

    def us(t: float) -> float:
        return (t - origin) * 1e6

    for order, r in enumerate(ranks):
        name = f"stage {r.stage}" + (f" replica {r.replica}" if replicated else "") + f" (rank {r.rank})"
        out.append({"name": "process_name", "ph": "M", "pid": r.rank, "args": {"name": name}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": r.rank, "args": {"sort_index": order}})
        for lane, tid in LANES.items():
            out.append({"name": "thread_name", "ph": "M", "pid": r.rank, "tid": tid, "args": {"name": lane}})
        for row in r.events:
            op, start, end, sent_at = row[0], row[5], row[6], row[7]
            args = _args(row, r.rank)
            label = f"{op}{'' if row[2] is None else row[2]}" + (f"@{row[3]}" if row[3] is not None else "")
            if op in _COMPUTE:
                lane = "compute"
            elif op in _SENDS or op == Op.ALLREDUCE_GRAD.value:
                lane = "send"
            else:
                lane = "receive"
                if sent_at is not None and sent_at > start:
                    waited_until = min(sent_at, end)
                    out.append({"name": f"wait {label}", "cat": "waiting", "ph": "X", "pid": r.rank,
                                "tid": LANES["waiting"], "ts": us(start), "dur": (waited_until - start) * 1e6,
                                "args": {"part": "waiting", "rank": r.rank}})
                    args["waited_s"] = waited_until - start
            out.append({"name": label, "cat": lane, "ph": "X", "pid": r.rank, "tid": LANES[lane], "ts": us(start),
                        "dur": (end - start) * 1e6, "args": args})
    by_rank = {r.rank: r for r in ranks}
    for n, ((s_rank, s_i), (r_rank, r_i)) in enumerate(match_sends(ranks)):
        send, recv = by_rank[s_rank].events[s_i], by_rank[r_rank].events[r_i]
        out.append({"name": "message", "cat": "flow", "ph": "s", "id": n, "pid": s_rank, "tid": LANES["send"],
                    "ts": us(send[5])})
        out.append({"name": "message", "cat": "flow", "ph": "f", "bp": "e", "id": n, "pid": r_rank,
                    "tid": LANES["receive"], "ts": us(recv[6]) - 0.001})
    if predicted:
        stage_of = {r.rank: r.stage for r in ranks}
        for rank in sorted({e.rank for e in predicted}):
            pid = PREDICTED_PID + rank
            out.append({"name": "process_name", "ph": "M", "pid": pid,
                        "args": {"name": f"predicted: stage {stage_of.get(rank, rank)}"}})
            out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": 1000 + rank}})
        for e in predicted:
            if e.action.op in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_WEIGHT, Op.OPTIMIZER_STEP):
                out.append({"name": str(e.action), "cat": "predicted", "ph": "X", "pid": PREDICTED_PID + e.rank,
                            "tid": LANES["compute"], "ts": e.start * 1e6, "dur": e.duration * 1e6,
                            "args": {"predicted": True}})
    meta = {"clock_check": clock_check(ranks), "offsets_s": {r.rank: r.offset for r in ranks}, **(metadata or {})}
    return {"traceEvents": out, "displayTimeUnit": "ms", "metadata": meta}
