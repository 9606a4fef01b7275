"""Steps/s of every schedule against the machine's bound, torch.distributed.pipelining and one process, on N stages.

Run from the repository root::

    python -m benchmarks.speed.schedules --json benchmarks/results/schedules.json          # 8-12 minutes
    python -m benchmarks.speed.schedules --quick --json /tmp/quick.json                     # < 3 minutes
    python -m benchmarks.speed.schedules --only ours_pipedream,ours_pipedream_trace --malloc keep   # a few contenders
    python -m benchmarks.speed.schedules --stages 4 --layers 16 --json /tmp/four.json     # 4 stages: needs >= 4 cores

The model is 8 x (Linear(1024, 1024) + ReLU) with MSE loss and plain SGD; a step is a batch of
512 samples in 8 micro-batches of 64. Every multi-process contender runs ``--stages`` processes (default 2; one
stage each, the model split evenly) with 1 thread each, over gloo on loopback; interleaved needs
``--layers`` >= 2 x stages (a Linear in every model chunk), the default ``--layers`` is 8 or that. Contenders:

* ``bound``: the machine's bound for PipeDream's work: each process runs only its own stage (8
  forwards and backwards of 64 on stand-in inputs, an SGD step after each), both at once, with no
  communication. ``bound_batch``: the same with one SGD step per batch (a flushed schedule's work).
  Every contender's ``share_of_bound`` is its steps/s over that of the bound doing the same updates.
* ``ours_<schedule>`` for gpipe, 1f1b, pipedream, zb-h1, interleaved (``virtual_stages=2``: process r
  holds stages r and r + 2), zb-v (two chunks in a V: process r holds stages r and 2p-1-r) and 2bw: our
  ``Pipeline``, one ``step()`` per batch of 512; ``pipedream``
  takes one minibatch per ``step()``, so its step is 8 calls of 64 samples (8 optimizer steps per
  stage). The asynchronous ones keep the pipeline full and the timed run ends with ``drain()``.
* ``ours_*_trace``: the same with ``trace=True`` (the executor records every action): the measured
  bubble, the per-action breakdown of each rank's time and the costs the simulator replays.
* ``torch_<schedule>``: ``PipelineStage`` + torch's ``ScheduleGPipe``, ``Schedule1F1B``,
  ``ScheduleInterleavedZeroBubble`` (for zb-h1: torch's zero-bubble schedule on our layout) or
  ``ScheduleInterleaved1F1B`` (our layout) or ``ScheduleZBVZeroBubble`` (zb-v, the same V) on the same split, then
  one SGD step. torch has no 2BW.
* ``one_thread``: one process, 1 thread, the same 8 micro-batches one after another (gradient
  accumulation), then one SGD step: the work of one step with no parallelism.
* ``one_thread_per_minibatch``: one process, 1 thread, an SGD step after every 64 samples: the
  work PipeDream does (8 optimizer steps per 512 samples), without its pipeline.
* ``two_threads`` (``threads_<N>`` on N != 2 stages): one process, as many threads (intra-op) as stages, the whole
  batch of 512 at once.

The one-process contenders and the bound zero their gradients as the best plain loop does
(``workload.zero_grads``: freed under ``--malloc keep``, where the next backward hands over new ones with no pass of
zeros and no add; kept otherwise, where freeing would fault their pages in again); ``--malloc`` applies to every
contender alike.

The contenders are interleaved: every round runs each once, the order rotating from round to
round; the figures are medians over rounds, and over the runs during which the machine was
quiet. Before each run it waits (within a budget) for other processes to calm down. Before and
during the runs the machine's load is recorded: ``foreign_cores`` is the CPU time used by
processes other than the benchmark's, per second of wall time (from /proc/stat minus our
children's rusage), the best sign of a busy machine. Every run records the CPU seconds of each
thread of each process (gloo's included).

Besides steps/s the run measures what the simulator needs (per-stage forward/backward of a
micro-batch in isolation and with both stages running at once, the optimizer step, the link's
latency and bandwidth, and the same costs as the traced runs recorded them), predicts every
schedule's step time with ``lightning_pipedream.schedule.simulate``, and compares it, and the
bubble measured from the traced runs, with the measurements. ``simulated_bound`` is each flushed
schedule's bubble-limited bound: the simulator fed the bound's own costs, with free links. Traces
(Chrome/Perfetto JSON, one step of each schedule, both ranks) go to a temporary folder, or to
``--trace-dir`` for ``benchmarks/speed/timelines.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.figures import median_or_none, spread
from benchmarks.common.workload import (
    BUSY_CORES,
    GRADS_ENV,
    LR,
    NEWER,
    OURS,
    TORCH,
    TORCH_NEWER,
    V_SHAPED,
    VIRTUAL,
    Config,
    LoadMeter,
    bound_worker,
    idle_load,
    link_worker,
    ours_worker,
    profile,
    single_worker,
    torch_dualpipev,
    torch_worker,
    wait_for_quiet,
)
from benchmarks.speed.schedule_traces import (
    action_overheads,
    bound_costs,
    measured_bubble,
    newer_bubbles,
    one_step_events,
    predict,
    simulated_bound,
    trace_costs,
)
from lightning_pipedream.runtime.communication.transport import TRANSPORT_ENV
from lightning_pipedream.runtime.execution.allocator import keep_freed_memory
from lightning_pipedream.runtime.faults.launch import run_local
from lightning_pipedream.schedule.timeline import (
    TimedAction,
    makespan,
    to_chrome_trace,
)

ALL_OURS = OURS + NEWER + V_SHAPED
ALL_TORCH = TORCH + TORCH_NEWER + V_SHAPED
BOUNDS = ("bound", "bound_batch")
# Ours over torch.distributed (gloo's TCP pairs) instead of shared memory between the two local ranks
OVER_GLOO = ("gpipe", "1f1b", "pipedream")
PER_MINIBATCH = ("ours_pipedream", "ours_pipedream_trace", "ours_pipedream_gloo", "one_thread_per_minibatch", "bound")


def schedule_of(name: str) -> str:
    """The schedule a contender runs: ``ours_pipedream_gloo`` -> ``pipedream``."""
    return name.removeprefix("ours_").removeprefix("torch_").removesuffix("_trace").removesuffix("_gloo")

# ---------------------------------------------------------------------------------------------
# The run


def threads_contender(stages: int = 2) -> str:
    """The one-process contender with as many intra-op threads as the pipeline has stages."""
    return "two_threads" if stages == 2 else f"threads_{stages}"


def contenders(include_trace: bool = True, stages: int = 2) -> list[str]:
    names = []
    for s in ALL_OURS:
        names.append(f"ours_{s}")
        if include_trace and s not in V_SHAPED:  # the traces' analysis knows the one-chunk and interleaved layouts
            names.append(f"ours_{s}_trace")
        if s in OVER_GLOO:
            names.append(f"ours_{s}_gloo")
    # torch's DualPipeV only where the installed torch has it (2.9 and later)
    names += [f"torch_{s}" for s in ALL_TORCH if s != "dualpipev" or torch_dualpipev() is not None]
    names += ["one_thread", "one_thread_per_minibatch", threads_contender(stages), *BOUNDS]
    return names


def bound_of(name: str) -> str:
    """The bound doing the same updates as contender ``name``: one per minibatch, or one per batch."""
    return "bound" if name in PER_MINIBATCH else "bound_batch"


def run_contender(name: str, cfg: Config, warmup: int, steps: int, timeout: float, keep_trace: bool = False) -> dict:
    if name.startswith("ours_"):
        schedule = schedule_of(name)
        trace = name.endswith("_trace")
        before = os.environ.get(TRANSPORT_ENV)
        os.environ[TRANSPORT_ENV] = "gloo" if name.endswith("_gloo") else "auto"  # the ranks inherit it
        try:
            results = run_local(
                ours_worker, cfg.stages, cfg, schedule, trace, warmup, steps, int(keep_trace), timeout=timeout
            )
        finally:
            if before is None:
                os.environ.pop(TRANSPORT_ENV)
            else:
                os.environ[TRANSPORT_ENV] = before
    elif name.startswith("torch_"):
        results = run_local(torch_worker, cfg.stages, cfg, name.removeprefix("torch_"), warmup, steps, timeout=timeout)
    elif name in BOUNDS:
        results = run_local(bound_worker, cfg.stages, cfg, name == "bound", warmup, steps, timeout=timeout)
    else:
        threads = cfg.stages if name == threads_contender(cfg.stages) else 1
        results = run_local(
            single_worker, 1, cfg, threads, warmup, steps, name == "one_thread_per_minibatch", timeout=timeout
        )
    t0 = min(r["t0"] for r in results)
    t1 = max(r["t1"] for r in results)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    run = {
        "seconds": t1 - t0,
        "steps": steps,
        "steps_per_s": steps / (t1 - t0),
        "loss": losses[-1] if losses else None,
        "cpu_s_per_step": sum(r["cpu_s"] for r in results) / steps,
        "page_faults_per_step": sum(r["faults"] for r in results) / steps,
        "shared_memory": any(r.get("shared_memory", False) for r in results),  # ours: the ranks' transport
        # per rank, the CPU seconds of each of its threads per step (main, gloo's, ...)
        "threads_cpu_s_per_step": [{k: round(v / steps, 5) for k, v in r["threads_cpu_s"].items()} for r in results],
    }
    if "op_mean_s" in results[0]:
        run["op_mean_s"] = [r["op_mean_s"] for r in results]
    if "breakdown_s" in results[0]:
        run["breakdown_s_per_step"] = [{k: v / steps for k, v in r["breakdown_s"].items()} for r in results]
    if "busy_s" in results[0]:
        busy = sum(r["busy_s"] for r in results)
        run["bubble_whole_step"] = 1 - busy / (len(results) * (t1 - t0))
        run["actions_per_step_per_rank"] = results[0]["actions"] / steps
    if keep_trace and "events" in results[0]:
        run["events"] = [
            TimedAction(rank, a, s - t0, e - t0) for rank, r in enumerate(results) for a, s, e in r["events"]
        ]
    return run


def _lower(a: dict, b: dict) -> dict:
    """Per stage, the lower of two profiles' costs (the one less disturbed by other processes)."""
    return {k: [min(x, y) for x, y in zip(a[k], b[k])] for k in a}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main(argv: list[str] | None = None) -> dict:
    parser, args = _parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 6)
    steps = args.steps or (3 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if args.max_wait is None:
        args.max_wait = 5.0 if args.quick else 20.0
    if args.wait_budget is None:
        args.wait_budget = 20.0 if args.quick else 150.0
    layers = args.layers if args.layers is not None else max(8, VIRTUAL * args.stages)
    cfg = Config(layers=layers, width=args.width, batch=args.batch, chunks=args.chunks, stages=args.stages)
    if args.malloc == "keep" and not keep_freed_memory():
        parser.error("--malloc keep needs glibc")
    os.environ[GRADS_ENV] = "free" if args.malloc == "keep" else "keep"  # the workers' zero_grads
    names = contenders(include_trace=not args.no_trace_contenders, stages=cfg.stages)
    if args.only:
        wanted = set(args.only.split(",")) | {"one_thread", *BOUNDS}
        unknown = wanted - set(contenders(stages=cfg.stages))
        if unknown:
            parser.error(f"unknown contenders {sorted(unknown)}; choose from {contenders(stages=cfg.stages)}")
        names = [n for n in names if n in wanted]
    if cfg.stages < 2:
        parser.error("--stages must be at least 2")
    if any(schedule_of(n) == "interleaved" for n in names) and cfg.layers < VIRTUAL * cfg.stages:
        parser.error(f"interleaved on {cfg.stages} stages holds {VIRTUAL * cfg.stages} model chunks: "
                     f"--layers must be at least {VIRTUAL * cfg.stages} (a Linear in each)")
    started = time.time()

    load0 = _report_machine_load(args.quick)
    repeats = 10 if args.quick else 30
    waited = wait_for_quiet(args.max_wait)
    prof_before = profile(cfg, repeats, concurrent=False, timeout=args.timeout)
    link_before = run_local(link_worker, cfg.stages, cfg, repeats, timeout=args.timeout)[0]
    runs, kept_events, waited = _run_rounds(names, cfg, rounds, warmup, steps, args, waited)
    sim, waited = _simulate(cfg, runs, repeats, args, waited, prof_before, link_before)
    results = _summarize(names, runs, cfg)
    _compare(results, runs, names, cfg, sim)
    _shares(results, runs, cfg, sim)
    # the committed traces (benchmarks/results/traces) change only when asked to
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="bench_traces_")
    trace_overhead, bubbles = _trace_results(runs, results, kept_events, sim, cfg, steps, trace_dir)
    print(f"traces of one step per schedule: {trace_dir}", flush=True)
    bubbles |= newer_bubbles(kept_events, cfg, args.plots)
    doc = _document(cfg, args, rounds, steps, warmup, load0, runs, results, sim, bubbles, trace_overhead)
    doc["seconds"] = time.time() - started
    doc["seconds_waiting_for_quiet"] = waited
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    _print_summary(doc)
    return doc


