"""Sharded stage replicas against whole ones at 2 stages x 2 replicas on 4 processes: memory and speed, predicted too.

Run from the repository root::

    python -m benchmarks.memory.sharding                      # ~3 min on 2 cores: results/sharding.json
    python -m benchmarks.memory.sharding --quick --out /tmp/sharding.json   # a small model, 1 round: ~40 s

The model is an MLP whose weights and Adam state dominate the memory: 4 x (``Linear(w, 4w)``, ``ReLU``,
``Linear(4w, w)``), w = 512 (33.6 MB of weights, 16.8 MB per stage), split 6 + 6 layers over 2 stages, each stage
on 2 replicas (``Pipeline(replicas=[2, 2], shard=...)``), ``1f1b`` (and ``gpipe`` for memory) with 4 micro-batches
per replica, a union batch of 64 (32 per replica), Adam, gloo, one thread per process.

**Memory** (each mode and schedule in fresh processes): per rank, the peak of live tensor bytes over 3 steps
(``plan.live_bytes.LiveTensorBytes``, which counts a DTensor's local shard and follows FSDP2's in-place frees and
re-allocations of its gathered parameters), what ran at the peak, the bytes of parameters + gradients + optimizer
state this rank holds at the update (``training_state_bytes``: its shards when sharded), and the growth of resident
memory; beside them ``predict_memory(..., replicas=[2, 2], shard=...)`` from ``profile_module`` of one replica's batch.

Beside them, sharded stages with the schedules' other memory shapes, each mode in fresh processes too (``CASES``):
``1f1b`` with ``recompute=True`` (whole replicas as well), ``interleaved`` with 2 model chunks per rank (3 layers
each, every chunk an FSDP2 root of its own) and ``zb-h1`` (its split backward keeps each stage gathered through the
step). Pipeline takes replicas for gpipe and 1f1b only, so the last two run as the strategy builds them: two copies of
a 2-stage pipeline, engine by engine, each stage sharded over its two copies (:class:`Copies`).

**Speed**: the three modes built side by side in one launch, then rounds of ``steps`` timed steps each, the order
rotated every round (interleaved, so that the machine's other load falls on all alike); the median steps/s per mode.
A fourth, ``full`` without the all-gathers started before blocking receives (``ShardedStep.prefetch_ahead``), gives
the paired ratio of what starting them ahead buys (on CPU processes little can overlap: they share the cores).
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

from benchmarks.common.proc_memory import reset_peak_rss, status_kb
from lightning_pipedream import Pipeline
from lightning_pipedream.plan.live_bytes import LiveTensorBytes
from lightning_pipedream.plan.memory import predict_memory, stage_bytes
from lightning_pipedream.plan.profile import profile_module
from lightning_pipedream.runtime.faults.launch import run_local

MODES = (None, "grad_op", "full")
UNPREFETCHED = "full-unprefetched"  # speed only: full, its all-gathers started when the compute starts
SCHEDULES = ("1f1b", "gpipe")
# The other memory shapes of sharded stages: name -> (schedule, recompute, virtual stages, modes measured). Whole
# replicas of the copies' schedules are left out: Copies builds sharded stages only.
CASES: dict[str, tuple[str, bool, int, tuple[str | None, ...]]] = {
    "1f1b-recompute": ("1f1b", True, 1, MODES),
    "interleaved": ("interleaved", False, 2, ("grad_op", "full")),
    "zb-h1": ("zb-h1", False, 1, ("grad_op", "full")),
}
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


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-4)


def _pipeline(run: dict, shard: str | None, schedule: str, recompute: bool = False) -> Pipeline:
    return Pipeline(build_model(run["width"]), loss_fn=nn.functional.mse_loss, optimizer=_adam, schedule=schedule,
                    chunks=CHUNKS, replicas=REPLICAS, shard=shard, recompute=recompute)


class Copies:
    """Two copies of a 2-stage pipeline (ranks 0-1 and 2-3), stage s sharded over ranks s and s + 2: how the strategy
    runs sharded stages under schedules that Pipeline takes no replicas for (zb-h1, interleaved). What
    :func:`memory_worker` reads of a Pipeline, built engine by engine."""

    def __init__(self, run: dict, shard: str, schedule: str, virtual_stages: int) -> None:
        import torch.distributed as dist

        from lightning_pipedream.plan.balance import even_balance, stage_slice
        from lightning_pipedream.runtime.communication.transport import Transport
        from lightning_pipedream.runtime.execution.engine import PipelineEngine
        from lightning_pipedream.runtime.stages.sharding import ShardedStep, shard_stage
        from lightning_pipedream.schedule.specs import spec_of

        pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group, in one order
        replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        self.copy, self.stage_index = divmod(dist.get_rank(), 2)
        model = build_model(run["width"])
        balance = even_balance(len(model), 2 * virtual_stages)
        chunks = [shard_stage(stage_slice(model, balance, c * 2 + self.stage_index), replicas[self.stage_index], shard,
                              torch.device("cpu")) for c in range(virtual_stages)]
        self.module = nn.ModuleList(chunks)
        self.optimizer = _adam(self.module.parameters())
        self.engine = PipelineEngine(chunks if virtual_stages > 1 else chunks[0], self.stage_index, 2,
                                     Transport(group=pipelines[self.copy]), schedule=schedule, chunks=CHUNKS,
                                     virtual_stages=virtual_stages,
                                     sharded_step=ShardedStep(chunks, 2, shard,
                                                           split_backward=spec_of(schedule).splits_backward))

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == 1

    def _update(self, minibatch: int) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> None:
        """This copy's rows of the union batch in CHUNKS micro-batches, each loss its share of the union batch."""
        xs = inputs[self.copy::2].tensor_split(CHUNKS) if inputs is not None else None
        ys = targets[self.copy::2].tensor_split(CHUNKS) if targets is not None else None
        union = len(targets) if targets is not None else 1

        def loss(mb: int, out: torch.Tensor) -> torch.Tensor:
            assert ys is not None
            return nn.functional.mse_loss(out, ys[mb]) * len(ys[mb]) / union

        self.engine.train_step(lambda mb: xs[mb] if xs is not None else None, loss, self._update)


