"""What the schedules benchmark's traces and the simulator say: each schedule's predicted step and bubble, the costs
the traced runs and the bound measured, and the bubbles of single steps cut out of a trace
(:mod:`benchmarks.speed.schedules` runs the contenders and writes the figures)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.common.workload import BUSY_CORES, NEWER, OURS, V_SHAPED, VIRTUAL, Config
from lightning_pipedream.schedule.actions import Op
from lightning_pipedream.schedule.builders import build_schedule, stage_rank
from lightning_pipedream.schedule.simulate import simulate
from lightning_pipedream.schedule.timeline import TimedAction, bubble_fraction, plot_timeline

FLUSHED = ("gpipe", "1f1b", "zb-h1", "interleaved")


def predict(cfg: Config, prof: dict, link: dict) -> dict:
    """The simulator's step time (seconds per batch of ``cfg.batch`` samples) and bubble per schedule.

    ``prof`` has per-stage ``forward_s``/``backward_s`` and ``optimizer_s`` (seconds per
    micro-batch; for pipedream per minibatch of the same size), ``link`` the measured latency
    and bandwidth of our transport.
    """
    out = {}
    for name in OURS:
        if name == "pipedream":
            sched = build_schedule("pipedream", cfg.stages, minibatches=4 * cfg.chunks)
        else:
            sched = build_schedule(name, cfg.stages, cfg.chunks)
        r = simulate(
            sched,
            prof["forward_s"],
            prof["backward_s"],
            activation_bytes=link["activation_bytes"],
            bandwidth=link["bandwidth_Bps"],
            latency=link["latency_s"],
            optimizer_s=max(prof["optimizer_s"]),
        )
        step = r.step_time * cfg.chunks if name == "pipedream" else r.step_time
        out[name] = {
            "step_time_s": step,
            "bubble_fraction": r.bubble_fraction if name != "pipedream" else None,
            "peak_activations": r.peak_activations,
            "steady_state": r.steady_state,
        }
    return out


def trace_costs(runs: list[dict]) -> dict | None:
    """Per-stage forward/backward/optimizer seconds as the traced runs recorded them (median over runs,
    preferring the runs on a quiet machine)."""
    traced = [r for r in runs if "op_mean_s" in r]
    quiet = [r for r in traced if r["foreign_cores"] < BUSY_CORES]
    chosen = quiet or traced
    if not chosen:
        return None
    stages = len(chosen[0]["op_mean_s"])

    def median(op: str, rank: int) -> float:
        return statistics.median(r["op_mean_s"][rank][op] for r in chosen)

    return {
        "forward_s": [median("F", s) for s in range(stages)],
        "backward_s": [median("B", s) for s in range(stages)],
        "optimizer_s": [median("O", s) for s in range(stages)],
        "runs": len(chosen),
        "quiet": bool(quiet),
    }


def action_overheads(runs: list[dict], cfg: Config) -> list[float] | None:
    """Per stage, the seconds per micro-batch that a traced run spent posting sends and between actions (Python
    around them, the step's own bookkeeping): median over the runs."""
    traced = [r for r in runs if "breakdown_s_per_step" in r]
    if not traced:
        return None
    traced = [r for r in traced if r["foreign_cores"] < BUSY_CORES] or traced  # the quiet runs where there are
    stages = len(traced[0]["breakdown_s_per_step"])
    return [statistics.median((r["breakdown_s_per_step"][s]["send"] + r["breakdown_s_per_step"][s]["between_actions"])
                              / cfg.chunks for r in traced) for s in range(stages)]


def measured_bubble(events: list[TimedAction], schedule: str, cfg: Config) -> dict:
    """Bubble of each flushed step from a trace, with ``bubble_fraction`` over the step's window.

    A step's window runs from its first forward (on stage 0) to its last action's end; waits
    that began earlier (the last stage finishes its previous step first and waits for the next
    one's input) are clipped to the window, so that consecutive windows do not overlap.
    """
    ranks = sorted({e.rank for e in events})
    if schedule == "pipedream":
        # 8 PipeDream steps per batch; the trace has whole runs of them. Bubble over the whole trace.
        return {"per_step": [bubble_fraction(events)], "median": bubble_fraction(events)}
    per_rank = {r: [e for e in events if e.rank == r] for r in ranks}
    n_actions = [len(build_schedule(schedule, cfg.stages, cfg.chunks).actions[r]) for r in ranks]
    steps = len(per_rank[ranks[0]]) // n_actions[0]
    values = []
    for k in range(steps):
        evs = []
        for r, n in zip(ranks, n_actions):
            evs += per_rank[r][k * n : (k + 1) * n]
        values.append(bubble_fraction(clip_to_first_forward(evs)))
    return {"per_step": values, "median": statistics.median(values)}


def clip_to_first_forward(events: list[TimedAction]) -> list[TimedAction]:
    start = min(e.start for e in events if e.action.op is Op.FORWARD)
    return [TimedAction(e.rank, e.action, max(e.start, start), e.end) for e in events if e.end > start]


def one_step_events(events: list[TimedAction], schedule: str, cfg: Config, step: int) -> list[TimedAction]:
    """The events of training step ``step`` (0-based within the timed run), re-based to start at 0."""
    ranks = sorted({e.rank for e in events})
    if schedule == "pipedream":
        # PipeDream step k of the benchmark = minibatches 8k..8k+7 admitted; keep those steps' actions.
        # (the warm-up steps were dropped from the trace, so minibatch numbers start after them)
        lo, hi = step * cfg.chunks, (step + 1) * cfg.chunks
        first = min(e.action.step for e in events)
        chosen = [e for e in events if first + lo <= e.action.step < first + hi]
    else:
        chosen = []
        for r in ranks:
            n = len(build_schedule(schedule, cfg.stages, cfg.chunks).actions[r])
            chosen += [e for e in events if e.rank == r][step * n : (step + 1) * n]
        chosen = clip_to_first_forward(chosen)  # from the step's first forward, as measured_bubble
    origin = min(e.start for e in chosen)
    return [TimedAction(e.rank, e.action, e.start - origin, e.end - origin) for e in chosen]


def bound_costs(runs: list[dict]) -> dict[str, list[float]]:
    """Per stage, the median forward, backward and update seconds that the bound's runs measured."""
    quiet = [r for r in runs if r["foreign_cores"] < BUSY_CORES] or runs
    stages = range(len(quiet[0]["op_mean_s"]))
    return {f"{key}_s": [statistics.median(r["op_mean_s"][s][op] for r in quiet) for s in stages]
            for key, op in (("forward", "F"), ("backward", "B"), ("optimizer", "O"))}


def simulated_bound(cfg: Config, flushed: dict[str, list[float]] | None, per_minibatch: dict[str, list[float]] | None
                    ) -> dict[str, Any]:
    """Each schedule's step on the bound's costs with free links: the bubble-limited bound (``interleaved``, ``zb-v``:
    each chunk half a stage's cost; ``zb-h1``, ``zb-v``: the weight-gradient pass half the backward)."""
    out: dict[str, Any] = {}
    for name in FLUSHED + V_SHAPED + ("pipedream",):
        costs = per_minibatch if name == "pipedream" else flushed
        if costs is None:
            continue
        v = VIRTUAL if name in ("interleaved", *V_SHAPED) else 1
        per_stage = {k: [costs[k][stage_rank(name, cfg.stages, s)] / v for s in range(cfg.stages * v)] for k in costs}
        if name == "pipedream":
            sched = build_schedule("pipedream", cfg.stages, minibatches=4 * cfg.chunks)
        else:
            sched = build_schedule(name, cfg.stages, cfg.chunks, **({"virtual_stages": v} if v > 1 else {}))
        r = simulate(sched, per_stage["forward_s"], per_stage["backward_s"], optimizer_s=max(costs["optimizer_s"]))
        step = r.step_time * cfg.chunks if name == "pipedream" else r.step_time
        out[name] = {"step_time_s": step, "bubble_fraction": None if name == "pipedream" else r.bubble_fraction,
                     "costs": costs}
    return out


def step_windows(events: list[TimedAction], schedule: str, cfg: Config) -> list[list[TimedAction]]:
    """The events of each timed training step of a newer schedule (2bw: each minibatch's window of its
    micro-batches), each from the step's first forward."""
    ranks = sorted({e.rank for e in events})
    if schedule == "2bw":
        # Minibatch t's actions carry step t; the drain's come last. Full steps only.
        steps = sorted({e.action.step for e in events})[:-1]
        return [[e for e in events if e.action.step == t] for t in steps]
    sched = build_schedule(schedule, cfg.stages, cfg.chunks, **newer_options(schedule))
    per_rank = {r: [e for e in events if e.rank == r] for r in ranks}
    n = [len(sched.actions[r]) for r in ranks]
    windows = []
    for k in range(len(per_rank[ranks[0]]) // n[0]):
        window = [e for r, count in zip(ranks, n) for e in per_rank[r][k * count : (k + 1) * count]]
        windows.append(clip_to_first_forward(window))
    return windows


def newer_options(schedule: str) -> dict[str, Any]:
    return {"virtual_stages": VIRTUAL} if schedule == "interleaved" else {}


def measured_costs(events: list[TimedAction]) -> dict[str, list[float]]:
    """Per rank, the median seconds of a forward, a backward (B), a weight-gradient half (W) and an update."""
    ranks = sorted({e.rank for e in events})
    out: dict[str, list[float]] = {}
    for op in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_WEIGHT, Op.OPTIMIZER_STEP):
        out[op.value] = []
        for r in ranks:
            values = [e.end - e.start for e in events if e.action.op is op and e.rank == r]
            out[op.value].append(statistics.median(values) if values else 0.0)
    return out


def analytic_bubble(schedule: str, cfg: Config, costs: dict[str, list[float]]) -> float | None:
    """Theory for equal stages: ``(p-1)/(m+p-1)`` for 1f1b; ``((p-1)/v) / (m + (p-1)/v)`` for interleaved;
    ``(p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W))`` for zb-h1 with the ranks' mean F, B (the input-gradient
    half) and W; none for 2bw (no flush)."""
    p, m = cfg.stages, cfg.chunks
    if schedule == "1f1b":
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return ((p - 1) / VIRTUAL) / (m + (p - 1) / VIRTUAL)
    if schedule == "zb-h1":
        f, b, w = (statistics.mean(costs[k]) for k in "FBW")
        idle = (p - 1) * max(0.0, f + b - w)  # W longer than F + B fills the whole bubble
        return idle / (m * (f + b + w) + idle)
    return None


def simulated_newer(schedule: str, cfg: Config, costs: dict[str, list[float]]) -> Any:
    """The simulator's step for each rank's measured costs (free links: the measured waits are part of the bubble)."""
    v = VIRTUAL if schedule == "interleaved" else 1
    per_stage = lambda key: [costs[key][s % cfg.stages] for s in range(cfg.stages * v)]  # noqa: E731
    backward = [b + w for b, w in zip(per_stage("B"), per_stage("W"))]
    kwargs: dict[str, Any] = {"weight_s": per_stage("W")} if schedule == "zb-h1" else {}
    if schedule == "2bw":
        sched = build_schedule("2bw", cfg.stages, cfg.chunks, minibatches=6)
    else:
        sched = build_schedule(schedule, cfg.stages, cfg.chunks, **newer_options(schedule))
    return simulate(sched, per_stage("F"), backward, optimizer_s=max(costs["O"]), **kwargs)


def newer_bubbles(kept_events: dict[str, list[TimedAction]], cfg: Config, plots: Path | None) -> dict[str, Any]:
    """The newer schedules' bubbles from their traces: measured per step, analytic, simulated on the traced
    costs; with ``plots``, one measured step and the simulator's timeline of each as PNGs."""
    out: dict[str, Any] = {}
    for s in NEWER:
        events = kept_events.get(f"ours_{s}_trace")
        if not events:
            continue
        costs = measured_costs(events)
        windows = step_windows(events, s, cfg)
        sim = simulated_newer(s, cfg, costs)
        out[s] = {
            "measured_per_step": [round(bubble_fraction(w), 4) for w in windows],
            "measured_median": statistics.median(bubble_fraction(w) for w in windows) if windows else None,
            "analytic": analytic_bubble(s, cfg, costs),
            "simulated": sim.bubble_fraction if s != "2bw" else None,
            "measured_costs_s": costs,
        }
        if plots is not None and windows:
            window = windows[len(windows) // 2]
            origin = min(e.start for e in window)
            chunks = f", {VIRTUAL} chunks each)" if s == "interleaved" else ")"
            plot_timeline([TimedAction(e.rank, e.action, e.start - origin, e.end - origin) for e in window],
                          plots / f"newer_real_{s}.png",
                          title=f"{s}, measured step ({cfg.stages} processes x {cfg.chunks} micro-batches" + chunks)
            plot_timeline(sim.events, plots / f"newer_sim2_{s}.png", title=f"{s}, simulated with the measured costs")
    return out
