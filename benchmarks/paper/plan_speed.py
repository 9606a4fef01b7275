"""How long planning takes: PipeDream's DP on the published profiles, the CLI end to end, and the profiler.

Run from the repository root (the profiles are read from ../shared/pipedream-profiles)::

    python benchmarks/paper/plan_speed.py --json /tmp/plan_speed.json     # ~30 s on 2 busy cores

Each plan is timed from a loaded profile (median of --repeats runs); loading graph.txt is timed apart.
The CLI is timed as a user meets it, a fresh interpreter running ``python -m lightning_pipedream plan`` on
GNMT-16 for 4 servers x 4 workers, interleaved with the same command after an ``import torch`` (what it
cost before planning stopped importing torch).
Targets: GNMT-16 on 4 servers x 4 workers under 1 s (PipeDream's own optimizer had not finished after
8 minutes on this machine), every profile on 16 flat workers under 1 s, and the CLI under 2 s wall.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.common.figures import median_seconds
from lightning_pipedream.plan import Topology, load_pipedream_graph, partition, profile_module

MODELS = ["vgg16", "alexnet", "resnet50", "gnmt8", "gnmt16"]
TOPOLOGIES = {
    "4 flat @ 1 GB/s": Topology.flat(4, 1e9),
    "16 flat @ 1.25 GB/s": Topology.flat(16, 1.25e9),
    "4x4 @ 10, 1.25 GB/s": Topology([(4, 1e10), (4, 1.25e9)]),
    "8x2 @ 25, 3.125 GB/s": Topology([(8, 2.5e10), (2, 3.125e9)]),
}


def plan_times(root: Path, repeats: int) -> list[dict]:
    rows = []
    for model in MODELS:
        path = root / model / "graph.txt"
        load_s = median_seconds(lambda: load_pipedream_graph(path), repeats)
        profile = load_pipedream_graph(path)
        for name, topology in TOPOLOGIES.items():
            for straight in (False, True):
                seconds = median_seconds(lambda: partition(profile, topology, straight=straight), repeats)
                plan = partition(profile, topology, straight=straight)
                rows.append(
                    {
                        "model": model,
                        "layers": len(profile.layers),
                        "topology": name,
                        "straight": straight,
                        "plan_s": seconds,
                        "load_s": load_s,
                        "configuration": "-".join(str(s.replicas) for s in plan.stages),
                        "time_per_minibatch": plan.time_per_minibatch,
                        "speedup_vs_data_parallel": plan.speedup_vs_data_parallel,
                    }
                )
                print(
                    f"{model:9s} {name:22s} {'straight' if straight else '        '} plan {seconds * 1e3:7.1f} ms  "
                    f"-> {rows[-1]['configuration']:30s} {plan.time_per_minibatch * 1e3:8.2f} ms/minibatch",
                    flush=True,
                )
    return rows


def cli_wall_times(root: Path, repeats: int) -> dict:
    """Wall seconds of a fresh ``python -m lightning_pipedream plan`` (GNMT-16, 4x4), and of the same after
    ``import torch``; interleaved, medians."""
    argv = ["--pipedream-graph", str(root / "gnmt16" / "graph.txt"), "--workers", "4,4", "--bandwidth", "1e10,1.25e9"]
    commands = {
        "cli_s": [sys.executable, "-m", "lightning_pipedream", "plan", *argv],
        "cli_with_torch_import_s": [
            sys.executable,
            "-c",
            f"import sys, torch; from lightning_pipedream.cli import main; sys.exit(main({['plan', *argv]!r}))",
        ],
    }
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, command in commands.items():
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True, timeout=120)
            samples[name].append(time.perf_counter() - start)
    result = {name: statistics.median(values) for name, values in samples.items()}
    result["samples"] = samples
    print(
        f"CLI plan GNMT-16 4x4: {result['cli_s']:.2f} s wall; with torch imported first: "
        f"{result['cli_with_torch_import_s']:.2f} s",
        flush=True,
    )
    return result


def profiler_overhead(repeats: int) -> dict:
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(20)])
    sample = torch.randn(128, 512)
    runs = [profile_module(layers, sample) for _ in range(repeats)]
    wall = statistics.median(p.profiling_s for p in runs)
    model_s = statistics.median(sum(l.forward_s + l.backward_s for l in p.layers) for p in runs)
    result = {"layers": 20, "profiling_s": wall, "measured_step_s": model_s, "overhead_x_step": wall / model_s}
    print(
        f"profiler: 20 layers in {wall:.3f} s, {wall / model_s:.1f}x the forward+backward it measured "
        f"({model_s * 1e3:.1f} ms)",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=Path, default=Path("../shared/pipedream-profiles"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    rows = plan_times(args.profiles, args.repeats)
    cli = cli_wall_times(args.profiles, args.repeats)
    overhead = profiler_overhead(args.repeats)
    gnmt = next(r for r in rows if r["model"] == "gnmt16" and r["topology"].startswith("4x4") and not r["straight"])
    flat16 = max(r["plan_s"] for r in rows if r["topology"].startswith("16 flat"))
    targets = {
        "gnmt16_4x4_under_1s": gnmt["plan_s"] < 1.0,
        "all_16_flat_under_1s": flat16 < 1.0,
        "profile_20_layers_under_5s": overhead["profiling_s"] < 5.0,
        "cli_gnmt16_4x4_under_2s": cli["cli_s"] < 2.0,
    }
    print(
        f"GNMT-16 on 4x4: {gnmt['plan_s'] * 1e3:.1f} ms; slowest profile on 16 flat workers: {flat16 * 1e3:.1f} ms; "
        f"targets met: {all(targets.values())}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        machine = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads(),
            "load_average_1_5_15_min": list(os.getloadavg()),  # the machine is shared: how busy it was
        }
        args.json.write_text(
            json.dumps(
                {"plans": rows, "cli": cli, "profiler": overhead, "targets": targets, "machine": machine}, indent=1
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
