"""Times a schedule from per-stage costs and link speed: step time, bubble fraction, stored activations."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_pipedream.schedule.actions import Link, Op, Schedule
from lightning_pipedream.schedule.check import validate
from lightning_pipedream.schedule.timeline import TimedAction, bubble_fraction


@dataclass
class SimResult:
    """What :func:`simulate` predicts for one schedule.

    ``step_time`` is the time of one training step: the makespan for a flushed schedule (one step),
    and for a schedule that keeps the pipeline full across steps (``pipedream``) the steady-state
    time per step, measured between steps in which every rank runs a backward (``steady_state``
    says whether there were enough of them; if not it is ``makespan / steps``).
    ``peak_activations[rank]`` is the most micro-batches whose forward ran and whose backward has
    not yet (its weight half, for a split backward), i.e. how many sets of activations the rank
    must keep; with several stages per rank (interleaved) each counts a chunk's activations.
    """

    schedule: str
    num_stages: int
    chunks: int  # micro-batches per training step
    minibatches: int  # batches admitted (pipedream: before the drain; 1 for flushed schedules)
    makespan: float
    step_time: float
    steady_state: bool
    bubble_fraction: float
    peak_activations: list[int]
    events: list[TimedAction] = field(repr=False)

    def summary(self) -> dict:
        """The numbers, JSON-ready (without the events)."""
        return {k: v for k, v in self.__dict__.items() if k != "events"}


def per_stage(name: str, value: float | Sequence[float], stages: int) -> list[float]:
    """One value per stage from a number (every stage) or a list (checked: one per stage, each >= 0)."""
    values = [float(value)] * stages if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != stages:
        raise ValueError(
            f"{name} has {len(values)} values but the schedule has {stages} stages; "
            "give one value for all stages or one per stage."
        )
    if any(v < 0 or math.isnan(v) for v in values):
        raise ValueError(f"{name} must be >= 0 (seconds or bytes), got {values}.")
    return values


def simulate(
    schedule: Schedule,
    forward_s: Sequence[float] | float,
    backward_s: Sequence[float] | float,
    *,
    activation_bytes: Sequence[float] | float = 0,
    bandwidth: float = math.inf,
    latency: float = 0.0,
    optimizer_s: float = 0.0,
    parameter_bytes: Sequence[float] | float = 0,
    allreduce_bandwidth: float | None = None,
    weight_s: Sequence[float] | float | None = None,
    recompute: bool = False,
    check: bool = True,
) -> SimResult:
    """Run ``schedule`` on a clock: every rank does its actions in order, receives wait for their data.

    ``forward_s[s]``/``backward_s[s]`` are the seconds stage s takes per micro-batch;
    ``activation_bytes[s]`` is the size of stage s's output (its gradient has the same size).
    A send takes no time on the sender; its message occupies the link (bytes / ``bandwidth``,
    one message after another per direction) and arrives ``latency`` seconds after leaving.

    A gradient all-reduce (replicated stages) starts when the last of the stage's replicas reaches
    it and takes a ring all-reduce's time, ``2 (r - 1) / r * parameter_bytes[s] / allreduce_bandwidth
    + latency`` for r replicas (``allreduce_bandwidth`` defaults to ``bandwidth``); every replica
    leaves it at the same time.

    ``check=False`` skips validating the schedule (for a planner timing many schedules from the builders).
    """
    if check:
        validate(schedule)  # a schedule that deadlocks has no timing
    p = schedule.num_stages
    fwd, bwd = per_stage("forward_s", forward_s, p), per_stage("backward_s", backward_s, p)
    size = per_stage("activation_bytes", activation_bytes, p)
    params = per_stage("parameter_bytes", parameter_bytes, p)
    reduce_bw = bandwidth if allreduce_bandwidth is None else allreduce_bandwidth
    if not reduce_bw > 0:
        raise ValueError(f"allreduce_bandwidth must be > 0 bytes per second, got {allreduce_bandwidth}.")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0 bytes per second (inf for free links), got {bandwidth}.")
    if latency < 0 or optimizer_s < 0:
        raise ValueError(f"latency and optimizer_s must be >= 0 seconds, got {latency} and {optimizer_s}.")
    if schedule.splits_backward:
        wgt = per_stage("weight_s", [b / 2 for b in bwd] if weight_s is None else weight_s, p)
        if any(w > b for w, b in zip(wgt, bwd)):
            raise ValueError(f"weight_s {wgt} must not exceed backward_s {bwd}: W is a part of the backward.")
        bwd = [b - w for b, w in zip(bwd, wgt)]
    else:
        wgt = [0.0] * p
    if recompute:
        bwd = [b + f for b, f in zip(bwd, fwd)]
    duration = {Op.FORWARD: fwd, Op.BACKWARD: bwd, Op.BACKWARD_WEIGHT: wgt}

    ranks = schedule.actions
    clock = [0.0] * len(ranks)
    pos = [0] * len(ranks)
    arrivals: dict[Link, deque[float]] = {}  # (src, dst) -> arrival times, FIFO
    link_free: dict[Link, float] = {}
    layout = schedule.layout
    rounds: dict[tuple[int, int], int] = {}  # (rank, stage) -> all-reduces done
    reached: dict[tuple[int, int], dict[int, float]] = {}  # (stage, round) -> rank -> arrival time
    events: list[TimedAction] = []
    progressed = True
    while progressed:  # advance each rank until it waits on a message not yet sent; repeat
        progressed = False
        for rank, actions in enumerate(ranks):
            t, i = clock[rank], pos[rank]
            while i < len(actions):
                a = actions[i]
                op = a.op
                if op.is_recv:
                    queue = arrivals.get((a.peer, rank))
                    if not queue:
                        break
                    start, t = t, max(t, queue.popleft())
                    events.append(TimedAction(rank, a, start, t))
                elif op is Op.ALLREDUCE_GRAD:
                    assert layout is not None  # the validator allows all-reduces on replicated stages only
                    key = (a.stage, rounds.get((rank, a.stage), 0))
                    here = reached.setdefault(key, {})
                    here.setdefault(rank, t)
                    r = len(layout.ranks_of(a.stage))
                    if len(here) < r:
                        break
                    cost = 2 * (r - 1) / r * params[a.stage] / reduce_bw + latency
                    start, t = here[rank], max(here.values()) + cost
                    rounds[(rank, a.stage)] = key[1] + 1
                    events.append(TimedAction(rank, a, start, t))
                elif op.is_send:
                    link = (rank, a.peer)
                    if a.peer == rank:  # between two chunks of this rank (the V's turn): no message, no time
                        arrivals.setdefault(link, deque()).append(t)
                    else:
                        nbytes = size[a.stage] if op is Op.SEND_ACT else size[a.stage - 1]
                        leaves = max(t, link_free.get(link, 0.0)) + nbytes / bandwidth
                        link_free[link] = leaves
                        arrivals.setdefault(link, deque()).append(leaves + latency)
                    events.append(TimedAction(rank, a, t, t))
                else:
                    cost = optimizer_s if op is Op.OPTIMIZER_STEP else duration[op][a.stage]
                    events.append(TimedAction(rank, a, t, t + cost))
                    t += cost
                i += 1
            if i != pos[rank]:
                clock[rank], pos[rank], progressed = t, i, True
    span = max((e.end for e in events), default=0.0)
    step_time, steady = _step_time(schedule, events, span)
    return SimResult(
        schedule.name, p, schedule.chunks, schedule.minibatches, span, step_time, steady, bubble_fraction(events),
        [_peak(actions, schedule.splits_backward) for actions in ranks], events,
    )


def _peak(actions, split: bool) -> int:
    """Most micro-batches whose activations a rank holds: forward done, backward (its W half, when split) not."""
    release = Op.BACKWARD_WEIGHT if split else Op.BACKWARD
    live = peak = 0
    for a in actions:
        live += (a.op is Op.FORWARD) - (a.op is release)
        peak = max(peak, live)
    return peak


def _step_time(schedule: Schedule, events: list[TimedAction], span: float) -> tuple[float, bool]:
    steps = schedule.steps()
    if steps == 1:
        return span, False
    # Full steps: every rank runs a backward in them (no warm-up, no drain). Each rank's step ends
    # with its last action of that step; the slowest rank sets the pace.
    ends: dict[tuple[int, int], float] = {}
    backward_in: list[set[int]] = [set() for _ in range(steps)]
    for e in events:
        key = (e.rank, e.action.step)
        ends[key] = max(ends.get(key, 0.0), e.end)
        if e.action.op is Op.BACKWARD:
            backward_in[e.action.step].add(e.rank)
    full = [t for t in range(steps) if len(backward_in[t]) == schedule.num_ranks]
    if len(full) < 2:
        return span / steps, False
    return max(
        _mean_step([ends[(r, t)] - ends[(r, t - 1)] for t in full[1:]]) for r in range(schedule.num_ranks)
    ), True


def _mean_step(deltas: list[float]) -> float:
    """The long-run mean of a rank's step times.

    Stages behind the slowest one run faster at first, until their slack is used up, and with
    latency the steps settle into a pattern that repeats every few steps. So: the shortest
    pattern that repeats at least twice and covers the later half, averaged over one repeat;
    failing that (too few steps), the mean of the later half.
    """
    n = len(deltas)
    for k in range(1, n // 2 + 1):
        i = n - k - 1
        while i >= 0 and math.isclose(deltas[i], deltas[i + k], rel_tol=1e-9, abs_tol=1e-12):
            i -= 1
        if n - 1 - i >= max(2 * k, (n + 1) // 2):  # the repeating suffix is deltas[i + 1:]
            return sum(deltas[n - k:]) / k
    later = deltas[n // 2:]
    return sum(later) / len(later)
