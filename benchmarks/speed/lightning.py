"""The benchmark MLP trained under Lightning: one device, DDP and PipeDreamStrategy, with the same samples and updates.

Run from the repository root (``-m`` only: run as a file, ``import lightning`` would find this module)::

    python -m benchmarks.speed.lightning                                   # 3 rounds, ~5 min: results/lightning.json
    python -m benchmarks.speed.lightning --quick --json /tmp/quick.json    # smoke run, tiny sizes, ~25 s

The workload is that of ``benchmarks/common/workload.py``: 8 x (Linear(1024, 1024) + ReLU), MSE, plain SGD
(lr 1e-3), ``OMP_NUM_THREADS=1`` and one thread per process; every contender runs with glibc keeping
freed memory (``--malloc keep``, PipeDreamStrategy's default ``keep_freed_memory=True``) or none does
(``--malloc default``). Every contender trains on the same
samples, in the same order; two groups do the same number of updates:

* **minibatch 64** (one update per 64 samples): ``one_device_64`` (one process), ``ddp`` (2 processes
  x 32 samples, gloo), ``pipedream`` (PipeDreamStrategy(schedule="pipedream"), 2 stages, balance [8, 8]; with
  ``--stages N``: N processes x 64 / N samples, N stages, the modules split evenly),
  ``pipedream_per_batch`` (the same on batches of 512, each cut into 8 minibatches of 64 with
  ``minibatches_per_batch=8``: Lightning's per-step work once per 8 updates; its figures are per minibatch);
* **batch 512** (one update per 512 samples): ``one_device_512`` (one process, the whole batch),
  ``gpipe`` and ``1f1b`` (PipeDreamStrategy(schedule=..., chunks=8), 2 stages, balance [8, 8]).

A step is one Lightning training batch; each run is timed from ``on_train_batch_end`` of the last
warm-up step to that of the last step (the earliest rank's start to the latest rank's end), in
seconds per step. The standalone engine (``benchmarks.common.workload.ours_worker``: ``Pipeline``
without Lightning) does the same work in the same run, so the JSON holds the strategy/engine ratio per
schedule. The machine's bound (``benchmarks.common.workload.bound_worker``: each process runs only its own
stage's forwards, backwards and SGD steps on stand-in inputs, both at once, no communication, no
Lightning) is ``bound_64`` (an update per minibatch) and ``bound_512`` (one per batch): every contender's
``share_of_bound`` is the bound's seconds per step over its own, for the bound with the same updates.
The one-device contenders and the bound zero their gradients as the best plain loop does (``workload.zero_grads``:
freed under ``--malloc keep``, the default; kept under ``--malloc default``). Each
rank records the CPU seconds of each of its threads over the timed steps; ``pipedream`` runs with
``trace=`` (the executor's records, ~0.2 µs per action), and each rank's timed steps are split into
forward, backward, optimizer, send, receive wait and the rest (Lightning's loop and the strategy's own
work). Contenders run in interleaved rounds (the order rotated each round), each run in fresh
processes; the figures are medians over rounds. ``os.getloadavg()`` is recorded before and after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common.figures import median_or_none
from benchmarks.common.worker_process import run_worker

# pipedream_gloo: the same as pipedream with the ranks talking through gloo's TCP pairs instead of shared memory;
# pipedream_per_batch: the same updates from batches of 512, each cut into 8 minibatches (minibatches_per_batch=8)
PER_BATCH = "pipedream_per_batch"
GROUP_64 = ("one_device_64", "ddp", "pipedream", "pipedream_gloo", PER_BATCH)
GROUP_512 = ("one_device_512", "gpipe", "1f1b")
LIGHTNING = GROUP_64 + GROUP_512


def minibatches_per_step(name: str, chunks: int) -> int:
    """Minibatches of 64 in one Lightning step of contender ``name`` in the minibatch-64 group (PER_BATCH: chunks)."""
    return chunks if name == PER_BATCH else 1

ENGINE = ("engine_gpipe", "engine_1f1b", "engine_pipedream")
BOUNDS = ("bound_64", "bound_512")  # the machine's bound, an update per minibatch of 64 or per batch of 512
CONTENDERS = LIGHTNING + ENGINE + BOUNDS


# ---------------------------------------------------------------------------------------------
# The worker: one Lightning run, in a process of its own (Lightning starts the second rank by re-running
# this module with the same arguments).


def _worker(spec: dict) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.common.workload import LR, Config, build_model, threads_cpu, threads_cpu_since, zero_grads
    from lightning_pipedream import PipeDreamStrategy
    from lightning_pipedream.plan.balance import even_balance
    from lightning_pipedream.runtime.communication.transport import TRANSPORT_ENV
    from lightning_pipedream.runtime.execution.allocator import keep_freed_memory

    torch.set_num_threads(1)
    cfg = Config(**spec["cfg"])
    keep = spec.get("malloc", "keep") == "keep"
    if keep:  # every contender under the same allocator setting as the strategy's default
        keep_freed_memory()

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = build_model(cfg)
            self.updates = 0

        def forward(self, x):
            return self.layers(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.log("train_loss", loss)
            return loss

        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            zero_grads(optimizer)  # the best plain loop's (free them when freed memory is kept for reuse)

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=LR)

            def count(*_):
                self.updates += 1

            opt.register_step_post_hook(count)
            return opt

    class Timer(L.Callback):
        def __init__(self, warmup: int, steps: int, profiler=None) -> None:
            self.ends: list[float] = []
            self.samples = 0
            self.warmup, self.steps, self.profiler = warmup, steps, profiler
            self.threads0: dict = {}
            self.threads: dict[str, float] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())
            self.samples += batch[0].shape[0]
            if len(self.ends) == self.warmup:
                self.threads0 = threads_cpu()
                if self.profiler is not None:
                    self.profiler.enable()  # the timed steps only
            elif len(self.ends) == self.warmup + self.steps:
                self.threads = threads_cpu_since(self.threads0)

    # Several contenders may share the processes (--quick): Lightning launches the second rank for the
    # first Trainer; later Trainers find LOCAL_RANK set and the process group initialized, and reuse both.
    for name in spec["names"]:
        out = Path(spec["out"]) / name
        out.mkdir(parents=True, exist_ok=True)
        steps = spec["warmup"][name] + spec["steps"][name]
        batch = cfg.micro * minibatches_per_step(name, cfg.chunks) if name in GROUP_64 else cfg.batch
        n = steps * batch
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(n, cfg.width, generator=g), torch.randn(n, cfg.width, generator=g))
        devices, per_rank = 1, batch
        if name == "ddp":
            devices, per_rank, strategy = cfg.stages, batch // cfg.stages, "ddp"
        elif name in ("pipedream", "pipedream_gloo", PER_BATCH, "gpipe", "1f1b"):
            schedule = name.removesuffix("_gloo").removesuffix("_per_batch")
            chunks = 1 if schedule == "pipedream" else cfg.chunks
            # the Sequential has 2 * layers modules (Linear, ReLU): [8, 8] on 2 stages
            balance = even_balance(2 * cfg.layers, cfg.stages)
            trace = str(out / "trace") if schedule == "pipedream" else None  # for the per-action breakdown
            # the second rank, which Lightning starts at fit, inherits it
            os.environ[TRANSPORT_ENV] = "gloo" if name.endswith("_gloo") else "auto"
            devices, strategy = cfg.stages, PipeDreamStrategy(schedule=schedule, chunks=chunks, balance=balance,
                                                        keep_freed_memory=keep, trace=trace,
                                                        minibatches_per_batch=minibatches_per_step(name, cfg.chunks))
        else:
            strategy = "auto"
        profiler = None
        if spec.get("profile"):
            import cProfile

            profiler = cProfile.Profile()
        timer = Timer(spec["warmup"][name], spec["steps"][name], profiler)
        model = MLP()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=strategy,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[timer],
            num_sanity_val_steps=0,
        )
        loader = DataLoader(data, batch_size=per_rank, shuffle=False)
        trainer.fit(model, loader)
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(str(out / f"profile_rank{trainer.global_rank}.pstats"))
        loss = trainer.callback_metrics.get("train_loss")
        result = {
            "rank": trainer.global_rank,
            "ends": timer.ends,
            "samples": timer.samples,
            "batches": len(timer.ends),
            "updates": model.updates,
            "loss": float(loss) if loss is not None else None,
            "threads": torch.get_num_threads(),
            "threads_cpu_s": timer.threads,
        }
        pipeline = getattr(trainer.strategy, "_pipeline", None)
        if pipeline is not None and pipeline.engine.executor.records:
            result["breakdown_s"] = _breakdown(pipeline.engine.executor.records, timer.ends[timer.warmup - 1],
                                               timer.ends[-1])
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _breakdown(recorded: list, t0: float, t1: float) -> dict[str, float]:
    """Where a rank's timed interval went, from the executor's records under ``trace=`` (``(action, start, end)``,
    perf_counter seconds as t0 and t1): the actions by kind, and the rest (Lightning's loop, the strategy's
    bookkeeping, Python between the actions)."""
    from benchmarks.common.workload import breakdown

    records = [(a, max(s, t0), min(e, t1)) for a, s, e in recorded if e > t0 and s < t1]
    return breakdown(records, t1 - t0)


# ---------------------------------------------------------------------------------------------
# The parent: runs contenders in fresh processes and summarises.


def run_lightning_many(names: list[str], cfg_dict: dict, units: dict, timeout: float, profile: bool = False,
                       profile_dir: Path | None = None, malloc: str = "keep") -> dict[str, dict]:
    """Run ``names`` one after the other in the same processes (``stages`` ranks, or 1 for the one-device
    contenders)."""
    with tempfile.TemporaryDirectory(prefix="bench_lightning_") as tmp:
        out = Path(profile_dir) if profile_dir is not None else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        spec = {"names": names, "cfg": cfg_dict, "warmup": {n: units[n][0] for n in names},
                "steps": {n: units[n][1] for n in names}, "out": str(out), "profile": profile,
                "malloc": malloc}
        proc = run_worker("benchmarks.speed.lightning", spec, tmp, timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{names} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return {n: _collect(n, out / n, *units[n], minibatches_per_step(n, cfg_dict["chunks"])) for n in names}


def run_lightning(name: str, cfg_dict: dict, units: dict, timeout: float, malloc: str = "keep") -> dict:
    return run_lightning_many([name], cfg_dict, units, timeout, malloc=malloc)[name]


def _collect(name: str, out: Path, warmup: int, steps: int, per_step: int = 1) -> dict:
    """One run's figures from its ranks' files, ``steps`` Lightning steps timed; with ``per_step`` minibatches in a
    step (PER_BATCH) the figures are per minibatch, as the other contenders' of its group."""
    ranks = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    t0 = min(r["ends"][warmup - 1] for r in ranks)
    t1 = max(r["ends"][-1] for r in ranks)
    data_parallel = len(ranks) if name == "ddp" else 1
    samples_per_step = ranks[0]["samples"] // ranks[0]["batches"]
    steps *= per_step  # from here on, minibatches
    return {
        "seconds": t1 - t0,
        "seconds_per_step": (t1 - t0) / steps,
        "timed_steps": steps,
        "samples": sum(r["samples"] for r in ranks[:data_parallel]),
        "timed_samples": steps // per_step * samples_per_step * data_parallel,
        "updates": ranks[0]["updates"],
        "updates_per_rank": [r["updates"] for r in ranks],
        "batches_per_rank": [r["batches"] for r in ranks],
        "loss": next((r["loss"] for r in reversed(ranks) if r["loss"] is not None), None),
        "threads": [r["threads"] for r in ranks],
        "threads_cpu_s_per_step": [{k: round(v / steps, 5) for k, v in r["threads_cpu_s"].items()} for r in ranks],
        **({"breakdown_s_per_step": [{k: round(v / steps, 6) for k, v in r["breakdown_s"].items()} for r in ranks]}
           if "breakdown_s" in ranks[0] else {}),
    }