def _parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/schedules.json"))
    parser.add_argument("--quick", action="store_true", help="short run (< 2 minutes): 2 rounds of 3 steps")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument(
        "--trace-dir", default="",
        help="where the traced runs' Chrome traces go, e.g. benchmarks/results/traces (default: a temporary folder)",
    )
    parser.add_argument("--plots", type=Path, default=None,
                        help="draw one traced step of zb-h1, interleaved and 2bw and the simulator's into this folder")
    parser.add_argument("--no-trace-contenders", action="store_true", help="skip the ours_*_trace contenders")
    parser.add_argument(
        "--malloc",
        choices=("default", "keep"),
        default="default",
        help="keep: glibc keeps freed memory for reuse (see keep_freed_memory), in every contender",
    )
    parser.add_argument("--only", default="",
                        help="comma-separated contenders to run (one_thread, bound and bound_batch always run)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages = processes of each contender")
    parser.add_argument("--layers", type=int, default=None, help="Linear+ReLU blocks (default max(8, 2 x stages))")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument(
        "--max-wait",
        type=float,
        default=None,
        help=f"seconds to wait before a run for other processes to use < {BUSY_CORES:.2f} cores (default 20; quick 5)",
    )
    parser.add_argument(
        "--wait-budget", type=float, default=None, help="seconds of such waiting in all (default 150; quick 20)"
    )
    return parser, parser.parse_args(argv)


