"""Sharded stage replicas against whole ones at 2 stages x 2 replicas on 4 processes: memory and speed, predicted too.

Run from the repository root::

    python -m benchmarks.sharding                      # ~3 min on 2 cores: results/sharding.json
    python -m benchmarks.sharding --quick --out /tmp/sharding.json   # a small model, 1 round: ~40 s

The model is an MLP whose weights and Adam state dominate the memory: 4 x (``Linear(w, 4w)``, ``ReLU``,
``Linear(4w, w)``), w = 512 (33.6 MB of weights, 16.8 MB per stage), split 6 + 6 layers over 2 stages, each stage
on 2 replicas (``Pipeline(replicas=[2, 2], shard=...)``), ``1f1b`` (and ``gpipe`` for memory) with 4 micro-batches
per replica, a union batch of 64 (32 per replica), Adam, gloo, one thread per process.

**Memory** (each mode and schedule in fresh processes): per rank, the peak of live tensor bytes over 3 steps
(``plan.live_bytes.LiveTensorBytes``, which counts a DTensor's local shard and follows FSDP2's in-place frees and
re-allocations of its gathered parameters), what ran at the peak, the bytes of parameters + gradients + optimizer
state this rank holds at the update (``training_state_bytes``: its shards when sharded), and the growth of resident
memory; beside them ``predict_memory(..., replicas=[2, 2], shard=...)`` from ``profile_module`` of one replica's batch.

**Speed**: the three modes built side by side in one launch, then rounds of ``steps`` timed steps each, the order
rotated every round (interleaved, so that the machine's other load falls on all alike); the median steps/s per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pipedream import Pipeline
from lightning_pipedream.plan.live_bytes import LiveTensorBytes
from lightning_pipedream.plan.memory import predict_memory, stage_bytes
from lightning_pipedream.plan.profile import profile_module
from lightning_pipedream.runtime.faults.launch import run_local

MODES = (None, "grad_op", "full")
SCHEDULES = ("1f1b", "gpipe")
REPLICAS = [2, 2]
CHUNKS = 4
OPTIMIZER = "adam"


def build_model(width: int, blocks: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*layers)


def make_batch(width: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def _pipeline(run: dict, shard: str | None, schedule: str) -> Pipeline:
    return Pipeline(build_model(run["width"]), loss_fn=nn.functional.mse_loss,
                    optimizer=lambda params: torch.optim.Adam(params, lr=1e-4), schedule=schedule, chunks=CHUNKS,
                    replicas=REPLICAS, shard=shard)


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _follow_fsdp_resizes(meter: LiveTensorBytes) -> None:
    """FSDP2 frees a unit's gathered parameters with ``storage.resize_(0)`` and allocates them again in place, which
    no operator shows the meter: tell it after each."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    for module in (_fsdp_param, _fsdp_param_group):
        for name in ("alloc_storage", "free_storage"):
            original = getattr(_fsdp_param, name)
            if hasattr(module, name):
                def followed(tensor: torch.Tensor, original: Any = original) -> None:
                    original(tensor)
                    meter.resized(tensor)
                setattr(module, name, followed)


def memory_worker(rank: int, world: int, run: dict, shard: str | None, schedule: str) -> dict:
    """One rank, fresh: build the stage, then 3 steps under the meter."""
    from lightning_pipedream.runtime.stages.sharding import training_state_bytes

    torch.set_num_threads(1)
    meter = LiveTensorBytes()
    _follow_fsdp_resizes(meter)
    x, y = make_batch(run["width"], run["batch"])
    rss_base = _status_kb("VmRSS")
    with meter:
        pipe = _pipeline(run, shard, schedule)
    meter.add_all([*pipe.module.parameters(), x, y])
    meter.reset_peak()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on
    state = {"at_update": 0}
    update = pipe._update

    def measured_update(minibatch: int) -> None:
        state["at_update"] = max(state["at_update"], training_state_bytes(pipe.module, pipe.optimizer))
        update(minibatch)

    pipe._update = meter.labelled("update", measured_update)  # type: ignore[method-assign]
    for stage in pipe.engine.stages.values():
        for name in ("forward", "backward"):
            setattr(stage, name, meter.labelled(name, getattr(stage, name)))
    with meter:
        for _ in range(run["memory_steps"]):
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    return {"rank": rank, "stage": pipe.stage_index, "peak_tensor_bytes": meter.peak, "peak_phase": meter.peak_phase,
            "training_state_bytes_at_update": state["at_update"],
            "peak_rss_growth_bytes": (_status_kb("VmHWM") - rss_base) * 1024}