def run_engine(name: str, cfg, warmup: int, steps: int, timeout: float) -> dict:
    """The standalone engine on the same work: ``steps`` batches of 512 (pipedream: 8 minibatches of 64 each)."""
    from benchmarks.common.workload import ours_worker
    from lightning_pipedream.runtime.faults.launch import run_local

    schedule = name.removeprefix("engine_")
    results = run_local(ours_worker, cfg.stages, cfg, schedule, False, warmup, steps, 0, timeout=timeout)
    t0 = min(r["t0"] for r in results)
    t1 = max(r["t1"] for r in results)
    per_batch = cfg.chunks if schedule == "pipedream" else 1
    losses = [r["loss"] for r in results if r["loss"] is not None]
    return {
        "seconds": t1 - t0,
        # in the strategy's steps: a pipedream step is one minibatch of 64, a gpipe/1f1b step one batch of 512
        "seconds_per_step": (t1 - t0) / (steps * per_batch),
        "timed_steps": steps * per_batch,
        "samples": (warmup + steps) * cfg.batch,
        "timed_samples": steps * cfg.batch,
        "updates": (warmup + steps) * per_batch,
        "loss": losses[-1] if losses else None,
        "threads_cpu_s_per_step": [{k: round(v / (steps * per_batch), 5) for k, v in r["threads_cpu_s"].items()}
                                   for r in results],
    }


