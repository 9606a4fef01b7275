"""PNG timelines of real runs (from their Chrome traces) beside the simulator's, for gpipe, 1f1b and pipedream.

Run from the repository root, after ``python -m benchmarks.speed.schedules`` (which writes one traced step of
each schedule to ``benchmarks/results/traces/real_<schedule>.json`` and the measured costs to its
JSON)::

    python benchmarks/speed/timelines.py --results benchmarks/results/schedules.json \\
        --traces benchmarks/results/traces --out docs/img

writes ``docs/img/real_<schedule>.png`` (the recorded step, both ranks) and
``docs/img/sim2_<schedule>.png`` (``simulate()`` of the same schedule, 2 stages x 8 micro-batches,
fed the per-stage forward/backward/optimizer seconds and the link latency and bandwidth the
benchmark measured). For pipedream both show 8 consecutive minibatches (one step of 512 samples)
in the steady state.

``--strategy-trace DIR --schedule NAME`` draws instead the ``pipeline_trace.json`` file that
``PipeDreamStrategy(trace=DIR)`` writes at the end of training (all of the run's steps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lightning_pipedream.schedule.builders import build_schedule
from lightning_pipedream.schedule.simulate import simulate
from lightning_pipedream.schedule.timeline import (
    TimedAction,
    bubble_fraction,
    from_chrome_trace,
    makespan,
    plot_timeline,
)

SCHEDULES = ("gpipe", "1f1b", "pipedream")


def load_trace(*paths: Path) -> list[TimedAction]:
    """The events of one or more Chrome traces (one per rank, or one with every rank), re-based to start at 0."""
    events: list[TimedAction] = []
    for path in paths:
        events += from_chrome_trace(json.loads(Path(path).read_text()))
    if not events:
        raise ValueError(f"No pipeline events in {', '.join(map(str, paths))}.")
    origin = min(e.start for e in events)
    return [TimedAction(e.rank, e.action, e.start - origin, e.end - origin) for e in events]


def steady_window(events: list[TimedAction], first_step: int, steps: int) -> list[TimedAction]:
    """PipeDream: the actions of training steps ``first_step .. first_step + steps - 1``, re-based."""
    chosen = [e for e in events if first_step <= e.action.step < first_step + steps]
    origin = min(e.start for e in chosen)
    return [TimedAction(e.rank, e.action, e.start - origin, e.end - origin) for e in chosen]


def simulated(schedule: str, results: dict) -> tuple[list[TimedAction], float]:
    """The simulator's events for ``schedule`` with the benchmark's measured costs, and its step time."""
    cfg, prof, link = results["config"], results["profile"], results["link"]
    stages, chunks = cfg["stages"], cfg["chunks"]
    kwargs = dict(
        activation_bytes=link["activation_bytes"],
        bandwidth=link["bandwidth_Bps"],
        latency=link["latency_s"],
        optimizer_s=max(prof["optimizer_s"]),
    )
    if schedule == "pipedream":
        r = simulate(
            build_schedule("pipedream", stages, minibatches=4 * chunks), prof["forward_s"], prof["backward_s"], **kwargs
        )
        return steady_window(r.events, 2 * chunks, chunks), r.step_time * chunks
    r = simulate(build_schedule(schedule, stages, chunks), prof["forward_s"], prof["backward_s"], **kwargs)
    return r.events, r.step_time


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results/schedules.json"))
    parser.add_argument("--traces", type=Path, default=Path("benchmarks/results/traces"))
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    parser.add_argument("--strategy-trace", type=Path, help="a PipeDreamStrategy(trace=DIR) directory to draw instead")
    parser.add_argument("--schedule", choices=SCHEDULES, help="the schedule of --strategy-trace")
    args = parser.parse_args(argv)

    if args.strategy_trace:
        files = sorted(args.strategy_trace.glob("pipeline_trace.json"))  # rank 0's merged trace of every rank
        if not files:
            parser.error(f"no pipeline_trace.json in {args.strategy_trace}")
        events = load_trace(*files)
        name = args.schedule or "run"
        path = plot_timeline(
            events,
            args.out / f"real_{name}_strategy.png",
            title=f"{name}: PipeDreamStrategy trace, {len({e.rank for e in events})} ranks, {_ms(makespan(events))}",
        )
        print(f"wrote {path}")
        return

    results = json.loads(args.results.read_text())
    cfg = results["config"]
    size = f"{cfg['stages']} stages x {cfg['chunks']} micro-batches of {cfg['micro_batch']}"
    for schedule in SCHEDULES:
        trace = args.traces / f"real_{schedule}.json"
        sim_events, sim_step = simulated(schedule, results)
        what = "8 minibatches of 64 (steady state)" if schedule == "pipedream" else size
        sim_path = plot_timeline(
            sim_events,
            args.out / f"sim2_{schedule}.png",
            title=f"simulated {schedule}: {what}, measured costs; step {_ms(sim_step)}, "
            f"bubble {bubble_fraction(sim_events):.2f}",
        )
        print(f"wrote {sim_path}")
        if not trace.exists():
            print(f"no {trace}; run python -m benchmarks.speed.schedules first", file=sys.stderr)
            continue
        events = load_trace(trace)
        path = plot_timeline(
            events,
            args.out / f"real_{schedule}.png",
            title=f"real {schedule}: {what}, 1 thread per rank; step {_ms(makespan(events))}, "
            f"bubble {bubble_fraction(events):.2f}",
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
