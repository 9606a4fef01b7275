"""What the transport GPUs take costs on CPU processes: ``directional`` against ``gloo`` and ``auto`` (shared memory).

Run from the repository root::

    python -m benchmarks.speed.transports --json benchmarks/results/transports.json     # 5 rounds, ~2 minutes
    python -m benchmarks.speed.transports --rounds 1 --steps 2 --json /tmp/t.json       # smoke run

Every contender is the same ``Pipeline`` (8 x Linear(width) + ReLU, MSE, SGD) on 2 processes of one thread each,
run in fresh processes (``run_local``); only the transport differs:

* ``auto``: shared-memory rings between the two ranks (the CPU default);
* ``gloo``: torch.distributed point to point over gloo, both directions of the link on one process group;
* ``directional``: the same over gloo, messages to the higher rank on the pipeline's group and to the lower rank on a
  second group of the same ranks (what runs under NCCL, see runtime/communication/transport.py).

A round runs each contender once, the order rotating from round to round; each run times ``steps`` steps after two
warm-up steps (rank 1's wall time; both ranks end each flushed step together). Figures are medians over rounds and
the ratio to ``gloo`` within each round (then its median), so that the machine's swings cancel out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

CONTENDERS = ("auto", "gloo", "directional")


def _rank(rank: int, world: int, transport: str, schedule: str, width: int, batch: int, chunks: int,
          steps: int) -> float:
    import torch
    from torch import nn

    from lightning_pipedream.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(width, width), nn.ReLU())])
    pipe = Pipeline(layers, loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
                    schedule=schedule, chunks=chunks, transport=transport)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    for _ in range(2):
        pipe.step(x, y)
    start = time.perf_counter()
    for _ in range(steps):
        pipe.step(x, y)
    pipe.drain()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_pipedream.runtime.faults.launch import run_local

    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[: r % len(CONTENDERS)]
        times = {}
        for name in order:
            seconds = run_local(_rank, 2, name, args.schedule, args.width, args.batch, args.chunks, args.steps,
                                timeout=600)
            times[name] = seconds[1] / args.steps * 1e3
            print(f"round {r}: {name:12s} {times[name]:8.2f} ms/step", flush=True)
        rounds.append(times)
    summary = {name: statistics.median(t[name] for t in rounds) for name in CONTENDERS}
    ratios = {name: statistics.median(t[name] / t["gloo"] for t in rounds) for name in CONTENDERS}
    return {
        "command": "python -m benchmarks.speed.transports " + " ".join(f"--{k} {v}" for k, v in vars(args).items()
                                                                 if k != "json"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_before": os.getloadavg()},
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "ms_per_step_median": summary,
        "ratio_to_gloo_median": ratios,
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/transports.json"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args(argv)
    result = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    for name in CONTENDERS:
        print(f"{name:12s} {result['ms_per_step_median'][name]:8.2f} ms/step  "
              f"x{result['ratio_to_gloo_median'][name]:.3f} of gloo")


if __name__ == "__main__":
    main()