def run_bound(name: str, cfg, warmup: int, steps: int, timeout: float) -> dict:
    """The machine's bound on the same work: each stage alone in its process, both at once, no communication."""
    from benchmarks.common.workload import bound_worker
    from lightning_pipedream.runtime.faults.launch import run_local

    per_minibatch = name == "bound_64"
    results = run_local(bound_worker, cfg.stages, cfg, per_minibatch, warmup, steps, timeout=timeout)
    t0, t1 = min(r["t0"] for r in results), max(r["t1"] for r in results)
    per_batch = cfg.chunks if per_minibatch else 1
    return {
        "seconds": t1 - t0,
        "seconds_per_step": (t1 - t0) / (steps * per_batch),  # a step of 64 (bound_64) or of 512 (bound_512)
        "timed_steps": steps * per_batch,
        "samples": (warmup + steps) * cfg.batch,
        "timed_samples": steps * cfg.batch,
        "updates": (warmup + steps) * per_batch,
        "loss": None,
        "op_mean_s": [r["op_mean_s"] for r in results],
        "threads_cpu_s_per_step": [{k: round(v / (steps * per_batch), 5) for k, v in r["threads_cpu_s"].items()}
                                   for r in results],
    }


def summarize(runs: dict[str, list[dict]]) -> dict:
    out: dict[str, dict] = {}
    for name, rs in runs.items():
        sps = [r["seconds_per_step"] for r in rs]
        out[name] = {
            "seconds_per_step": median_or_none(sps),
            "min": min(sps),
            "max": max(sps),
            "runs": sps,
            "samples": rs[0]["samples"],
            "timed_samples": rs[0]["timed_samples"],
            "timed_steps": rs[0]["timed_steps"],
            "updates": rs[0]["updates"],
            "updates_per_rank": rs[0].get("updates_per_rank", [rs[0]["updates"]]),
            "loss": rs[-1]["loss"],
            "loadavg_1m": [[r["loadavg_before"][0], r["loadavg_after"][0]] for r in rs],
            "foreign_cores_before": [r.get("foreign_cores_before") for r in rs],
        }
        out[name] |= _per_rank_medians(rs)
    for name, rs in runs.items():
        c = out[name]
        c["samples_per_s"] = rs[0]["timed_samples"] / (c["seconds_per_step"] * rs[0]["timed_steps"])
    one = {n: "one_device_64" for n in GROUP_64} | {n: "one_device_512" for n in GROUP_512}
    for name in LIGHTNING:
        c = out[name]
        base = one[name]
        # same updates: the one device with the same batch per update (seconds per step, same samples per step)
        c["speedup_vs_one_device"] = out[base]["seconds_per_step"] / c["seconds_per_step"]
        # DDP does 64 samples per update: compare samples per second
        c["speedup_vs_ddp"] = c["samples_per_s"] / out["ddp"]["samples_per_s"]
        engine = f"engine_{name}"
        if engine in out:
            c["strategy_over_engine"] = c["seconds_per_step"] / out[engine]["seconds_per_step"]
    _shares(out, runs)
    return out


