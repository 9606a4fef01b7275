"""Peak memory per rank of gpipe, 1f1b and pipedream on 2 stages (``--stages N``) at 8 micro-batches.

Run from the repository root::

    python -m benchmarks.memory.peaks --json benchmarks/results/memory.json

Each schedule runs in a fresh Python process (which forks its 2 ranks), so one configuration's
allocations do not inflate another's peak. Per rank it reports:

* ``rss_setup_mb``: resident memory once the model, stage and optimizer exist (torch itself is most of it);
* ``peak_rss_mb``: the peak resident memory (VmHWM) over the training steps, after resetting the
  peak at the end of setup (``/proc/self/clear_refs``); ``peak_rss_growth_mb`` is the difference;
* ``rss_end_mb`` and ``rss_after_malloc_trim_mb``: resident memory after the steps, and after
  ``gc.collect()`` freed what only reference cycles kept and glibc's ``malloc_trim(0)`` returned
  the free memory it kept (so: what nothing uses any more);
* ``peak_in_flight``: the most micro-batches (pipedream: minibatches) whose forward has run and
  whose backward has not, read from the stage after every forward;
* ``peak_activation_mb``: the most bytes of tensors that autograd kept for backward at one time
  (counted with ``torch.autograd.graph.saved_tensors_hooks``; weights are not activations and are
  left out; a tensor saved by several operations counts once);
* ``peak_weight_versions`` and ``weight_versions_mb`` (pipedream): the most distinct versions of
  the stage's weights alive at once (the live one and the stashed ones), and their bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import torch
from torch import nn

from benchmarks.common.proc_memory import status_kb, try_reset_peak_rss
from benchmarks.common.workload import OURS, Config, build_model, make_batch, sgd
from lightning_pipedream.runtime.faults.launch import run_local
from lightning_pipedream.runtime.pipeline import Pipeline

REPO = Path(__file__).resolve().parents[2]  # the ranks' processes import benchmarks.common.workload from here


def _malloc_trim() -> bool:
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


class SavedTensorMeter:
    """Live bytes of tensors autograd saved for backward, and their peak, excluding the given weights."""

    def __init__(self, weight_ptrs):
        self.weight_ptrs = weight_ptrs  # () -> set of data pointers of weight storages
        self.live = 0
        self.peak = 0
        self._counts: dict[tuple, int] = {}

    def pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() in self.weight_ptrs():
            return t
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        count = self._counts.get(key, 0)
        if count == 0:
            self.live += t.numel() * t.element_size()
            self.peak = max(self.peak, self.live)
        self._counts[key] = count + 1
        holder = _Holder(t)
        weakref.finalize(holder, self._release, key, t.numel() * t.element_size())
        return holder

    def _release(self, key, nbytes) -> None:
        self._counts[key] -= 1
        if self._counts[key] == 0:
            del self._counts[key]
            self.live -= nbytes

    @staticmethod
    def unpack(obj):
        return obj.tensor if isinstance(obj, _Holder) else obj

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def memory_worker(rank: int, world: int, cfg: Config, schedule: str, steps: int) -> dict:
    x, y = make_batch(cfg)
    chunks = 1 if schedule == "pipedream" else cfg.chunks
    pipe = Pipeline(build_model(cfg), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule=schedule, chunks=chunks)
    stage, weights = pipe.engine.stage, pipe.engine.weights
    param_bytes = sum(p.numel() * p.element_size() for p in pipe.module.parameters())
    peaks = {"in_flight": 0, "versions": 1}

    def weight_ptrs() -> set[int]:
        ptrs = {p.untyped_storage().data_ptr() for p in pipe.module.parameters()}
        if weights is not None:
            for leaves in weights._leaves.values():
                ptrs |= {t.untyped_storage().data_ptr() for t in leaves.values()}
        return ptrs

    meter = SavedTensorMeter(weight_ptrs)
    forward = stage.forward

    def counting_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        peaks["in_flight"] = max(peaks["in_flight"], stage.in_flight())
        if weights is not None:
            peaks["versions"] = max(peaks["versions"], weights.stored_versions())
        return out

    stage.forward = counting_forward
    if weights is not None:
        after_update = weights.after_update

        def counting_after_update(*args, **kwargs):
            # right after an update the stashed versions and the new live one are all alive
            peaks["versions"] = max(peaks["versions"], weights.stored_versions())
            return after_update(*args, **kwargs)

        weights.after_update = counting_after_update

    if schedule == "pipedream":
        xs, ys = x.split(cfg.micro), y.split(cfg.micro)

        def step():
            for xm, ym in zip(xs, ys):
                pipe.step(xm, ym)
    else:

        def step():
            pipe.step(x, y)

    rss_setup = status_kb("VmRSS")
    reset = try_reset_peak_rss()
    with meter.hooks():
        for _ in range(steps):
            step()
        pipe.drain()
    peak = status_kb("VmHWM")
    rss_end = status_kb("VmRSS")
    trimmed = _malloc_trim()
    out = {
        "rank": rank,
        "rss_setup_mb": rss_setup / 1024,
        "peak_rss_mb": peak / 1024,
        "peak_rss_growth_mb": (peak - rss_setup) / 1024 if reset else None,
        "rss_end_mb": rss_end / 1024,
        # what the C allocator holds but nothing uses: given back by malloc_trim (glibc only)
        "rss_after_malloc_trim_mb": status_kb("VmRSS") / 1024 if trimmed else None,
        "peak_in_flight": peaks["in_flight"],
        "peak_activation_mb": meter.peak / 2**20,
        "activation_mb_per_microbatch": None,
        "param_mb": param_bytes / 2**20,
    }
    if weights is not None:
        out["peak_weight_versions"] = peaks["versions"]
        out["weight_versions_mb"] = peaks["versions"] * param_bytes / 2**20
    if peaks["in_flight"]:
        out["activation_mb_per_microbatch"] = out["peak_activation_mb"] / peaks["in_flight"]
    return out


def measure(schedule: str, cfg: Config, steps: int, timeout: float = 300.0) -> list[dict]:
    return run_local(memory_worker, cfg.stages, cfg, schedule, steps, timeout=timeout)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/memory.json"))
    parser.add_argument("--steps", type=int, default=3, help="training steps of 512 samples per configuration")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages = processes")
    parser.add_argument("--one", choices=OURS, help=argparse.SUPPRESS)  # run one schedule in this process
    args = parser.parse_args(argv)
    cfg = Config(layers=args.layers, width=args.width, batch=args.batch, chunks=args.chunks, stages=args.stages)
    if args.one:
        print(json.dumps(measure(args.one, cfg, args.steps)))
        return {}
    results = {}
    for schedule in OURS:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.memory.peaks",
            "--one",
            schedule,
            "--steps",
            str(args.steps),
            "--layers",
            str(args.layers),
            "--width",
            str(args.width),
            "--batch",
            str(args.batch),
            "--chunks",
            str(args.chunks),
            "--stages",
            str(args.stages),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"{schedule} failed:\n{proc.stderr}")
        results[schedule] = json.loads(proc.stdout.strip().splitlines()[-1])
    doc = {
        "config": {
            "layers": cfg.layers,
            "width": cfg.width,
            "batch": cfg.batch,
            "chunks": cfg.chunks,
            "stages": cfg.stages,
            "micro_batch": cfg.micro,
            "steps": args.steps,
            "activation_mb_per_layer_per_microbatch": cfg.micro * cfg.width * 4 / 2**20,
        },
        "ranks": results,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    print(
        f"{'schedule':10s} {'rank':>4s} {'setup MB':>9s} {'peak MB':>8s} {'growth MB':>9s} {'trimmed MB':>10s} "
        f"{'in flight':>9s} {'act. MB':>8s} {'versions':>8s} {'weights MB':>10s}"
    )
    for schedule, ranks in results.items():
        for r in ranks:
            growth = "" if r["peak_rss_growth_mb"] is None else f"{r['peak_rss_growth_mb']:.1f}"
            trimmed = "" if r["rss_after_malloc_trim_mb"] is None else f"{r['rss_after_malloc_trim_mb']:.1f}"
            print(
                f"{schedule:10s} {r['rank']:4d} {r['rss_setup_mb']:9.1f} {r['peak_rss_mb']:8.1f} "
                f"{growth:>9s} {trimmed:>10s} "
                f"{r['peak_in_flight']:9d} {r['peak_activation_mb']:8.2f} {r.get('peak_weight_versions', 1):8d} "
                f"{r.get('weight_versions_mb', r['param_mb']):10.1f}"
            )
    return doc


if __name__ == "__main__":
    main()