def speed_worker(rank: int, world: int, run: dict) -> dict:
    """One rank: every mode built side by side, then interleaved rounds of timed 1f1b steps."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    x, y = make_batch(run["width"], run["batch"])
    pipes = {str(mode): _pipeline(run, mode, "1f1b") for mode in MODES}
    for pipe in pipes.values():  # warm-up: Adam's state, FSDP2's lazy init, gloo's buffers
        for _ in range(2):
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    names = list(pipes)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(run["rounds"]):
        for name in names[r % len(names):] + names[: r % len(names)]:
            pipe = pipes[name]
            dist.barrier()
            started = time.perf_counter()
            for _ in range(run["steps"]):
                pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
            dist.barrier()
            times[name].append(time.perf_counter() - started)
    return {"rank": rank, "seconds": times}


def predicted(run: dict) -> dict[str, dict[str, list[dict]]]:
    """predict_memory per schedule and mode, from the profile of one replica's batch."""
    model = build_model(run["width"])
    x, _ = make_batch(run["width"], run["batch"] // REPLICAS[0])
    profile = profile_module(model, x, warmup=0, repeats=1, working_sets=True)
    half = len(profile.layers) // 2
    sizes = stage_bytes(profile, [half, len(profile.layers) - half])
    return {schedule: {str(mode): [m.to_json() for m in predict_memory(sizes, schedule, CHUNKS, replicas=REPLICAS,
                                                                       optimizer=OPTIMIZER, shard=mode)]
                       for mode in MODES} for schedule in SCHEDULES}


def _load() -> dict:
    return {"loadavg": [round(v, 2) for v in os.getloadavg()], "cores": os.cpu_count()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sharding.json"))
    parser.add_argument("--quick", action="store_true", help="w = 128, one round: a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; --quick 1)")
    args = parser.parse_args(argv)
    run = {"width": 128 if args.quick else 512, "batch": 64, "memory_steps": 3, "steps": 3 if args.quick else 10,
           "rounds": args.rounds or (1 if args.quick else 5)}
    started = time.time()
    doc: dict[str, Any] = {
        "command": "python -m benchmarks.sharding" + (" --quick" if args.quick else ""),
        "machine": {"torch": torch.__version__, "load_before": _load()},
        "model": f"4 x (Linear({run['width']}, {4 * run['width']}), ReLU, Linear({4 * run['width']}, {run['width']}))",
        "layout": "2 stages x 2 replicas, 4 processes, gloo", "chunks": CHUNKS, "optimizer": OPTIMIZER, **run,
        "memory": {}, "speed": {},
    }
    predictions = predicted(run)
    for schedule in SCHEDULES:
        doc["memory"][schedule] = {}
        for mode in MODES:
            ranks = run_local(memory_worker, 4, run, mode, schedule, timeout=300.0)
            rows = []
            for m in ranks:
                p = predictions[schedule][str(mode)][m["stage"]]
                rows.append({"measured": m, "predicted": p,
                             "ratio": m["peak_tensor_bytes"] / p["predicted_peak_bytes"]})
            doc["memory"][schedule][str(mode)] = rows
            print(f"{schedule:5s} shard={str(mode):7s} " + " | ".join(
                f"r{r['measured']['rank']}: {r['measured']['peak_tensor_bytes'] / 2**20:6.2f} MiB "
                f"/ {r['predicted']['predicted_peak_bytes'] / 2**20:6.2f} ({r['ratio']:.3f}) "
                f"in {r['measured']['peak_phase']}, state "
                f"{r['measured']['training_state_bytes_at_update'] / 2**20:5.2f}" for r in rows), flush=True)
    timed = run_local(speed_worker, 4, run, timeout=600.0)
    for mode in MODES:
        seconds = [max(rank["seconds"][str(mode)][i] for rank in timed) for i in range(run["rounds"])]
        doc["speed"][str(mode)] = {"seconds_per_round": seconds,
                                   "steps_per_s_median": run["steps"] / statistics.median(seconds)}
        rates = ", ".join(f"{run['steps'] / s:.2f}" for s in seconds)
        print(f"1f1b shard={str(mode):7s} {doc['speed'][str(mode)]['steps_per_s_median']:.2f} steps/s "
              f"(rounds: {rates})", flush=True)
    doc["machine"]["load_after"] = _load()
    doc["seconds"] = round(time.time() - started, 1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
