"""Steps/s of our schedules against torch.distributed.pipelining and one process, on 2 stages.

Run from the repository root::

    python benchmarks/schedules.py --json benchmarks/results/schedules.json          # 6-10 minutes
    python benchmarks/schedules.py --quick --json /tmp/quick.json                     # < 2 minutes
    python benchmarks/schedules.py --malloc keep --json benchmarks/results/schedules_malloc_keep.json

The model is 8 x (Linear(1024, 1024) + ReLU) with MSE loss and plain SGD; a step is a batch of
512 samples in 8 micro-batches of 64. Every multi-process contender runs 2 processes (one stage
each, the model split in the middle) with 1 thread each, over gloo on loopback. Contenders:

* ``ours_gpipe``, ``ours_1f1b``: our ``Pipeline``, one ``step()`` per batch of 512.
* ``ours_pipedream``: our ``Pipeline(schedule="pipedream")``; PipeDream takes one minibatch per
  ``step()`` and keeps the pipeline full, so one "step" here is 8 calls of 64 samples (8
  optimizer steps per stage), and the timed run ends with ``drain()``.
* ``ours_*_trace``: the same with ``trace=True`` (the executor records every action).
* ``torch_gpipe``, ``torch_1f1b``: ``PipelineStage`` + ``ScheduleGPipe``/``Schedule1F1B`` on the
  same split, ``return_outputs=False``.
* ``one_thread``: one process, 1 thread, the same 8 micro-batches one after another (gradient
  accumulation), then one SGD step: the work of one step with no parallelism.
* ``one_thread_per_minibatch``: one process, 1 thread, an SGD step after every 64 samples: the
  work PipeDream does (8 optimizer steps per 512 samples), without its pipeline.
* ``two_threads``: one process, 2 threads (intra-op), the whole batch of 512 at once.

The contenders are interleaved: every round runs each once, the order rotating from round to
round; the figures are medians over rounds, and over the runs during which the machine was
quiet. Before each run it waits (within a budget) for other processes to calm down. Before and
during the runs the machine's load is recorded: ``foreign_cores`` is the CPU time used by
processes other than the benchmark's, per second of wall time (from /proc/stat minus our
children's rusage), the best sign of a busy machine.

Besides steps/s the run measures what the simulator needs (per-stage forward/backward of a
micro-batch in isolation and with both stages running at once, the optimizer step, the link's
latency and bandwidth, and the same costs as the traced runs recorded them), predicts every
schedule's step time with ``lightning_pipedream.schedule.simulate``, and compares it, and the
bubble measured from the traced runs, with the measurements. Traces (Chrome/Perfetto JSON, one
step of each schedule, both ranks) go to ``--trace-dir`` for ``benchmarks/timelines.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipedream.plan.balance import even_balance, stage_slice
from lightning_pipedream.runtime.launch import run_local
from lightning_pipedream.runtime.pipeline import Pipeline
from lightning_pipedream.runtime.transport import Transport
from lightning_pipedream.schedule.actions import Op
from lightning_pipedream.schedule.builders import build_schedule
from lightning_pipedream.schedule.simulate import simulate
from lightning_pipedream.schedule.timeline import TimedAction, bubble_fraction, makespan, to_chrome_trace

OURS = ("gpipe", "1f1b", "pipedream")
TORCH = ("gpipe", "1f1b")
LR = 1e-3


@dataclass(frozen=True)
class Config:
    layers: int = 8
    width: int = 1024
    batch: int = 512
    chunks: int = 8
    stages: int = 2

    @property
    def micro(self) -> int:
        return self.batch // self.chunks


# ---------------------------------------------------------------------------------------------
# The workload


def build_model(cfg: Config) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(cfg.layers):
        mods += [nn.Linear(cfg.width, cfg.width), nn.ReLU()]
    return nn.Sequential(*mods)


def make_batch(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(cfg.batch, cfg.width, generator=g), torch.randn(cfg.batch, cfg.width, generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def stage_module(cfg: Config, rank: int) -> nn.Sequential:
    model = build_model(cfg)
    return stage_slice(model, even_balance(len(model), cfg.stages), rank)


# ---------------------------------------------------------------------------------------------
# Workers: each runs in a process started by run_local (1 thread unless it says otherwise) and
# returns the wall-clock interval (perf_counter, one clock for all processes on Linux) of the
# timed steps.


def _timed(step, warmup: int, steps: int, finish=None, barrier: bool = True, after_warmup=None) -> dict:
    for _ in range(warmup):
        step()
    if after_warmup is not None:
        after_warmup()
    if barrier:
        dist.barrier()
    f0, c0, t0 = _faults(), _cpu_self(), time.perf_counter()
    loss = None
    for _ in range(steps):
        loss = step()
    if finish is not None:
        finish()
    t1 = time.perf_counter()
    return {"t0": t0, "t1": t1, "cpu_s": _cpu_self() - c0, "faults": _faults() - f0, "loss": loss}


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process (gloo's too)
    return r.ru_utime + r.ru_stime


def ours_worker(
    rank: int, world: int, cfg: Config, schedule: str, trace: bool, warmup: int, steps: int, keep_trace_steps: int = 0
) -> dict:
    x, y = make_batch(cfg)
    chunks = 1 if schedule == "pipedream" else cfg.chunks
    pipe = Pipeline(
        build_model(cfg), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule=schedule, chunks=chunks, record=trace
    )
    if schedule == "pipedream":
        xs, ys = x.split(cfg.micro), y.split(cfg.micro)

        def step():  # 512 samples = 8 PipeDream minibatches of 64
            loss = None
            for xm, ym in zip(xs, ys):
                loss = pipe.step(xm, ym)
            return loss

        finish = pipe.drain
    else:

        def step():
            return pipe.step(x, y)

        finish = None
    executor = pipe.engine.executor
    out = _timed(step, warmup, steps, finish, after_warmup=executor.records.clear)
    if trace:
        out["busy_s"] = sum(
            e - s for a, s, e in executor.records if a.op in (Op.FORWARD, Op.BACKWARD, Op.OPTIMIZER_STEP)
        )
        # mean seconds of this rank's forwards, backwards and optimizer steps, as the simulator takes them
        out["op_mean_s"] = {
            op.value: statistics.mean([e - s for a, s, e in executor.records if a.op is op] or [0.0])
            for op in (Op.FORWARD, Op.BACKWARD, Op.OPTIMIZER_STEP)
        }
        out["actions"] = len(executor.records)
        if keep_trace_steps:
            out["events"] = [(a, s, e) for a, s, e in executor.records]
    return out


def torch_worker(rank: int, world: int, cfg: Config, schedule: str, warmup: int, steps: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    x, y = make_batch(cfg)
    module = stage_module(cfg, rank)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    # loss_fn is mean-reduced; scale_grads (default True) divides by the micro-batch count, so
    # the gradient is that of the mean over the batch, as in our Pipeline and in one process.
    sched = cls(stage, n_microbatches=cfg.chunks, loss_fn=nn.functional.mse_loss)
    opt = sgd(module.parameters())
    first, last = rank == 0, rank == world - 1

    def step():
        losses: list = []
        if first:
            sched.step(x, return_outputs=False)
        elif last:
            sched.step(target=y, losses=losses, return_outputs=False)
        else:
            sched.step(return_outputs=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(sum(l.detach() for l in losses) / len(losses)) if losses else None

    return _timed(step, warmup, steps)


def single_worker(
    rank: int, world: int, cfg: Config, threads: int, warmup: int, steps: int, update_per_minibatch: bool = False
) -> dict:
    torch.set_num_threads(threads)
    x, y = make_batch(cfg)
    model = build_model(cfg)
    opt = sgd(model.parameters())
    if update_per_minibatch:  # PipeDream's work without its pipeline: an SGD step after every 64 samples
        xs, ys = x.split(cfg.micro), y.split(cfg.micro)

        def step():
            total = 0.0
            for xm, ym in zip(xs, ys):
                loss = nn.functional.mse_loss(model(xm), ym)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                total += loss.item()
            return total / len(xs)
    elif threads == 1:  # the pipeline's work, micro-batch after micro-batch, on one core
        xs, ys = x.split(cfg.micro), y.split(cfg.micro)

        def step():
            total = 0.0
            for xm, ym in zip(xs, ys):
                loss = nn.functional.mse_loss(model(xm), ym) * (xm.shape[0] / cfg.batch)
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return total
    else:  # the whole batch with intra-op parallelism

        def step():
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

    return _timed(step, warmup, steps, barrier=False)


# ---------------------------------------------------------------------------------------------
# What the simulator needs, measured: per-stage costs in isolation (1 thread) and the link.


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def profile_worker(rank: int, world: int, cfg: Config, repeats: int) -> dict:
    """Forward/backward seconds of one micro-batch and the SGD step, per stage, on 1 thread.

    With one process (``world == 1``) it times every stage in turn, alone on the machine ("in
    isolation"); with ``world == cfg.stages`` each process times its own stage while the others
    time theirs, so the cores share caches and memory bandwidth as in a pipeline ("concurrent").
    """
    x, y = make_batch(cfg)
    xm, ym = x[: cfg.micro], y[: cfg.micro]
    out: dict[str, list[float]] = {"forward_s": [], "backward_s": [], "optimizer_s": []}
    for s in range(cfg.stages) if world == 1 else [rank]:
        module = stage_module(cfg, s)
        opt = sgd(module.parameters())
        last = s == cfg.stages - 1
        inp = xm.clone().requires_grad_(s > 0)
        holder: dict[str, Any] = {}

        def fwd():
            o = module(inp)
            holder["out"] = nn.functional.mse_loss(o, ym) * (1 / cfg.chunks) if last else o

        def bwd():
            o = holder.pop("out")
            if last:
                o.backward()
            else:
                o.backward(torch.ones_like(o))

        for _ in range(3):
            fwd()
            bwd()
        if world > 1:
            dist.barrier()
        fwd_times, bwd_times = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            fwd()
            t1 = time.perf_counter()
            bwd()
            t2 = time.perf_counter()
            fwd_times.append(t1 - t)
            bwd_times.append(t2 - t1)
        out["forward_s"].append(statistics.median(fwd_times))
        out["backward_s"].append(statistics.median(bwd_times))

        def step():
            opt.step()
            opt.zero_grad(set_to_none=False)

        out["optimizer_s"].append(_median_time(step, repeats))
    return out


def profile(cfg: Config, repeats: int, concurrent: bool, timeout: float) -> dict:
    if not concurrent:
        return run_local(profile_worker, 1, cfg, repeats, timeout=timeout)[0]
    parts = run_local(profile_worker, cfg.stages, cfg, repeats, timeout=timeout)
    return {k: [part[k][0] for part in parts] for k in parts[0]}


def _lower(a: dict, b: dict) -> dict:
    """Per stage, the lower of two profiles' costs (the one less disturbed by other processes)."""
    return {k: [min(x, y) for x, y in zip(a[k], b[k])] for k in a}


def link_worker(rank: int, world: int, cfg: Config, repeats: int) -> dict | None:
    """One-way time of our transport's messages between two ranks (ping-pong / 2), small and activation-sized."""
    transport = Transport()
    peer = 1 - rank
    result = {}
    for name, shape in (("small", (1,)), ("activation", (cfg.micro, cfg.width))):
        t = torch.randn(shape)
        times = []
        for i in range(repeats + 3):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                transport.send(t, peer)
                transport.recv(peer)
            else:
                got = transport.recv(peer)
                transport.send(got, peer)
            transport.wait_all()
            if i >= 3:
                times.append((time.perf_counter() - start) / 2)
        result[name] = statistics.median(times)
    act_bytes = cfg.micro * cfg.width * 4
    result["latency_s"] = result["small"]
    result["bandwidth_Bps"] = act_bytes / max(result["activation"] - result["small"], 1e-9)
    result["activation_bytes"] = act_bytes
    return result if rank == 0 else None


# ---------------------------------------------------------------------------------------------
# Load


def _cpu_busy_jiffies() -> int:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal guest guest_nice: busy = all - idle - iowait
    return sum(fields[:8]) - fields[3] - fields[4]


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class LoadMeter:
    """CPU used by other processes during a span: total busy CPU (/proc/stat) minus our children's."""

    def __enter__(self):
        self.hz = os.sysconf("SC_CLK_TCK")
        self.t = time.perf_counter()
        self.busy = _cpu_busy_jiffies()
        self.ours = _children_cpu_s() + sum(os.times()[:2])
        self.loadavg = os.getloadavg()[0]
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t
        busy = (_cpu_busy_jiffies() - self.busy) / self.hz
        ours = _children_cpu_s() + sum(os.times()[:2]) - self.ours
        self.wall = wall
        self.ours_cores = ours / wall
        self.foreign_cores = max(0.0, (busy - ours) / wall)
        return False


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse rather than give it back to the OS.

    By default glibc returns large freed blocks (``munmap``, heap trimming), so the next
    allocation of a tensor that size faults its pages in again; on this VM a page fault costs
    about a microsecond, so a 4 MiB gradient or weight copy costs ~1 ms more each time. The
    PyTorch CPU tuning guide's advice (jemalloc, tcmalloc) aims at the same. Applies to this
    process and the processes it forks afterwards; returns False where it cannot (not glibc).
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    # 32 MiB is the largest mmap threshold glibc accepts; fixing it also stops its dynamic adjustment.
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


BUSY_CORES = 0.25  # other processes using more than this many cores: the machine is busy


def wait_for_quiet(max_wait: float, sample: float = 0.5) -> float:
    """Sleep until other processes use less than BUSY_CORES cores (sampled over ``sample`` s), at most
    ``max_wait`` s."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait:
        with LoadMeter() as m:
            time.sleep(sample)
        if m.foreign_cores < BUSY_CORES:
            break
    return time.perf_counter() - start


def idle_load(seconds: float = 2.0) -> dict:
    with LoadMeter() as m:
        time.sleep(seconds)
    return {"loadavg_1m": m.loadavg, "foreign_cores": round(m.foreign_cores, 3), "cpus": os.cpu_count()}


# ---------------------------------------------------------------------------------------------
# The run


def contenders(include_trace: bool = True) -> list[str]:
    names = []
    for s in OURS:
        names.append(f"ours_{s}")
        if include_trace:
            names.append(f"ours_{s}_trace")
    names += [f"torch_{s}" for s in TORCH]
    names += ["one_thread", "one_thread_per_minibatch", "two_threads"]
    return names


def run_contender(name: str, cfg: Config, warmup: int, steps: int, timeout: float, keep_trace: bool = False) -> dict:
    if name.startswith("ours_"):
        schedule = name.removeprefix("ours_").removesuffix("_trace")
        trace = name.endswith("_trace")
        results = run_local(
            ours_worker, cfg.stages, cfg, schedule, trace, warmup, steps, int(keep_trace), timeout=timeout
        )
    elif name.startswith("torch_"):
        results = run_local(torch_worker, cfg.stages, cfg, name.removeprefix("torch_"), warmup, steps, timeout=timeout)
    else:
        threads = 2 if name == "two_threads" else 1
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
    }
    if "busy_s" in results[0]:
        run["op_mean_s"] = [r["op_mean_s"] for r in results]
        busy = sum(r["busy_s"] for r in results)
        run["bubble_whole_step"] = 1 - busy / (len(results) * (t1 - t0))
        run["actions_per_step_per_rank"] = results[0]["actions"] / steps
    if keep_trace and "events" in results[0]:
        run["events"] = [
            TimedAction(rank, a, s - t0, e - t0) for rank, r in enumerate(results) for a, s, e in r["events"]
        ]
    return run


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _spread(values: list[float]) -> dict:
    values = sorted(values)
    return {
        "median": statistics.median(values),
        "min": values[0],
        "max": values[-1],
        "runs": values,
    }


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
        values.append(bubble_fraction(_clip_to_first_forward(evs)))
    return {"per_step": values, "median": statistics.median(values)}


def _clip_to_first_forward(events: list[TimedAction]) -> list[TimedAction]:
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
        chosen = _clip_to_first_forward(chosen)  # from the step's first forward, as measured_bubble
    origin = min(e.start for e in chosen)
    return [TimedAction(e.rank, e.action, e.start - origin, e.end - origin) for e in chosen]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/schedules.json"))
    parser.add_argument("--quick", action="store_true", help="short run (< 2 minutes): 2 rounds of 3 steps")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument(
        "--trace-dir", default="benchmarks/results/traces", help="where the traced runs' Chrome traces go ('' for none)"
    )
    parser.add_argument("--no-trace-contenders", action="store_true", help="skip the ours_*_trace contenders")
    parser.add_argument(
        "--malloc",
        choices=("default", "keep"),
        default="default",
        help="keep: glibc keeps freed memory for reuse (see keep_freed_memory), in every contender",
    )
    parser.add_argument("--only", default="", help="comma-separated contenders to run (one_thread is always run)")
    parser.add_argument("--layers", type=int, default=8)
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
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 6)
    steps = args.steps or (3 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if args.max_wait is None:
        args.max_wait = 5.0 if args.quick else 20.0
    if args.wait_budget is None:
        args.wait_budget = 20.0 if args.quick else 150.0
    cfg = Config(layers=args.layers, width=args.width, batch=args.batch, chunks=args.chunks)
    if args.malloc == "keep" and not keep_freed_memory():
        parser.error("--malloc keep needs glibc")
    names = contenders(include_trace=not args.no_trace_contenders)
    if args.only:
        wanted = set(args.only.split(",")) | {"one_thread"}
        unknown = wanted - set(contenders())
        if unknown:
            parser.error(f"unknown contenders {sorted(unknown)}; choose from {contenders()}")
        names = [n for n in names if n in wanted]
    started = time.time()

    load0 = idle_load(1.0 if args.quick else 2.0)
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

    repeats = 10 if args.quick else 30
    waited = wait_for_quiet(args.max_wait)
    prof_before = profile(cfg, repeats, concurrent=False, timeout=args.timeout)
    link_before = run_local(link_worker, cfg.stages, cfg, repeats, timeout=args.timeout)[0]

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

    # What the simulator needs, measured before and after the rounds (the lower of the two is the
    # less disturbed), then its predictions.
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

    results: dict[str, Any] = {}
    for name in names:
        sps = [r["steps_per_s"] for r in runs[name]]
        results[name] = {
            "steps_per_s": statistics.median(sps),
            "samples_per_s": statistics.median(sps) * cfg.batch,
            "spread": _spread(sps),
            # the runs during which other processes used < BUSY_CORES cores: closest to a quiet machine
            "steps_per_s_quiet": _median_or_none(
                [r["steps_per_s"] for r in runs[name] if r["foreign_cores"] < BUSY_CORES]
            ),
            "quiet_runs": sum(r["foreign_cores"] < BUSY_CORES for r in runs[name]),
            "foreign_cores_median": statistics.median(r["foreign_cores"] for r in runs[name]),
            "cpu_s_per_step_median": statistics.median(r["cpu_s_per_step"] for r in runs[name]),
            "page_faults_per_step_median": statistics.median(r["page_faults_per_step"] for r in runs[name]),
            "loss": runs[name][-1]["loss"],
        }
    one = results["one_thread"]["steps_per_s"]
    for name in names:
        if not name.startswith("ours_"):
            results[name]["speedup_vs_one_thread"] = results[name]["steps_per_s"] / one
            continue
        schedule = name.removeprefix("ours_").removesuffix("_trace")
        ref = f"torch_{schedule}" if schedule in TORCH else "torch_1f1b"
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
        if not name.endswith("_trace"):
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
    for s in TORCH:
        if f"torch_{s}" in results:
            results[f"torch_{s}"]["ideal_speedup_fraction"] = (
                results[f"torch_{s}"]["speedup_vs_one_thread"] / cfg.stages
            )

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
            if args.trace_dir:
                trace_dir = Path(args.trace_dir)
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
        "profile": prof,
        "profile_runs": {"isolated_before": prof_before, "isolated_after": prof_after, "concurrent": prof_concurrent},
        "link": link,
        "simulated": pred,
        "simulated_concurrent_costs": pred_concurrent,
        "simulated_trace_costs": replay,
        "bubble": bubbles,
        "trace_overhead": trace_overhead,
        "runs": runs,
        "seconds": time.time() - started,
        "seconds_waiting_for_quiet": waited,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    _print_summary(doc)
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