def _report_machine_load(quick: bool) -> dict:
    """The load before the runs, printed, with a warning where the machine is busy."""
    load0 = idle_load(1.0 if quick else 2.0)
    print(
        f"machine: {os.cpu_count()} CPUs, load average {load0['loadavg_1m']:.2f}, "
        f"other processes using {load0['foreign_cores']:.2f} cores",
        flush=True,
    )
    # The load average lags by a minute (and counts this benchmark's own recent runs): the CPU that
    # other processes use right now says more.
    if load0["foreign_cores"] > BUSY_CORES or load0["loadavg_1m"] > (os.cpu_count() or 1):
        warnings.warn(
            f"The machine is busy (other processes use {load0['foreign_cores']:.2f} of {os.cpu_count()} cores, "
            f"load average {load0['loadavg_1m']:.2f}): the figures will be noisy and slower than on a quiet machine.",
            stacklevel=1,
        )
    return load0


def _run_rounds(
    names: list[str], cfg: Config, rounds: int, warmup: int, steps: int, args: argparse.Namespace, waited: float
) -> tuple[dict[str, list[dict]], dict[str, list[TimedAction]], float]:
    """Every contender once a round, the order rotating; the last round keeps the traced runs' events."""
    runs: dict[str, list[dict]] = {n: [] for n in names}
    kept_events: dict[str, list[TimedAction]] = {}
    for rnd in range(rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for name in order:
            keep = name.endswith("_trace") and rnd == rounds - 1
            # Wait a little for a quiet moment (other engineers' tests come in bursts), within a budget.
            waited += wait_for_quiet(min(args.max_wait, args.wait_budget - waited))
            with LoadMeter() as meter:
                run = run_contender(name, cfg, warmup, steps, args.timeout, keep_trace=keep)
            run["foreign_cores"] = meter.foreign_cores
            run["loadavg_1m"] = meter.loadavg
            if "events" in run:
                kept_events[name] = run.pop("events")
            runs[name].append(run)
            print(
                f"round {rnd + 1}/{rounds} {name:26s} {run['steps_per_s']:7.3f} steps/s "
                f"{run['cpu_s_per_step']:6.3f} cpu-s/step {run['page_faults_per_step']:7.0f} faults/step "
                f"(others using {meter.foreign_cores:.2f} cores)",
                flush=True,
            )
    return runs, kept_events, waited


def _simulate(
    cfg: Config, runs: dict, repeats: int, args: argparse.Namespace, waited: float, prof_before: dict, link_before: dict
) -> tuple[dict[str, Any], float]:
    """What the simulator needs, measured before and after the rounds (the lower of the two is the
    less disturbed), then its predictions."""
    waited += wait_for_quiet(min(args.max_wait, max(0.0, args.wait_budget - waited)))
    prof_after = profile(cfg, repeats, concurrent=False, timeout=args.timeout)
    prof_concurrent = profile(cfg, repeats, concurrent=True, timeout=args.timeout)
    link_after = run_local(link_worker, cfg.stages, cfg, repeats, timeout=args.timeout)[0]
    prof = _lower(prof_before, prof_after)
    link = min(link_before, link_after, key=lambda d: d["activation"])
    pred = predict(cfg, prof, link)
    pred_concurrent = predict(cfg, prof_concurrent, link)
    replay: dict[str, Any] = {}
    for s in OURS:
        costs = trace_costs(runs.get(f"ours_{s}_trace", []))
        if costs is not None:
            replay[s] = {**predict(cfg, costs, link)[s], "costs": costs}
            overhead = action_overheads(runs.get(f"ours_{s}_trace", []), cfg)
            if overhead is not None:
                # the Python around the actions, modelled as part of each forward: what the replay still misses
                with_overhead = {**costs, "forward_s": [f + o for f, o in zip(costs["forward_s"], overhead)]}
                replay[s]["with_overheads"] = {"step_time_s": predict(cfg, with_overhead, link)[s]["step_time_s"],
                                               "overhead_s_per_microbatch": overhead}
    bound = simulated_bound(cfg, bound_costs(runs["bound_batch"]) if runs.get("bound_batch") else None,
                            bound_costs(runs["bound"]) if runs.get("bound") else None)
    sim = {
        "bound": bound,
        "prof": prof,
        "prof_before": prof_before,
        "prof_after": prof_after,
        "prof_concurrent": prof_concurrent,
        "link": link,
        "pred": pred,
        "pred_concurrent": pred_concurrent,
        "replay": replay,
    }
    return sim, waited


def _summarize(names: list[str], runs: dict[str, list[dict]], cfg: Config) -> dict[str, Any]:
    """Per contender, the medians over its runs."""
    results: dict[str, Any] = {}
    for name in names:
        sps = [r["steps_per_s"] for r in runs[name]]
        results[name] = {
            "steps_per_s": statistics.median(sps),
            "samples_per_s": statistics.median(sps) * cfg.batch,
            "spread": spread(sps),
            # the runs during which other processes used < BUSY_CORES cores: closest to a quiet machine
            "steps_per_s_quiet": median_or_none(
                [r["steps_per_s"] for r in runs[name] if r["foreign_cores"] < BUSY_CORES]
            ),
            "quiet_runs": sum(r["foreign_cores"] < BUSY_CORES for r in runs[name]),
            "foreign_cores_median": statistics.median(r["foreign_cores"] for r in runs[name]),
            "cpu_s_per_step_median": statistics.median(r["cpu_s_per_step"] for r in runs[name]),
            "page_faults_per_step_median": statistics.median(r["page_faults_per_step"] for r in runs[name]),
            "loss": runs[name][-1]["loss"],
        }
    return results


def _compare(results: dict[str, Any], runs: dict[str, list[dict]], names: list[str], cfg: Config, sim: dict) -> None:
    """Add the ratios to torch's and to one thread's, and to the simulator's step time, to ``results``."""
    pred, pred_concurrent, replay = sim["pred"], sim["pred_concurrent"], sim["replay"]
    one = results["one_thread"]["steps_per_s"]
    for name in names:
        if not name.startswith("ours_"):
            results[name]["speedup_vs_one_thread"] = results[name]["steps_per_s"] / one
            continue
        schedule = schedule_of(name)
        ref = f"torch_{schedule}" if schedule in ALL_TORCH else "torch_1f1b"
        r = results[name]
        if ref in results:
            r["ratio_vs_torch"] = r["steps_per_s"] / results[ref]["steps_per_s"]
            r["ratio_vs_torch_of"] = ref
            # paired, round by round: robust to the load drifting between rounds
            r["ratio_vs_torch_paired_median"] = statistics.median(
                a["steps_per_s"] / b["steps_per_s"] for a, b in zip(runs[name], runs[ref])
            )
            r["ratio_vs_torch_quiet"] = _ratio(r["steps_per_s_quiet"], results[ref]["steps_per_s_quiet"])
        r["speedup_vs_one_thread"] = r["steps_per_s"] / one
        r["speedup_vs_one_thread_quiet"] = _ratio(r["steps_per_s_quiet"], results["one_thread"]["steps_per_s_quiet"])
        r["speedup_vs_one_thread_paired_median"] = statistics.median(
            a["steps_per_s"] / b["steps_per_s"] for a, b in zip(runs[name], runs["one_thread"])
        )
        r["ideal_speedup_fraction"] = r["speedup_vs_one_thread"] / cfg.stages
        if schedule == "pipedream" and "one_thread_per_minibatch" in results:
            # against one thread doing the same work: an optimizer step after every minibatch
            r["speedup_vs_one_thread_same_updates"] = (
                r["steps_per_s"] / results["one_thread_per_minibatch"]["steps_per_s"]
            )
        if not name.endswith("_trace") and schedule in pred:
            # against the quiet runs where there are some: the simulator knows nothing of other processes
            measured_step = 1 / (r["steps_per_s_quiet"] or r["steps_per_s"])
            r["measured_step_s"] = measured_step
            r["measured_step_from"] = "quiet runs" if r["steps_per_s_quiet"] else "all runs"
            r["simulated_step_s"] = pred[schedule]["step_time_s"]
            r["measured_over_simulated"] = measured_step / pred[schedule]["step_time_s"]
            r["simulated_step_s_concurrent_costs"] = pred_concurrent[schedule]["step_time_s"]
            r["measured_over_simulated_concurrent_costs"] = measured_step / pred_concurrent[schedule]["step_time_s"]
            if schedule in replay:
                r["simulated_step_s_trace_costs"] = replay[schedule]["step_time_s"]
                r["measured_over_simulated_trace_costs"] = measured_step / replay[schedule]["step_time_s"]
                if "with_overheads" in replay[schedule]:
                    modelled = replay[schedule]["with_overheads"]["step_time_s"]
                    r["simulated_step_s_trace_costs_with_overheads"] = modelled
                    r["measured_over_simulated_trace_costs_with_overheads"] = measured_step / modelled
    for s in ALL_TORCH:
        if f"torch_{s}" in results:
            results[f"torch_{s}"]["ideal_speedup_fraction"] = (
                results[f"torch_{s}"]["speedup_vs_one_thread"] / cfg.stages
            )


def _shares(results: dict[str, Any], runs: dict[str, list[dict]], cfg: Config, sim: dict) -> None:
    """Every contender's share of the bound doing the same updates (median, and paired round by round), and a
    flushed schedule's share of its bubble-limited bound (the simulator on the bound's costs, free links)."""
    for name, r in results.items():
        bound = bound_of(name)
        r["bound"] = bound
        r["share_of_bound"] = r["steps_per_s"] / results[bound]["steps_per_s"]
        r["share_of_bound_paired_median"] = statistics.median(
            a["steps_per_s"] / b["steps_per_s"] for a, b in zip(runs[name], runs[bound])
        )
        r["share_of_bound_quiet"] = _ratio(r["steps_per_s_quiet"], results[bound]["steps_per_s_quiet"])
        schedule = schedule_of(name)
        if name not in BOUNDS and schedule in sim["bound"]:
            # measured steps/s over the simulated bound's: simulated step time / measured step time
            r["share_of_simulated_bound"] = sim["bound"][schedule]["step_time_s"] * r["steps_per_s"]


def _trace_results(
    runs: dict[str, list[dict]],
    results: dict[str, Any],
    kept_events: dict[str, list[TimedAction]],
    sim: dict,
    cfg: Config,
    steps: int,
    trace_dir_arg: str,
) -> tuple[dict, dict]:
    """The cost of tracing, the bubbles (analytic, simulated, measured) and the traces of one typical step."""
    pred, replay = sim["pred"], sim["replay"]
    trace_overhead = {}
    bubbles = {}
    for s in OURS:
        if f"ours_{s}_trace" not in results or f"ours_{s}" not in results:
            continue
        plain, traced = runs[f"ours_{s}"], runs[f"ours_{s}_trace"]
        paired = [b["seconds"] / b["steps"] / (a["seconds"] / a["steps"]) - 1 for a, b in zip(plain, traced)]
        trace_overhead[s] = {
            "median_ratio_minus_1": results[f"ours_{s}"]["steps_per_s"] / results[f"ours_{s}_trace"]["steps_per_s"] - 1,
            "paired_median": statistics.median(paired),
            "paired": paired,
        }
        whole = [r["bubble_whole_step"] for r in traced]
        p, m = cfg.stages, cfg.chunks
        bubbles[s] = {
            "analytic": (p - 1) / (m + p - 1) if s in TORCH else 0.0,
            "simulated": pred[s]["bubble_fraction"],
            "simulated_trace_costs": replay[s]["bubble_fraction"] if s in replay else None,
            "measured_whole_step_median": statistics.median(whole),
        }
        if f"ours_{s}_trace" in kept_events:
            events = kept_events[f"ours_{s}_trace"]
            if s in TORCH:
                bubbles[s]["measured_in_step_median"] = measured_bubble(events, s, cfg)["median"]
            if trace_dir_arg:
                trace_dir = Path(trace_dir_arg)
                trace_dir.mkdir(parents=True, exist_ok=True)
                # the step whose span is the median of the run's: a typical one, not a disturbed one
                spans = [makespan(one_step_events(events, s, cfg, step=k)) for k in range(steps)]
                typical = sorted(range(steps), key=lambda k: spans[k])[steps // 2]
                one_step = one_step_events(events, s, cfg, step=typical)
                (trace_dir / f"real_{s}.json").write_text(json.dumps(to_chrome_trace(one_step)))
        # the per-action cost of recording, measured in isolation
    trace_overhead["record_cost_s_per_action"] = _record_cost()
    for s in OURS:
        if s in trace_overhead and f"ours_{s}_trace" in runs:
            per_step = runs[f"ours_{s}_trace"][0].get("actions_per_step_per_rank", 0)
            trace_overhead[s]["record_cost_fraction_of_step"] = (
                per_step * trace_overhead["record_cost_s_per_action"] * results[f"ours_{s}"]["steps_per_s"]
            )
    return trace_overhead, bubbles


def _document(
    cfg: Config,
    args: argparse.Namespace,
    rounds: int,
    steps: int,
    warmup: int,
    load0: dict,
    runs: dict[str, list[dict]],
    results: dict[str, Any],
    sim: dict,
    bubbles: dict,
    trace_overhead: dict,
) -> dict:
    """The JSON document, in the order of its keys (main adds ``seconds`` and ``seconds_waiting_for_quiet`` last)."""
    doc = {
        "config": {
            **asdict(cfg),
            "micro_batch": cfg.micro,
            "threads_per_process": 1,
            "lr": LR,
            "rounds": rounds,
            "timed_steps_per_run": steps,
            "malloc": args.malloc,
            "warmup_steps": warmup,
            "quick": args.quick,
            "step": f"one batch of {cfg.batch} samples (pipedream: {cfg.chunks} minibatches of {cfg.micro})",
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "load_before": load0,
            "foreign_cores_during_runs_median": statistics.median(
                r["foreign_cores"] for rs in runs.values() for r in rs
            ),
            "foreign_cores_during_runs_max": max(r["foreign_cores"] for rs in runs.values() for r in rs),
        },
        "contenders": results,
        "profile": sim["prof"],
        "profile_runs": {
            "isolated_before": sim["prof_before"],
            "isolated_after": sim["prof_after"],
            "concurrent": sim["prof_concurrent"],
        },
        "link": sim["link"],
        "simulated": sim["pred"],
        "simulated_concurrent_costs": sim["pred_concurrent"],
        "simulated_trace_costs": sim["replay"],
        "simulated_bound": sim["bound"],
        "bubble": bubbles,
        "trace_overhead": trace_overhead,
        "runs": runs,
    }
    return doc


def _record_cost(n: int = 200_000) -> float:
    trace: list = []
    a = object()
    start = time.perf_counter()
    for _ in range(n):
        s = time.perf_counter()
        trace.append((a, s, time.perf_counter()))
    return (time.perf_counter() - start) / n


def _print_summary(doc: dict) -> None:
    res = doc["contenders"]
    print()
    print(
        f"{'contender':26s} {'steps/s':>8s} {'min':>7s} {'max':>7s} {'vs torch':>9s} {'vs 1 thread':>11s} "
        f"{'others':>7s} {'quiet steps/s (runs)':>21s}"
    )
    for name, r in res.items():
        vs_torch = f"{r['ratio_vs_torch']:.3f}" if "ratio_vs_torch" in r else ""
        quiet = f"{r['steps_per_s_quiet']:.3f} ({r['quiet_runs']})" if r["steps_per_s_quiet"] else "-"
        print(
            f"{name:26s} {r['steps_per_s']:8.3f} {r['spread']['min']:7.3f} {r['spread']['max']:7.3f} "
            f"{vs_torch:>9s} {r['speedup_vs_one_thread']:11.3f} {r['foreign_cores_median']:7.2f} {quiet:>21s}"
        )
    print()
    print(
        f"{'schedule':10s} {'measured s':>10s} {'simulated s':>11s} {'ratio':>6s} {'bubble':>7s} "
        f"{'analytic':>8s} {'trace cost':>10s}"
    )
    for s in OURS:
        r = res.get(f"ours_{s}", {})
        b = doc["bubble"].get(s, {})
        t = doc["trace_overhead"].get(s, {})
        print(
            f"{s:10s} {r.get('measured_step_s', 0):10.4f} {r.get('simulated_step_s', 0):11.4f} "
            f"{r.get('measured_over_simulated', 0):6.3f} "
            f"{b.get('measured_in_step_median', b.get('measured_whole_step_median', 0)):7.3f} "
            f"{b.get('analytic', 0):8.3f} {t.get('paired_median', 0):+10.3%}"
        )
    m = doc["machine"]
    print(
        f"\nother processes used {m['foreign_cores_during_runs_median']:.2f} cores (median, max "
        f"{m['foreign_cores_during_runs_max']:.2f}) of {m['cpus']} during the runs; took {doc['seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
