"""Simulated timelines of every schedule (docs/img/sim_<schedule>.png) and a table of their predictions.

Run from the repository root: `python benchmarks/speed/plot_simulated.py [--stages 4 --chunks 8 --out docs/img]`.
Costs are unit-free: forward 1, backward 2 per micro-batch on every stage, free links.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_pipedream.schedule.builders import SCHEDULES, build_schedule
from lightning_pipedream.schedule.simulate import simulate
from lightning_pipedream.schedule.timeline import plot_timeline


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--forward", type=float, default=1.0)
    parser.add_argument("--backward", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args(argv)
    print("| schedule | step time | makespan | bubble | analytic bubble | peak activations per rank |")
    print("|---|---|---|---|---|---|")
    for name in SCHEDULES:
        result = simulate(build_schedule(name, args.stages, args.chunks), args.forward, args.backward)
        title = f"{name}: {args.stages} stages x {args.chunks}, forward {args.forward:g}, backward {args.backward:g}"
        path = plot_timeline(result.events, args.out / f"sim_{name}.png", title=title)
        p, m = args.stages, args.chunks
        analytic = f"{(p - 1) / (m + p - 1):.3f}" if name in ("gpipe", "1f1b") else "-"
        step = f"{result.step_time:g}" + (" per minibatch" if result.steady_state else "")
        peaks = " ".join(map(str, result.peak_activations))
        print(f"| {name} | {step} | {result.makespan:g} | {result.bubble_fraction:.3f} | {analytic} | {peaks} |")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
