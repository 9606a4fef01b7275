"""Steps/s of the newer schedules (zb-h1, interleaved, 2bw) beside torch.distributed.pipelining's, on 2 processes.

Run from the repository root::

    python -m benchmarks.schedules_newer --json benchmarks/results/schedules_newer.json   # ~5-8 minutes
    python -m benchmarks.schedules_newer --quick --json /tmp/newer.json                   # ~1-2 minutes

The workload is benchmarks/schedules.py's: 8 x (Linear(1024, 1024) + ReLU), MSE, plain SGD, a
batch of 512 in 8 micro-batches, 2 processes of 1 thread over gloo on loopback. Contenders:

* ``ours_<schedule>``: our ``Pipeline(schedule=...)``, one ``step()`` per batch (``interleaved``
  with ``virtual_stages=2``: 4 stages of 2 blocks, process r holding stages r and r + 2;
  ``2bw`` keeps the pipeline full and drains at the end of the timed run).
* ``torch_<schedule>``: torch's ``Schedule1F1B`` (one stage per process),
  ``ScheduleInterleaved1F1B`` (2 stages per process, the same split as ours) and
  ``ScheduleInterleavedZeroBubble`` with one stage per process (torch's zero-bubble schedule on
  our layout; ours is ZB-H1), then one SGD step. torch has no 2BW.
* ``ours_<schedule>_trace``: ours with every action recorded, for the measured bubble and the
  timelines.

Rounds are interleaved (each contender once per round, the order rotating); the figures are
medians over rounds. The ratio ``ours / torch`` of each schedule is the median of the per-round
ratios (each round's two runs are minutes apart at most). Bubble: from the traced runs, per
step, ``1 - busy / (ranks x step window)``, against the analytic value for the measured
per-micro-batch costs (``(p-1)/(m+p-1)`` for 1f1b; ``((p-1)/v) / (m + (p-1)/v)`` for
interleaved; ``(p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W))`` for zb-h1, B the input-gradient half).
With ``--plots DIR`` it draws one traced step of each new schedule (``newer_real_<name>.png``)
and the simulator's timeline for the measured costs (``newer_sim2_<name>.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.workload import (
    BUSY_CORES,
    Config,
    LoadMeter,
    _timed,
    build_model,
    idle_load,
    make_batch,
    sgd,
    torch_step,
    wait_for_quiet,
)
from lightning_pipedream.plan.balance import even_balance, stage_slice
from lightning_pipedream.runtime.launch import run_local
from lightning_pipedream.runtime.pipeline import Pipeline
from lightning_pipedream.schedule.actions import Op
from lightning_pipedream.schedule.builders import build_schedule
from lightning_pipedream.schedule.simulate import simulate
from lightning_pipedream.schedule.timeline import TimedAction, bubble_fraction, plot_timeline

OURS = ("1f1b", "zb-h1", "interleaved", "2bw")
TORCH = ("1f1b", "zb-h1", "interleaved")  # torch's schedule for the same name (see the module's docstring)
VIRTUAL = 2  # model chunks per process for interleaved


def _options(schedule: str) -> dict[str, Any]:
    return {"virtual_stages": VIRTUAL} if schedule == "interleaved" else {}


def ours_worker(rank: int, world: int, cfg: Config, schedule: str, record: bool, warmup: int, steps: int) -> dict:
    torch.set_num_threads(1)
    x, y = make_batch(cfg)
    pipe = Pipeline(build_model(cfg), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule=schedule,
                    chunks=cfg.chunks, record=record, **_options(schedule))
    executor = pipe.engine.executor
    out = _timed(lambda: pipe.step(x, y), warmup, steps, pipe.drain if schedule == "2bw" else None,
                 after_warmup=executor.records.clear)
    if record:
        out["events"] = list(executor.records)
    return out


def torch_worker(rank: int, world: int, cfg: Config, schedule: str, warmup: int, steps: int) -> dict:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    torch.set_num_threads(1)
    x, y = make_batch(cfg)
    model = build_model(cfg)
    v = VIRTUAL if schedule == "interleaved" else 1
    balance = even_balance(len(model), world * v)
    indices = [c * world + rank for c in range(v)]  # the same layout as ours
    modules = [stage_slice(model, balance, i) for i in indices]
    stages = [PipelineStage(m, i, world * v, torch.device("cpu")) for m, i in zip(modules, indices)]
    # loss_fn is mean-reduced and torch divides each micro-batch's gradient by their count: the batch's mean.
    if schedule == "1f1b":
        sched = Schedule1F1B(stages[0], n_microbatches=cfg.chunks, loss_fn=nn.functional.mse_loss)
    else:
        cls = ScheduleInterleaved1F1B if schedule == "interleaved" else ScheduleInterleavedZeroBubble
        sched = cls(stages, n_microbatches=cfg.chunks, loss_fn=nn.functional.mse_loss)
    opt = sgd([p for m in modules for p in m.parameters()])
    return _timed(torch_step(sched, opt, x, y, rank, world), warmup, steps)


def contenders(trace: bool = True) -> list[str]:
    names = [f"ours_{s}" for s in OURS] + [f"torch_{s}" for s in TORCH]
    return names + ([f"ours_{s}_trace" for s in OURS] if trace else [])


def run_contender(name: str, cfg: Config, warmup: int, steps: int, timeout: float) -> dict:
    kind, schedule = name.split("_", 1)
    trace = schedule.endswith("_trace")
    schedule = schedule.removesuffix("_trace")
    if kind == "ours":
        results = run_local(ours_worker, cfg.stages, cfg, schedule, trace, warmup, steps, timeout=timeout)
    else:
        results = run_local(torch_worker, cfg.stages, cfg, schedule, warmup, steps, timeout=timeout)
    t0, t1 = min(r["t0"] for r in results), max(r["t1"] for r in results)
    run: dict[str, Any] = {"seconds": t1 - t0, "steps_per_s": steps / (t1 - t0)}
    losses = [r["loss"] for r in results if r["loss"] is not None]
    run["loss"] = losses[-1] if losses else None
    if trace:
        run["events"] = [
            TimedAction(rank, a, s - t0, e - t0) for rank, r in enumerate(results) for a, s, e in r["events"]
        ]
    return run


# ---------------------------------------------------------------------------------------------
# Bubbles: measured from the traces, and what theory gives for the measured costs.


def step_windows(events: list[TimedAction], schedule: str, cfg: Config) -> list[list[TimedAction]]:
    """The events of each timed training step (2bw: each minibatch's window of 8 micro-batches)."""
    ranks = sorted({e.rank for e in events})
    if schedule == "2bw":
        # Minibatch t's actions carry step t; the drain's come last. Full steps only.
        steps = sorted({e.action.step for e in events})[:-1]
        return [[e for e in events if e.action.step == t] for t in steps]
    sched = build_schedule(schedule, cfg.stages, cfg.chunks, **_options(schedule))
    per_rank = {r: [e for e in events if e.rank == r] for r in ranks}
    n = [len(sched.actions[r]) for r in ranks]
    windows = []
    for k in range(len(per_rank[ranks[0]]) // n[0]):
        window = [e for r, count in zip(ranks, n) for e in per_rank[r][k * count : (k + 1) * count]]
        start = min(e.start for e in window if e.action.op is Op.FORWARD)  # from the step's first forward
        windows.append([TimedAction(e.rank, e.action, max(e.start, start), e.end) for e in window if e.end > start])
    return windows


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
    """Theory for equal stages; for zb-h1 with the ranks' mean F, B and W (on 2 stages stage 0's B is empty)."""
    p, m = cfg.stages, cfg.chunks
    if schedule == "1f1b":
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return ((p - 1) / VIRTUAL) / (m + (p - 1) / VIRTUAL)
    if schedule == "zb-h1":
        f, b, w = (statistics.mean(costs[k]) for k in "FBW")  # B: the input-gradient half
        idle = (p - 1) * max(0.0, f + b - w)  # W longer than F + B fills the whole bubble
        return idle / (m * (f + b + w) + idle)
    return None  # 2bw: no flush, no bubble in the steady state


def simulated(schedule: str, cfg: Config, costs: dict[str, list[float]]) -> Any:
    """The simulator's step for each rank's measured costs (free links: the measured waits are part of the bubble)."""
    v = VIRTUAL if schedule == "interleaved" else 1
    per_stage = lambda key: [costs[key][s % cfg.stages] for s in range(cfg.stages * v)]  # noqa: E731
    backward = [b + w for b, w in zip(per_stage("B"), per_stage("W"))]
    kwargs: dict[str, Any] = {"weight_s": per_stage("W")} if schedule == "zb-h1" else {}
    if schedule == "2bw":
        sched = build_schedule("2bw", cfg.stages, cfg.chunks, minibatches=6)
    else:
        sched = build_schedule(schedule, cfg.stages, cfg.chunks, **_options(schedule))
    return simulate(sched, per_stage("F"), backward, optimizer_s=max(costs["O"]), **kwargs)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/schedules_newer.json"))
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 steps, smaller model (about a minute)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--plots", type=Path, default=None, help="draw real and simulated timelines into this folder")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--max-wait", type=float, default=10.0, help="seconds to wait for a quiet machine per run")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    steps = args.steps or (3 if args.quick else 8)
    cfg = Config(width=256, batch=128) if args.quick else Config()
    names = contenders()
    load0 = idle_load(1.0)
    print(f"machine: {os.cpu_count()} CPUs, load average {load0['loadavg_1m']:.2f}, others using "
          f"{load0['foreign_cores']:.2f} cores", flush=True)
    started = time.time()
    runs: dict[str, list[dict]] = {n: [] for n in names}
    events: dict[str, list[TimedAction]] = {}
    for rnd in range(rounds):
        for name in names[rnd % len(names):] + names[: rnd % len(names)]:
            wait_for_quiet(args.max_wait)
            with LoadMeter() as meter:
                run = run_contender(name, cfg, args.warmup, steps, args.timeout)
            run["foreign_cores"], run["loadavg_1m"] = meter.foreign_cores, meter.loadavg
            if "events" in run:
                events[name] = run.pop("events")  # the last round's
            runs[name].append(run)
            print(f"round {rnd + 1}/{rounds} {name:24s} {run['steps_per_s']:7.3f} steps/s "
                  f"(others using {meter.foreign_cores:.2f} cores)", flush=True)
    doc: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.schedules_newer", *(sys.argv[1:] if argv is None else argv)]),
        "config": cfg.__dict__ | {"virtual_stages": VIRTUAL},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "load_before": load0},
        "rounds": rounds, "steps": steps, "warmup": args.warmup,
        "busy": any(r["foreign_cores"] > BUSY_CORES for rs in runs.values() for r in rs),
        "contenders": {n: {"steps_per_s": statistics.median(r["steps_per_s"] for r in rs),
                           "runs": [r["steps_per_s"] for r in rs],
                           "foreign_cores": [round(r["foreign_cores"], 2) for r in rs]} for n, rs in runs.items()},
    }
    doc["ours_over_torch"] = {
        s: {"median_of_round_ratios": statistics.median(
                a["steps_per_s"] / b["steps_per_s"] for a, b in zip(runs[f"ours_{s}"], runs[f"torch_{s}"])),
            "round_ratios": [round(a["steps_per_s"] / b["steps_per_s"], 3)
                             for a, b in zip(runs[f"ours_{s}"], runs[f"torch_{s}"])]}
        for s in TORCH
    }
    doc["bubble"] = {}
    for s in OURS:
        evs = events[f"ours_{s}_trace"]
        costs = measured_costs(evs)
        windows = step_windows(evs, s, cfg)
        sim = simulated(s, cfg, costs)
        doc["bubble"][s] = {
            "measured_per_step": [round(bubble_fraction(w), 4) for w in windows],
            "measured_median": statistics.median(bubble_fraction(w) for w in windows),
            "analytic": analytic_bubble(s, cfg, costs),
            "simulated": sim.bubble_fraction if s != "2bw" else None,
            "measured_costs_s": costs,
        }
        if args.plots is not None and s != "1f1b":  # 1f1b's: benchmarks/timelines.py
            window = windows[len(windows) // 2]
            origin = min(e.start for e in window)
            plot_timeline([TimedAction(e.rank, e.action, e.start - origin, e.end - origin) for e in window],
                          args.plots / f"newer_real_{s}.png", title=f"{s}, measured step (2 processes x {cfg.chunks} "
                          "micro-batches" + (f", {VIRTUAL} chunks each)" if s == "interleaved" else ")"))
            plot_timeline(sim.events, args.plots / f"newer_sim2_{s}.png",
                          title=f"{s}, simulated with the measured costs")
    doc["seconds"] = time.time() - started
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1))
    for s, r in doc["ours_over_torch"].items():
        print(f"ours/torch {s:12s} {r['median_of_round_ratios']:.3f}  rounds {r['round_ratios']}")
    for s, b in doc["bubble"].items():
        print(f"bubble {s:12s} measured {b['measured_median']:.3f}  analytic {b['analytic']}  "
              f"simulated {b['simulated']}")
    return doc


if __name__ == "__main__":
    main()