def memory_worker(rank: int, world: int, run: dict, shard: str | None, case: str) -> dict:
    """One rank, fresh: build the stage (``case``: a schedule, or one of :data:`CASES`), then 3 steps under the
    meter."""
    from lightning_pipedream.runtime.stages.sharding import training_state_bytes

    torch.set_num_threads(1)
    meter = LiveTensorBytes()  # it follows FSDP2's in-place frees and re-allocations of gathered parameters
    x, y = make_batch(run["width"], run["batch"])
    rss_base = status_kb("VmRSS")
    schedule, recompute, virtual_stages, _ = CASES.get(case, (case, False, 1, MODES))
    with meter:
        pipe: Any = (_pipeline(run, shard, schedule, recompute) if virtual_stages == 1 and schedule in SCHEDULES
                     else Copies(run, str(shard), schedule, virtual_stages))
    meter.add_all([*pipe.module.parameters(), x, y])
    meter.reset_peak()
    reset_peak_rss()  # VmHWM: the peak from here on
    state = {"at_update": 0}
    update = pipe._update

    def measured_update(minibatch: int) -> None:
        state["at_update"] = max(state["at_update"], training_state_bytes(pipe.module, pipe.optimizer))
        update(minibatch)

    pipe._update = meter.labelled("update", measured_update)  # type: ignore[method-assign]
    for stage in pipe.engine.stages.values():
        for name in ("forward", "backward", "backward_input", "backward_weight"):
            setattr(stage, name, meter.labelled(name, getattr(stage, name)))
    with meter:
        for _ in range(run["memory_steps"]):
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    return {"rank": rank, "stage": pipe.stage_index, "peak_tensor_bytes": meter.peak, "peak_phase": meter.peak_phase,
            "training_state_bytes_at_update": state["at_update"],
            "peak_rss_growth_bytes": (status_kb("VmHWM") - rss_base) * 1024}