def _per_rank_medians(rs: list[dict]) -> dict:
    """Per rank, the median over the runs of each thread's CPU seconds and of each part of the breakdown."""
    out = {}
    for key in ("threads_cpu_s_per_step", "breakdown_s_per_step"):
        if key in rs[0]:
            out[key] = [{k: statistics.median(r[key][rank].get(k, 0.0) for r in rs) for k in rs[0][key][rank]}
                        for rank in range(len(rs[0][key]))]
    return out


def bound_of(name: str) -> str:
    """The bound doing the same updates as contender ``name``."""
    return "bound_64" if name in GROUP_64 or name in ("engine_pipedream", "bound_64") else "bound_512"


def _shares(out: dict[str, dict], runs: dict[str, list[dict]]) -> None:
    """Every contender's share of the bound with the same updates: the median's, and round by round."""
    for name, c in out.items():
        bound = bound_of(name)
        if bound not in out:
            continue
        c["bound"] = bound
        c["share_of_bound"] = out[bound]["seconds_per_step"] / c["seconds_per_step"]
        c["share_of_bound_per_round"] = [b["seconds_per_step"] / a["seconds_per_step"]
                                         for a, b in zip(runs[name], runs[bound])]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/lightning.json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round, shared processes (~25 s)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed batches of 512 per run (default 6; quick 1)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up batches of 512 per run (default 1)")
    parser.add_argument("--shared", action="store_true",
                        help="(default with --quick) run the Lightning contenders in 2 shared sets of processes, both "
                        "at once, to save Lightning's start-up: a smoke test, the timings are not comparable")
    parser.add_argument("--only", default="", help="comma-separated contenders (default all)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="cProfile the timed steps of each of --only's contenders, per rank, into this folder")
    parser.add_argument("--malloc", choices=("keep", "default"), default="keep",
                        help="keep (default, as PipeDreamStrategy's keep_freed_memory=True): glibc keeps freed memory "
                        "for reuse in every contender; default: glibc's own behaviour everywhere")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--stages", type=int, default=2,
                        help="pipeline stages = processes of the pipelines, DDP and the bound (must divide the "
                        "minibatch: DDP's ranks share it)")
    parser.add_argument("--max-wait", type=float, default=None,
                        help="seconds to wait before each run for other processes to use < 0.25 cores (default 20; "
                        "quick 0)")
    parser.add_argument("--plot", type=Path, default=None, help="only draw --json's results into this PNG")
    args = parser.parse_args(argv)
    if args.plot:  # from an existing JSON
        plot(json.loads((args.json or Path("benchmarks/results/lightning.json")).read_text()), args.plot)
        return {}
    if args.worker:
        _worker(json.loads(args.worker))
        return {}

    from benchmarks.common.workload import Config
    from lightning_pipedream.runtime.execution.allocator import keep_freed_memory

    if args.quick:  # a Linear on every stage
        cfg = Config(layers=max(2, args.stages), width=32, batch=16, chunks=4, stages=args.stages)
    else:
        cfg = Config(stages=args.stages)
    if args.stages < 2 or cfg.micro % args.stages or 2 * cfg.layers < args.stages:
        parser.error(f"--stages {args.stages}: give 2 or more that divide the minibatch of {cfg.micro} (DDP's ranks "
                     f"share it) and at most {2 * cfg.layers} (the model's modules)")
    rounds = args.rounds or (1 if args.quick else 3)
    steps = args.steps or (1 if args.quick else 6)
    warmup = args.warmup if args.warmup is not None else 1
    if warmup < 1:
        parser.error("--warmup must be at least 1: the timing starts at the end of the last warm-up step")
    json_path = args.json or Path("benchmarks/results/lightning.json")
    names = [n for n in CONTENDERS if not args.only or n in args.only.split(",")]
    cfg_dict = {"layers": cfg.layers, "width": cfg.width, "batch": cfg.batch, "chunks": cfg.chunks,
                "stages": cfg.stages}

    # (warm-up, timed) Lightning steps per contender: a step is a batch of 64 or of 512 (PER_BATCH: 8 minibatches)
    per = {n: cfg.chunks // minibatches_per_step(n, cfg.chunks) for n in GROUP_64}  # Lightning steps per batch
    units = {n: (warmup * per[n], steps * per[n]) if n in GROUP_64 else (warmup, steps) for n in CONTENDERS}
    shared = args.shared or args.quick
    if args.malloc == "keep" and not keep_freed_memory():  # here too: the engine's runs fork from this process
        parser.error("--malloc keep needs glibc; use --malloc default")
    from benchmarks.common.workload import GRADS_ENV

    os.environ[GRADS_ENV] = "free" if args.malloc == "keep" else "keep"  # every contender's zero_grads

    if args.profile:
        for name in names:
            run_lightning_many([name], cfg_dict, units, args.timeout, profile=True, profile_dir=args.profile,
                               malloc=args.malloc)
            print(f"profiled {name} into {args.profile / name}", flush=True)
        return {}

    started = time.time()
    load0 = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}", flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    if shared:  # a smoke run: one process for the one-device runs, one pair for the rest, both at once
        from concurrent.futures import ThreadPoolExecutor

        before = os.getloadavg()
        sets = [[n for n in names if n in LIGHTNING and n.startswith("one_device")],
                [n for n in names if n in LIGHTNING and not n.startswith("one_device")]]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(run_lightning_many, ns, cfg_dict, units, args.timeout, malloc=args.malloc)
                       for ns in sets if ns]
            done = {n: r for f in futures for n, r in f.result().items()}
        for n in names:
            if n in done:
                run = done[n]
            elif n in BOUNDS:
                run = run_bound(n, cfg, warmup, steps, args.timeout)
            else:
                run = run_engine(n, cfg, warmup, steps, args.timeout)
            run["loadavg_before"], run["loadavg_after"] = before, os.getloadavg()
            runs[n].append(run)
        rounds = 0
    from benchmarks.common.workload import idle_load, wait_for_quiet

    max_wait = args.max_wait if args.max_wait is not None else (0.0 if args.quick else 20.0)
    for rnd in range(rounds):
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for name in order:
            waited = wait_for_quiet(max_wait)  # other engineers' tests come in bursts
            others = idle_load(0.5)["foreign_cores"]  # what other processes use just before the run
            before = os.getloadavg()
            if name in ENGINE:
                run = run_engine(name, cfg, warmup, steps, args.timeout)
            elif name in BOUNDS:
                run = run_bound(name, cfg, warmup, steps, args.timeout)
            else:
                run = run_lightning(name, cfg_dict, units, args.timeout, args.malloc)
            run["loadavg_before"], run["loadavg_after"] = before, os.getloadavg()
            run["foreign_cores_before"], run["waited_s"] = others, waited
            runs[name].append(run)
            print(f"round {rnd + 1}/{rounds} {name:18s} {run['seconds_per_step']:.4f} s/step "
                  f"({run['timed_steps']} steps, {run['updates']} updates, {run['samples']} samples; "
                  f"load {before[0]:.2f} -> {run['loadavg_after'][0]:.2f}, others using {others:.2f} cores before)",
                  flush=True)
    if set(names) >= set(LIGHTNING):
        contenders = summarize(runs)
    else:
        contenders = summarize_partial(runs)
        _shares(contenders, runs)
    loads = [x for rs in runs.values() for r in rs for x in (r["loadavg_before"][0], r["loadavg_after"][0])]
    doc = {
        "config": {**cfg_dict, "micro": cfg.micro, "stages": cfg.stages, "threads_per_process": 1,
                   "rounds": rounds, "shared_processes": shared,
                   "warmup_batches_of_512": warmup, "timed_batches_of_512": steps,
                   "quick": args.quick, "malloc": args.malloc},
        "machine": {"cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                    "loadavg_1m_during": {"median": median_or_none(loads), "min": min(loads), "max": max(loads)}},
        "contenders": contenders,
        "seconds": time.time() - started,
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=1))
    _print_table(doc)
    return doc


