"""What a checkpoint save adds to each rank's resident peak, sharded against full, and what consolidating costs.

Run from the repository root::

    python -m benchmarks.big_models.sharded_checkpoint                  # results/sharded_checkpoint.json (~1 min alone)
    python -m benchmarks.big_models.sharded_checkpoint --quick --json /tmp/quick.json   # a 16 MB model
    python -m benchmarks.big_models.sharded_checkpoint --shard full  # results/sharded_checkpoint_shard.json (2x2)

The model is one ``nn.Sequential`` of ``layers`` x ``Linear(width, width)`` (12 x 2048 x 2048 fp32: 201 MB of
weights, 201 MB more of momentum), trained one step under ``PipeDreamStrategy(schedule="1f1b", chunks=2)`` on 4 CPU
processes with SGD and momentum. Then every rank saves twice: ``checkpoint="sharded"`` (each rank writes its own
stage by name) and ``checkpoint="full"`` (gathered on rank 0), in that order (the full save's gather leaves freed
memory behind). Per rank and save: ``growth_mb``, the resident peak (VmHWM, reset just before) above the resident
memory just before, and ``seconds``. Then ``consolidate``: one process reads the sharded directory into one file
(``peak_growth_mb`` above its resident memory before, and ``seconds``).

``--shard full`` (or ``grad_op``): the same model, 8 layers, on 2 stages x 2 replicas whose replicas shard each
stage (FSDP2), with Adam. Per rank: ``own_mb`` (its shards of the weights and of Adam's state) and ``stage_mb`` (the
stage whole); then a sharded save, reading it back (weights and optimizer state, as a resume does once the stage
exists) and a full save, each with ``live_added_mb`` (the most tensor bytes alive above those the rank held before:
``plan.live_bytes.LiveTensorBytes``, which counts what every operator makes, a gather included, without the
allocator's caching), ``growth_mb`` (VmHWM as above) and ``seconds``; and ``written_mb``, the rank's data file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.figures import write_result
from benchmarks.common.proc_memory import reset_peak_rss, status_mb

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 4


def _shard_worker(trainer, strategy, out: Path) -> dict:  # type: ignore[no-untyped-def]
    """Under ``shard=``: what a sharded save, reading it back and a full save add on this rank (module docstring)."""
    import torch
    from torch.distributed.tensor import DTensor

    from lightning_pipedream.plan.live_bytes import LiveTensorBytes
    from lightning_pipedream.runtime.stages.sharding import local_bytes

    module, optimizer = strategy.lightning_module, trainer.optimizers[0]

    def held() -> list:
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return [*module.parameters(), *(p.grad for p in module.parameters() if p.grad is not None), *state]

    def measured(action) -> dict:  # type: ignore[no-untyped-def]
        with LiveTensorBytes() as meter:
            meter.add_all(held())  # what the rank holds is not new (a view of it, say)
            base = meter.live
            meter.reset_peak()
            reset_peak_rss()
            before, start = status_mb("VmRSS"), time.perf_counter()
            action()
            seconds, growth = time.perf_counter() - start, status_mb("VmHWM") - before
        return {"live_added_mb": (meter.peak - base) / 2**20, "growth_mb": growth, "seconds": seconds}

    def read_back() -> None:
        loaded = strategy.load_checkpoint(out / "sharded.ckpt")
        strategy.load_model_state_dict(loaded)
        strategy.checkpoints.after_setup(strategy._pipeline)
        strategy.load_optimizer_state_dict(loaded)

    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    params = list(module.parameters())
    result: dict = {"rank": trainer.global_rank, "sharded_stage": any(isinstance(p, DTensor) for p in params),
                    "own_mb": (local_bytes(params) + local_bytes(state)) / 2**20,
                    "stage_mb": sum(t.numel() * t.element_size() for t in [*params, *state]) / 2**20}
    result["sharded"] = measured(lambda: trainer.save_checkpoint(out / "sharded.ckpt"))
    result["read_back"] = measured(read_back)
    strategy.checkpoints.mode = "full"
    result["full"] = measured(lambda: trainer.save_checkpoint(out / "full.ckpt"))
    result["written_mb"] = (out / "sharded.ckpt" / f"__{trainer.global_rank}_0.distcp").stat().st_size / 2**20
    return result


def _worker(spec: dict) -> None:
    import lightning as L
    import torch
    import torch.distributed.checkpoint  # noqa: F401  (its import is not a save's memory)
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.common.wide_module import wide_module
    from lightning_pipedream import PipeDreamStrategy

    torch.set_num_threads(1)
    width, layers, out = spec["width"], spec["layers"], Path(spec["out"])

    def optimizer(params):  # type: ignore[no-untyped-def]
        if spec.get("shard"):
            return torch.optim.Adam(params, lr=1e-4)
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9)

    torch.manual_seed(0)  # every rank the same batch
    data = TensorDataset(torch.randn(8, width), torch.randn(8, width))
    sharding = {"stages": 2, "shard": spec["shard"]} if spec.get("shard") else {}
    strategy = PipeDreamStrategy(schedule="1f1b", chunks=2, keep_freed_memory=False, checkpoint="sharded", **sharding)
    trainer = L.Trainer(accelerator="cpu", devices=PROCESSES, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(wide_module(width, layers, optimizer), DataLoader(data, batch_size=8))
    trainer.save_checkpoint(out / "warm.ckpt")  # first-call costs of a sharded save (its planner, gloo buffers)
    if spec.get("shard"):
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(_shard_worker(trainer, strategy, out)))
        return
    result: dict = {"rank": trainer.global_rank}
    for mode in ("sharded", "full"):
        strategy.checkpoints.mode = mode
        reset_peak_rss()
        before, start = status_mb("VmRSS"), time.perf_counter()
        trainer.save_checkpoint(out / f"{mode}.ckpt")
        result[mode] = {"growth_mb": status_mb("VmHWM") - before, "seconds": time.perf_counter() - start}
    result["stage_weights_mb"] = sum(p.numel() * p.element_size() for p in strategy.lightning_module.parameters()
                                     ) / 2**20
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _consolidate(directory: str, out: str) -> dict:
    from lightning_pipedream.strategy.checkpoints.checkpoint_commands import consolidate_to_file

    reset_peak_rss()
    before, start = status_mb("VmRSS"), time.perf_counter()
    consolidate_to_file(directory, out)
    return {"peak_growth_mb": status_mb("VmHWM") - before, "seconds": time.perf_counter() - start,
            "file_mb": os.path.getsize(out) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--consolidate", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a 16 MB model (smoke run)")
    parser.add_argument("--shard", choices=["full", "grad_op"], help="2 stages x 2 sharded replicas, Adam")
    parser.add_argument("--json", type=Path, help="default: results/sharded_checkpoint.json (_shard.json: --shard)")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    if args.consolidate:
        print(json.dumps(_consolidate(*args.consolidate)))
        return
    width, layers = (1024, 4) if args.quick else (2048, 8 if args.shard else 12)
    weights_mb = layers * (width * width + width) * 4 / 2**20
    optimizer = "Adam" if args.shard else "SGD with momentum"
    json_path = args.json or ROOT / "benchmarks" / "results" / (
        "sharded_checkpoint_shard.json" if args.shard else "sharded_checkpoint.json")
    result: dict = {"model": f"{layers} x Linear({width}, {width}), fp32, {optimizer}", "weights_mb": weights_mb,
                    "processes": PROCESSES, "when": time.strftime("%Y-%m-%d %H:%M"), "load_before": os.getloadavg()}
    if args.shard:
        result["layout"] = f"2 stages x 2 replicas, shard={args.shard!r}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"width": width, "layers": layers, "out": tmp, "shard": args.shard}
        proc = subprocess.run([sys.executable, "-m", "benchmarks.big_models.sharded_checkpoint", "--worker",
                               json.dumps(spec)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the training failed:\n{proc.stderr[-3000:]}")
        result["ranks"] = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(PROCESSES)]
        if args.shard:
            _print_shards(result)
            write_result(json_path, result)
            return
        proc = subprocess.run([sys.executable, "-m", "benchmarks.big_models.sharded_checkpoint", "--consolidate",
                               str(Path(tmp) / "sharded.ckpt"), str(Path(tmp) / "one.ckpt")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"consolidate failed:\n{proc.stderr[-3000:]}")
        result["consolidate"] = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in result["ranks"]:
        print(f"rank {r['rank']} (stage {r['stage_weights_mb']:.0f} MB): sharded save +{r['sharded']['growth_mb']:.1f} "
              f"MB in {r['sharded']['seconds']:.2f} s, full save +{r['full']['growth_mb']:.1f} MB in "
              f"{r['full']['seconds']:.2f} s")
    c = result["consolidate"]
    print(f"consolidate: +{c['peak_growth_mb']:.0f} MB in {c['seconds']:.2f} s, a {c['file_mb']:.0f} MB file "
          f"(model {weights_mb:.0f} MB)")
    write_result(json_path, result)


def _print_shards(result: dict) -> None:
    for r in result["ranks"]:
        parts = ", ".join(f"{what} +{r[what]['live_added_mb']:.1f} MB live (+{r[what]['growth_mb']:.1f} MB "
                          f"resident) in {r[what]['seconds']:.2f} s" for what in ("sharded", "read_back", "full"))
        print(f"rank {r['rank']} (own {r['own_mb']:.0f} MB of a {r['stage_mb']:.0f} MB stage, wrote "
              f"{r['written_mb']:.0f} MB): {parts}")


if __name__ == "__main__":
    main()
