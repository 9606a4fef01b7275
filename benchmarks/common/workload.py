"""The benchmarks' shared parts: the workload (model, data, optimizer, stage split), the workers that
time it in processes started by ``run_local`` (ours, torch's, one process, and the machine's bound: every
stage alone in its process, all at once, no communication), and the meter of what other processes use.

``benchmarks/speed/schedules.py`` and ``benchmarks/memory/peaks.py`` import it as ``benchmarks.common.workload``.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks.common.figures import median_seconds
from lightning_pipedream.plan.balance import even_balance, stage_slice
from lightning_pipedream.runtime.communication.transport import Transport
from lightning_pipedream.runtime.faults.launch import run_local
from lightning_pipedream.runtime.pipeline import Pipeline
from lightning_pipedream.schedule.actions import Op

OURS = ("gpipe", "1f1b", "pipedream")
NEWER = ("zb-h1", "interleaved", "2bw")  # the newer schedules: ours, and torch's where it has one
TORCH = ("gpipe", "1f1b")
TORCH_NEWER = ("zb-h1", "interleaved")  # torch's ScheduleInterleavedZeroBubble and ScheduleInterleaved1F1B
VIRTUAL = 2  # model chunks per process for interleaved (and the V schedules' two)
# two chunks per process in a V (the loss on rank 0): ours, and torch's ScheduleZBVZeroBubble and ScheduleDualPipeV
V_SHAPED = ("zb-v", "dualpipev")
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

GRADS_ENV = "LIGHTNING_PIPEDREAM_BENCH_GRADS"  # "free" under --malloc keep (set by the scripts for their workers)


def zero_grads(opt: torch.optim.Optimizer) -> None:
    """The best plain loop's zeroing. With freed memory kept for reuse (``--malloc keep``) it frees the gradients:
    the next backward then hands its new gradients over, with no pass of zeros and no add (measured 1.5-2.5 ms less
    per minibatch of 64 on one stage); otherwise it keeps them, since freeing would fault their pages in again."""
    opt.zero_grad(set_to_none=os.environ.get(GRADS_ENV) == "free")


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


def timed(step, warmup: int, steps: int, finish=None, barrier: bool = True, after_warmup=None) -> dict:
    """Run ``step`` ``warmup`` times, then time ``steps`` calls (and ``finish``): the interval, the CPU
    seconds of the whole process and of each of its threads, and the page faults."""
    for _ in range(warmup):
        step()
    if after_warmup is not None:
        after_warmup()
    if barrier:
        dist.barrier()
    threads0 = threads_cpu()
    f0, c0, t0 = _faults(), _cpu_self(), time.perf_counter()
    loss = None
    for _ in range(steps):
        loss = step()
    if finish is not None:
        finish()
    t1 = time.perf_counter()
    cpu, faults = _cpu_self() - c0, _faults() - f0
    return {"t0": t0, "t1": t1, "cpu_s": cpu, "faults": faults, "loss": loss,
            "threads_cpu_s": threads_cpu_since(threads0)}


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process (gloo's too)
    return r.ru_utime + r.ru_stime


def threads_cpu() -> dict[int, tuple[str, float]]:
    """Every thread of this process: id -> (name, CPU seconds so far), from /proc (empty where there is none)."""
    out: dict[int, tuple[str, float]] = {}
    hz = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        # "tid (name) state ..." - the name may hold spaces; utime and stime are fields 14 and 15
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / hz)
    return out


def threads_cpu_since(before: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each thread used since ``before`` (a :func:`threads_cpu`), by name: ``main`` for the
    main thread, the others by their name, numbered in order of creation where names repeat."""
    now = threads_cpu()
    main = os.getpid()
    out: dict[str, float] = {}
    counts: dict[str, int] = {}
    for tid in sorted(now):
        name, cpu = now[tid]
        if tid == main:
            label = "main"
        else:
            counts[name] = counts.get(name, 0) + 1
            label = f"{name}#{counts[name]}"
        out[label] = round(cpu - before.get(tid, (name, 0.0))[1], 4)
    return out


def _options(schedule: str) -> dict[str, Any]:
    return {"virtual_stages": VIRTUAL} if schedule == "interleaved" else {}