def plot(doc: dict, path: Path) -> None:
    """Samples per second of every contender, median and per round, as a bar chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = doc["contenders"]
    order = [n for n in ("one_device_64", "ddp", "pipedream", "pipedream_gloo", PER_BATCH, "engine_pipedream",
                         "bound_64", "one_device_512", "gpipe", "engine_gpipe", "1f1b", "engine_1f1b", "bound_512")
             if n in c]
    cfg = doc["config"]  # seconds per step are per minibatch (the bound_64 group) or per batch
    per_step = {n: cfg["micro"] if bound_of(n) == "bound_64" else cfg["batch"] for n in order}
    fig, ax = plt.subplots(figsize=(9, 4))
    colors = ["tab:gray" if n.startswith("one_device") else "tab:red" if n == "ddp" else "k" if n in BOUNDS
              else "tab:green" if n.startswith("engine") else "tab:blue" for n in order]
    ax.bar(range(len(order)), [per_step[n] / c[n]["seconds_per_step"] for n in order], color=colors, alpha=0.8)
    for i, n in enumerate(order):
        ax.scatter([i] * len(c[n]["runs"]), [per_step[n] / r for r in c[n]["runs"]], color="k", s=8, zorder=3)
    ax.set_xticks(range(len(order)), [n.replace("_", " ") for n in order], rotation=20)
    ax.set_ylabel("samples / s (bar: median; dots: rounds)")
    load = doc["machine"]["loadavg_1m_during"]
    ax.set_title(f"MLP under Lightning, 1 thread per process; load average {load['min']:.1f}-{load['max']:.1f} "
                 f"on {doc['machine']['cpus']} CPUs", fontsize=10)
    split = order.index("one_device_512") - 0.5 if "one_device_512" in order else len(order) - 0.5
    for bound in BOUNDS:  # the target: 90 % of the bound doing the same updates
        if bound in c:
            group = [i for i, n in enumerate(order) if bound_of(n) == bound]
            rate = 0.9 * per_step[bound] / c[bound]["seconds_per_step"]
            ax.hlines(rate, min(group) - 0.4, max(group) + 0.4, colors="k", linestyles="dashed", lw=0.8)
            ax.text(min(group) - 0.4, rate, "90 % of the bound", va="bottom", fontsize=8)
    ax.text(split / 2 - 0.5, ax.get_ylim()[1] * 0.95, "one update per 64 samples", ha="center", fontsize=9)
    if split < len(order) - 1:
        ax.axvline(split, color="k", lw=0.5)
        ax.text((split + len(order)) / 2 - 0.5, ax.get_ylim()[1] * 0.95, "one update per 512 samples", ha="center",
                fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize_partial(runs: dict[str, list[dict]]) -> dict:
    return {n: {"seconds_per_step": median_or_none([r["seconds_per_step"] for r in rs]),
                "runs": [r["seconds_per_step"] for r in rs], "samples": rs[0]["samples"],
                "updates": rs[0]["updates"], **_per_rank_medians(rs)} for n, rs in runs.items()}


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _print_table(doc: dict) -> None:
    c = doc["contenders"]
    print("| contender | s/step (median) | min - max | samples/s | share of bound | vs one device, same updates | "
          "vs DDP | strategy / engine |")
    print("|---|---|---|---|---|---|---|---|")
    for name in CONTENDERS:
        if name not in c:
            continue
        r = c[name]
        print(f"| {name} | {_fmt(r['seconds_per_step'], '.4f')} | {_fmt(r.get('min'), '.4f')} - "
              f"{_fmt(r.get('max'), '.4f')} | {_fmt(r.get('samples_per_s'), '.0f')} | "
              f"{_fmt(r.get('share_of_bound'), '.2f')} | {_fmt(r.get('speedup_vs_one_device'), '.2f')} | "
              f"{_fmt(r.get('speedup_vs_ddp'), '.2f')} | "
              f"{_fmt(r.get('strategy_over_engine'), '.2f')} |")
    for name in ("pipedream", "pipedream_gloo", PER_BATCH, "engine_pipedream", "bound_64"):
        for rank, parts in enumerate(c.get(name, {}).get("breakdown_s_per_step", [])):
            print(f"{name} rank {rank}, ms per step: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in parts.items()))
        for rank, threads in enumerate(c.get(name, {}).get("threads_cpu_s_per_step", [])):
            print(f"{name} rank {rank}, CPU ms per step by thread: "
                  + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in threads.items() if v))
    m = doc["machine"]["loadavg_1m_during"]
    print(f"load average (1 min) during the runs: median {m['median']:.2f}, {m['min']:.2f} - {m['max']:.2f}")


if __name__ == "__main__":
    main()