def speed_worker(rank: int, world: int, run: dict) -> dict:
    """One rank: every mode built side by side, then interleaved rounds of timed 1f1b steps."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    x, y = make_batch(run["width"], run["batch"])
    pipes = {str(mode): _pipeline(run, mode, "1f1b") for mode in MODES}
    pipes[UNPREFETCHED] = _pipeline(run, "full", "1f1b")
    pipes[UNPREFETCHED].engine.sharded_step.prefetch_ahead = False  # gathers start when the compute does
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
    """predict_memory per schedule (and case) and mode, from the profile of one replica's batch."""
    model = build_model(run["width"])
    x, _ = make_batch(run["width"], run["batch"] // REPLICAS[0])
    profile = profile_module(model, x, warmup=0, repeats=1, working_sets=True)
    n = len(profile.layers)
    cases = {schedule: (schedule, False, 1, MODES) for schedule in SCHEDULES} | CASES
    out: dict[str, dict[str, list[dict]]] = {}
    for case, (schedule, recompute, v, modes) in cases.items():
        sizes = stage_bytes(profile, [n // (2 * v)] * (2 * v))  # interleaved: chunk c of rank r is stage 2c + r
        out[case] = {str(mode): [m.to_json() for m in predict_memory(
            sizes, schedule, CHUNKS, replicas=REPLICAS, virtual_stages=v, recompute=recompute, optimizer=OPTIMIZER,
            shard=mode)] for mode in modes}
    return out


def _load() -> dict:
    return {"loadavg": [round(v, 2) for v in os.getloadavg()], "cores": os.cpu_count()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sharding.json"))
    parser.add_argument("--quick", action="store_true", help="w = 128, one round: a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; --quick 1)")
    parser.add_argument("--only", nargs="+", default=None, metavar="CASE",
                        help=f"measure memory of these only ({', '.join(SCHEDULES + tuple(CASES))}), no speed")
    args = parser.parse_args(argv)
    run = {"width": 128 if args.quick else 512, "batch": 64, "memory_steps": 3, "steps": 3 if args.quick else 10,
           "rounds": args.rounds or (1 if args.quick else 5)}
    started = time.time()
    doc: dict[str, Any] = {
        "command": "python -m benchmarks.memory.sharding" + (" --quick" if args.quick else ""),
        "machine": {"torch": torch.__version__, "load_before": _load()},
        "model": f"4 x (Linear({run['width']}, {4 * run['width']}), ReLU, Linear({4 * run['width']}, {run['width']}))",
        "layout": "2 stages x 2 replicas, 4 processes, gloo", "chunks": CHUNKS, "optimizer": OPTIMIZER, **run,
        "memory": {}, "speed": {},
    }
    predictions = predicted(run)
    measured = [(schedule, MODES) for schedule in SCHEDULES] + [(case, v[3]) for case, v in CASES.items()]
    if args.only is not None:
        unknown = sorted(set(args.only) - {name for name, _ in measured})
        if unknown:
            parser.error(f"--only {' '.join(unknown)}: not a case; choose from {', '.join(n for n, _ in measured)}")
        measured = [(name, modes) for name, modes in measured if name in args.only]
    for schedule, modes in measured:
        doc["memory"][schedule] = {}
        for mode in modes:
            ranks = run_local(memory_worker, 4, run, mode, schedule, timeout=300.0)
            rows = []
            for m in ranks:
                p = predictions[schedule][str(mode)][m["stage"]]
                rows.append({"measured": m, "predicted": p,
                             "ratio": m["peak_tensor_bytes"] / p["predicted_peak_bytes"]})
            doc["memory"][schedule][str(mode)] = rows
            print(f"{schedule:14s} shard={str(mode):7s} " + " | ".join(
                f"r{r['measured']['rank']}: {r['measured']['peak_tensor_bytes'] / 2**20:6.2f} MiB "
                f"/ {r['predicted']['predicted_peak_bytes'] / 2**20:6.2f} ({r['ratio']:.3f}) "
                f"in {r['measured']['peak_phase']}, state "
                f"{r['measured']['training_state_bytes_at_update'] / 2**20:5.2f}" for r in rows), flush=True)
    timed = run_local(speed_worker, 4, run, timeout=600.0) if args.only is None else []
    for mode in (*MODES, UNPREFETCHED) if timed else ():
        seconds = [max(rank["seconds"][str(mode)][i] for rank in timed) for i in range(run["rounds"])]
        doc["speed"][str(mode)] = {"seconds_per_round": seconds,
                                   "steps_per_s_median": run["steps"] / statistics.median(seconds)}
        rates = ", ".join(f"{run['steps'] / s:.2f}" for s in seconds)
        print(f"1f1b shard={str(mode):7s} {doc['speed'][str(mode)]['steps_per_s_median']:.2f} steps/s "
              f"(rounds: {rates})", flush=True)
    if timed:  # each round's full with gathers started ahead against full without, paired
        ahead, not_ahead = (doc["speed"][mode]["seconds_per_round"] for mode in ("full", UNPREFETCHED))
        doc["speed"]["prefetch_speedup_median"] = statistics.median(b / a for a, b in zip(ahead, not_ahead))
        print(f"full: gathers started ahead x{doc['speed']['prefetch_speedup_median']:.3f} steps/s (paired median)")
    doc["machine"]["load_after"] = _load()
    doc["seconds"] = round(time.time() - started, 1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
