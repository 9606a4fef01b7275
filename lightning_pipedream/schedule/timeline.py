"""Timed actions (simulated or recorded): Chrome/Perfetto trace JSON, bubble fraction, a PNG Gantt chart."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_pipedream.schedule.actions import Action, Op


@dataclass(frozen=True)
class TimedAction:
    """One action that ran on ``rank`` from ``start`` to ``end`` (seconds; receives: the time spent waiting)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


# Work; everything else is waiting or bookkeeping.
_BUSY = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_WEIGHT, Op.OPTIMIZER_STEP)


def _name(action: Action) -> str:
    return f"{action} s{action.stage}"


def to_chrome_trace(events: list[TimedAction]) -> dict:
    """Chrome/Perfetto trace JSON (load it at ui.perfetto.dev or chrome://tracing): one track per rank.

    Times are written in microseconds; ``args`` keep every field of the action, so
    :func:`from_chrome_trace` gives the events back.
    """
    trace: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        trace.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": rank}})
    for e in events:
        a = e.action
        trace.append(
            {
                "name": _name(a),
                "cat": "compute" if a.op in _BUSY else "communication",
                "ph": "X",
                "pid": 0,
                "tid": e.rank,
                "ts": e.start * 1e6,
                "dur": (e.end - e.start) * 1e6,
                "args": {
                    "op": a.op.value,
                    "stage": a.stage,
                    "microbatch": a.microbatch,
                    "peer": a.peer,
                    "step": a.step,
                },
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def from_chrome_trace(obj: dict | list) -> list[TimedAction]:
    """The events of a trace written by :func:`to_chrome_trace` (other events are skipped)."""
    raw = obj.get("traceEvents", []) if isinstance(obj, dict) else obj
    events = []
    for ev in raw:
        args = ev.get("args") or {}
        if ev.get("ph") != "X" or "op" not in args:
            continue
        try:
            op = Op(args["op"])
        except ValueError as err:
            known = ", ".join(o.value for o in Op)
            raise ValueError(
                f"Trace event {ev.get('name')!r} has unknown op {args['op']!r}; expected one of {known}."
            ) from err
        action = Action(op, int(args["stage"]), args.get("microbatch"), args.get("peer"), int(args.get("step", 0)))
        start = float(ev["ts"]) / 1e6
        rank = int(args.get("rank", ev["tid"]))  # a merged trace (merged_trace.py) names its rank; else the tid
        events.append(TimedAction(rank, action, start, start + float(ev.get("dur", 0.0)) / 1e6))
    return events


def makespan(events: list[TimedAction]) -> float:
    """Seconds from the first start to the last end."""
    if not events:
        return 0.0
    return max(e.end for e in events) - min(e.start for e in events)


def bubble_fraction(events: list[TimedAction]) -> float:
    """1 - busy time / (ranks x makespan): the share of rank-time spent idle or waiting.

    Busy means forward, backward (both halves when split) and optimizer step; sends, receives
    (waits) and gaps are bubble.
    """
    span = makespan(events)
    ranks = len({e.rank for e in events})
    if span <= 0 or ranks == 0:
        return 0.0
    busy = sum(e.end - e.start for e in events if e.action.op in _BUSY)
    return 1.0 - busy / (ranks * span)


_COLOURS = {
    Op.FORWARD: "#4C72B0", Op.BACKWARD: "#DD8452", Op.BACKWARD_WEIGHT: "#C44E52", Op.OPTIMIZER_STEP: "#55A868"
}


def plot_timeline(events: list[TimedAction], path: str | Path, title: str = "") -> Path:
    """Draw ``events`` as a Gantt chart PNG at ``path``: one row per rank (rank 0 on top).

    Forwards, backwards and weight-gradient halves (zero bubble) are coloured boxes with the
    micro-batch number inside (``n/s`` with several stages per rank: micro-batch n of stage s); optimizer steps
    are green; sends and receives (waits, in recorded traces) are thin grey bars.
    """
    # Lazy, and without pyplot: no global backend switch, no GUI, safe in any process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    path = Path(path)
    ranks = sorted({e.rank for e in events}) or [0]
    per_rank: dict[int, set[int]] = {}
    for e in events:
        per_rank.setdefault(e.rank, set()).add(e.action.stage)
    several = any(len(stages) > 1 for stages in per_rank.values())
    origin = min((e.start for e in events), default=0.0)
    span = makespan(events) or 1.0
    fig = Figure(figsize=(max(6.0, min(20.0, 0.25 * len(events) / len(ranks) + 4)), 0.6 * len(ranks) + 1.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    row = {rank: len(ranks) - 1 - i for i, rank in enumerate(ranks)}
    for e in events:
        op, y, left, width = e.action.op, row[e.rank], e.start - origin, e.end - e.start
        if op in _COLOURS:
            ax.barh(y, width, left=left, height=0.8, color=_COLOURS[op], edgecolor="black", linewidth=0.5)
            if op is not Op.OPTIMIZER_STEP and width > span / 80:
                label = f"{e.action.microbatch}/{e.action.stage}" if several else str(e.action.microbatch)
                ax.text(left + width / 2, y, label, ha="center", va="center", fontsize=7, color="white")
        elif width > 0:
            ax.barh(y, width, left=left, height=0.15, color="#AAAAAA")
    ax.set_yticks([row[r] for r in ranks], [f"rank {r}" for r in ranks])
    ax.set_xlim(0, span)
    ax.set_xlabel("seconds")
    ax.set_title(title)
    legend = [Patch(color=c, label=o.name.lower().replace("_", " ")) for o, c in _COLOURS.items()]
    legend.append(Patch(color="#AAAAAA", label="send / receive wait"))
    fig.legend(handles=legend, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))  # leave room for the legend below
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def render_events(events: list[TimedAction], unfinished: set[int] = frozenset(), last: int = 0) -> str:  # type: ignore[assignment]
    """Recorded events as a text grid: one column per rank, one row per action in order of start.

    Cells show the action (``F3`` forward of micro-batch 3, ``B3`` backward, ``O`` optimizer step,
    ``RG3@1`` receive of its gradient from rank 1, ``SA3@1`` send ...), with the wait when a receive
    or all-reduce took 1 ms or more. The last action of each rank in ``unfinished`` had not ended
    (the rank was waiting in it when the file was written). ``last`` > 0 keeps only the last rows.
    """
    if not events:
        return "(no actions recorded)"
    ranks = sorted({e.rank for e in events})
    ordered = sorted(events, key=lambda e: (e.start, e.rank))
    final = {e.rank: e for e in ordered if e.rank in unfinished}
    origin = ordered[0].start
    rows = []
    for e in ordered:
        text = str(e.action)
        if final.get(e.rank) is e:
            text += f" unfinished, {e.duration:.1f} s"
        elif (e.action.op.is_recv or e.action.op.is_collective) and e.duration >= 1e-3:
            text += f" {e.duration * 1e3:.0f}ms"
        rows.append((f"{e.start - origin:10.3f}", ranks.index(e.rank), text))
    skipped = max(0, len(rows) - last) if last > 0 else 0
    rows = rows[skipped:]
    width = max(12, *(len(t) + 2 for _, _, t in rows))
    lines = ["   seconds  " + "".join(f"rank {r}".ljust(width) for r in ranks)]
    if skipped:
        lines.append(f"   ({skipped} earlier actions not shown)")
    for when, column, text in rows:
        lines.append(f"{when}  " + " " * (width * column) + text)
    return "\n".join(line.rstrip() for line in lines)
