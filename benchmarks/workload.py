"""The benchmarks' shared parts: the workload (model, data, optimizer, stage split), the workers that
time it in processes started by ``run_local``, and the meter of what other processes use meanwhile.

``benchmarks/schedules.py`` and ``benchmarks/memory.py`` import it as ``benchmarks.workload``.
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

from lightning_pipedream.plan.balance import even_balance, stage_slice
from lightning_pipedream.runtime.launch import run_local
from lightning_pipedream.runtime.pipeline import Pipeline
from lightning_pipedream.runtime.transport import Transport
from lightning_pipedream.schedule.actions import Op

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
    return _timed(torch_step(sched, sgd(module.parameters()), x, y, rank, world), warmup, steps)


def torch_step(sched: Any, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, rank: int, world: int) -> Callable:
    """One training step of a torch.distributed.pipelining schedule and an SGD step; returns the mean loss
    on the last rank."""
    first, last = rank == 0, rank == world - 1

    def step() -> float | None:
        losses: list = []
        if first:
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