def ours_worker(
    rank: int, world: int, cfg: Config, schedule: str, trace: bool, warmup: int, steps: int, keep_trace_steps: int = 0
) -> dict:
    """Our ``Pipeline``: a step is one batch (``pipedream``: its 8 minibatches, one ``step()`` each; the
    asynchronous schedules drain at the end of the timed run)."""
    x, y = make_batch(cfg)
    chunks = 1 if schedule == "pipedream" else cfg.chunks
    pipe = Pipeline(build_model(cfg), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule=schedule,
                    chunks=chunks, record=trace, **_options(schedule))
    if schedule == "pipedream":
        xs, ys = x.split(cfg.micro), y.split(cfg.micro)

        def step():  # 512 samples = 8 PipeDream minibatches of 64
            loss = None
            for xm, ym in zip(xs, ys):
                loss = pipe.step(xm, ym)
            return loss
    else:

        def step():
            return pipe.step(x, y)

    finish = pipe.drain if schedule in ("pipedream", "2bw") else None
    executor = pipe.engine.executor
    stash = _time_stash_copies(pipe) if trace else None
    out = timed(step, warmup, steps, finish, after_warmup=lambda: (executor.records.clear(), stash and stash.clear()))
    if trace:
        records = executor.records
        out["busy_s"] = sum(e - s for a, s, e in records if a.op.is_compute or a.op is Op.OPTIMIZER_STEP)
        # mean seconds of this rank's forwards, backwards and optimizer steps, as the simulator takes them
        out["op_mean_s"] = {
            op.value: statistics.mean([e - s for a, s, e in records if a.op is op] or [0.0])
            for op in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_WEIGHT, Op.OPTIMIZER_STEP)
        }
        out["actions"] = len(records)
        out["breakdown_s"] = breakdown(records, out["t1"] - out["t0"], stash)
        if keep_trace_steps:
            out["events"] = [(a, s, e) for a, s, e in records]
    out["shared_memory"] = pipe.transport.uses_shared_memory
    return out


def _time_stash_copies(pipe: Pipeline) -> list[float] | None:
    """Time every weight-stash copy (``WeightVersions.before_update``) of ``pipe``'s stage: its seconds go
    into the returned list."""
    weights = pipe.engine.weights
    if weights is None:
        return None
    times: list[float] = []
    inner = weights.before_update

    def before_update() -> None:
        t = time.perf_counter()
        inner()
        times.append(time.perf_counter() - t)

    weights.before_update = before_update  # type: ignore[method-assign]
    return times


def breakdown(records: list, seconds: float, stash: list[float] | None = None) -> dict[str, float]:
    """Where one rank's timed interval went, in seconds: compute (forward, backward, weight-gradient), the
    optimizer step (the stash copy apart), sends (posting them), receives (waiting for the peer), and the
    rest: Python between the actions, the steps' own bookkeeping."""
    out = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "stash_copy": sum(stash or []), "send": 0.0,
           "receive_wait": 0.0, "allreduce": 0.0}
    key = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.BACKWARD_WEIGHT: "backward",
           Op.OPTIMIZER_STEP: "optimizer", Op.SEND_ACT: "send", Op.SEND_GRAD: "send", Op.RECV_ACT: "receive_wait",
           Op.RECV_GRAD: "receive_wait", Op.ALLREDUCE_GRAD: "allreduce"}
    for action, start, end in records:
        out[key[action.op]] += end - start
    out["optimizer"] -= out["stash_copy"]  # the copy runs inside the optimizer step's action
    out["between_actions"] = seconds - sum(out.values())
    return {k: round(v, 6) for k, v in out.items()}


def torch_dualpipev() -> Any:
    """torch's ``ScheduleDualPipeV`` (torch 2.9 and later), or None where the installed torch lacks it."""
    from torch.distributed import pipelining

    return getattr(pipelining, "ScheduleDualPipeV", None)


def torch_worker(rank: int, world: int, cfg: Config, schedule: str, warmup: int, steps: int) -> dict:
    """torch.distributed.pipelining on the same split: ``PipelineStage`` + the schedule, then one SGD step.
    ``zb-h1`` is torch's ``ScheduleInterleavedZeroBubble`` with one stage per process (torch's zero-bubble
    schedule on our layout), ``interleaved`` its ``ScheduleInterleaved1F1B`` with our layout, ``zb-v`` its
    ``ScheduleZBVZeroBubble`` and ``dualpipev`` its ``ScheduleDualPipeV`` (process r holds stages r and 2p-1-r, as
    ours)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    x, y = make_batch(cfg)
    model = build_model(cfg)
    v = VIRTUAL if schedule in ("interleaved", *V_SHAPED) else 1
    balance = even_balance(len(model), world * v)
    # process r holds stages r, r + p, ... as ours (a V: r and 2p-1-r)
    indices = [rank, 2 * world - 1 - rank] if schedule in V_SHAPED else [c * world + rank for c in range(v)]
    modules = [stage_slice(model, balance, i) for i in indices]
    stages = [PipelineStage(m, i, world * v, torch.device("cpu")) for m, i in zip(modules, indices)]
    # loss_fn is mean-reduced; scale_grads (default True) divides by the micro-batch count, so
    # the gradient is that of the mean over the batch, as in our Pipeline and in one process.
    if schedule in ("gpipe", "1f1b"):
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        sched = cls(stages[0], n_microbatches=cfg.chunks, loss_fn=nn.functional.mse_loss)
    else:
        multi = {"interleaved": ScheduleInterleaved1F1B, "zb-v": ScheduleZBVZeroBubble,
                 "dualpipev": torch_dualpipev()}
        cls = multi.get(schedule, ScheduleInterleavedZeroBubble)
        sched = cls(stages, n_microbatches=cfg.chunks, loss_fn=nn.functional.mse_loss)
    opt = sgd([p for m in modules for p in m.parameters()])
    return timed(torch_step(sched, opt, x, y, rank, world, v_shape=schedule in V_SHAPED), warmup, steps)


def torch_step(sched: Any, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, rank: int, world: int,
               v_shape: bool = False) -> Callable:
    """One training step of a torch.distributed.pipelining schedule and an SGD step; returns the mean loss
    on the last stage's rank (rank 0 under a V, which also takes the inputs)."""
    first, last = rank == 0, rank == (0 if v_shape else world - 1)

    def step() -> float | None:
        losses: list = []
        if first and last:
            sched.step(x, target=y, losses=losses, return_outputs=False)
        elif first:
            sched.step(x, return_outputs=False)
        elif last:
            sched.step(target=y, losses=losses, return_outputs=False)
        else:
            sched.step(return_outputs=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(sum(loss.detach() for loss in losses) / len(losses)) if losses else None

    return step


def single_worker(
    rank: int, world: int, cfg: Config, threads: int, warmup: int, steps: int, update_per_minibatch: bool = False
) -> dict:
    """One process, the whole model: the best plain loop (:func:`zero_grads`)."""
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
                zero_grads(opt)
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
            zero_grads(opt)
            return total
    else:  # the whole batch with intra-op parallelism

        def step():
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            zero_grads(opt)
            return loss.item()

    return timed(step, warmup, steps, barrier=False)


def bound_worker(
    rank: int, world: int, cfg: Config, update_per_minibatch: bool, warmup: int, steps: int
) -> dict:
    """The machine's bound for a pipeline: this rank runs only its own stage, on stand-in inputs, with no
    communication (a barrier before the timed steps only), while the other ranks run theirs.

    A step is the stage's share of one batch: ``cfg.chunks`` forwards and backwards of a micro-batch, with an
    SGD step after each (``update_per_minibatch``: PipeDream's work) or one after all (a flushed schedule's).
    A stage after the first back-propagates into its input, as it would to send that gradient on; the last
    computes the loss. Gradients are zeroed as the best plain loop does (:func:`zero_grads`). Returns
    :func:`timed`'s figures and the mean seconds of a forward, a backward and an update.
    """
    x, y = make_batch(cfg)
    module = stage_module(cfg, rank)
    opt = sgd(module.parameters())
    last = rank == world - 1
    inp = x[: cfg.micro].clone().requires_grad_(rank > 0)
    target = y[: cfg.micro]
    grad_out = torch.ones(cfg.micro, cfg.width) / cfg.micro
    scale = 1.0 if update_per_minibatch else 1.0 / cfg.chunks
    spent = {"F": 0.0, "B": 0.0, "O": 0.0}
    counts = {"F": 0, "B": 0, "O": 0}

    def update() -> None:
        t = time.perf_counter()
        opt.step()
        zero_grads(opt)
        spent["O"] += time.perf_counter() - t
        counts["O"] += 1

    def step() -> None:
        for _ in range(cfg.chunks):
            t0 = time.perf_counter()
            out = module(inp)
            if last:
                out = nn.functional.mse_loss(out, target) * scale
            t1 = time.perf_counter()
            out.backward(None if last else grad_out)
            inp.grad = None  # sent on and freed in a pipeline
            t2 = time.perf_counter()
            spent["F"] += t1 - t0
            spent["B"] += t2 - t1
            counts["F"] += 1
            counts["B"] += 1
            if update_per_minibatch:
                update()
        if not update_per_minibatch:
            update()
        return None

    def reset() -> None:
        for k in spent:
            spent[k], counts[k] = 0.0, 0

    out = timed(step, warmup, steps, after_warmup=reset)
    out["op_mean_s"] = {k: spent[k] / max(1, counts[k]) for k in spent}
    return out


# ---------------------------------------------------------------------------------------------
# What the simulator needs, measured: per-stage costs in isolation (1 thread) and the link.


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
            zero_grads(opt)

        out["optimizer_s"].append(median_seconds(step, repeats))
    return out


def profile(cfg: Config, repeats: int, concurrent: bool, timeout: float) -> dict:
    if not concurrent:
        return run_local(profile_worker, 1, cfg, repeats, timeout=timeout)[0]
    parts = run_local(profile_worker, cfg.stages, cfg, repeats, timeout=timeout)
    return {k: [part[k][0] for part in parts] for k in parts[0]}


def link_worker(rank: int, world: int, cfg: Config, repeats: int) -> dict | None:
    """One-way time of our transport's messages between ranks 0 and 1 (ping-pong / 2), small and activation-sized.

    Every rank of the world takes part in the barriers (the probe runs in the pipeline's ``world`` processes), but
    only ranks 0 and 1 exchange messages: with more ranks, a pairing such as ``peer = 1 - rank`` would send rank 2 to
    rank -1 and wait for ever. On one machine every link is the same kind, so one pair stands for all of them."""
    transport = Transport()
    peer = 1 - rank if rank < 2 else None  # ranks 2.. only meet the others at the barriers
    result = {}
    for name, shape in (("small", (1,)), ("activation", (cfg.micro, cfg.width))):
        t = torch.randn(shape)
        times = []
        for i in range(repeats + 3):
            dist.barrier()
            start = time.perf_counter()
            if peer is None:
                pass
            elif rank == 0:
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
