"""One prepared check of what a GPU changes: memory predicted against measured, every schedule on device tensors."""

# Run from the repository root (docs/gpu.md says what each section shows and what has run where):
#
#     python -m benchmarks.memory.gpu_check                 # on the GPU: JSON in benchmarks/results/gpu_check_cuda.json
#     python -m benchmarks.memory.gpu_check --device cpu --quick  # the same code paths on the CPU (the CI smoke test)
#
# (a) memory: each schedule of benchmarks/memory/memory_model.py on 2 stages, each stage measured alone: the ranks are
#     threads of this process under the model of NCCL's rules (lightning_pipedream/testing/nccl_model.py),
#     the measured rank on the device and the others on the CPU. On CUDA its peak is torch.cuda.max_memory_allocated
#     over its construction and training (cuBLAS's workspaces cleared first, so that they count); on the CPU the live
#     tensor bytes of its thread (benchmarks.memory.memory_model.metered_run). Predicted: plan.memory with device=
#     the same.
# (b) executor: every schedule with all ranks on the device (threads, the same model of NCCL) against one device
#     trained by a plain loop (flushed schedules: equal); pipedream and 2bw against the same pipeline on the CPU (the
#     suite checks the CPU's against their rules: tests/runtime/test_nccl_model.py).
# (c) with 2 or more GPUs: Trainer(accelerator="gpu", devices=N) per schedule against one device, and steps/s
#     against torch.distributed.pipelining on the same model, in the same processes.

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.memory import memory_model
from lightning_pipedream.plan.memory import predict_memory, stage_bytes
from lightning_pipedream.plan.profile import profile_module
from lightning_pipedream.runtime.pipeline import Pipeline
from lightning_pipedream.testing.nccl_model import PointToPointModel

SCHEDULES = ("gpipe", "1f1b", "pipedream", "2bw", "zb-h1", "interleaved")
ASYNCHRONOUS = ("pipedream", "2bw")
# (b): schedule, stages, micro-batches, options: 2 and 4 stages, each schedule once at least
EXECUTOR_CASES: list[tuple[str, int, int, dict]] = [
    ("gpipe", 2, 4, {}), ("gpipe", 4, 4, {}), ("1f1b", 2, 4, {}), ("1f1b", 4, 8, {}), ("zb-h1", 4, 4, {}),
    ("interleaved", 2, 4, {"virtual_stages": 2}), ("pipedream", 3, 1, {}), ("2bw", 2, 2, {}),
]
TOLERANCE = 1e-4  # largest relative difference of any weight tensor (one H100 measured 1.4e-6; fp32, no TF32)
MEMORY_TOLERANCE = 0.10  # the aim: predicted within 10 % of measured per stage
LR, MOMENTUM = 0.05, 0.9
# The model of NCCL takes any name as a process group: the second group of the same ranks that the directional
# transport sends to lower ranks on (a real run makes it with dist.new_group)
REVERSE: Any = "reverse"


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here (torch.cuda.is_available() is False)")
    return name


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


# ---------------------------------------------------------------------------------------------------------- (a)
def _cuda_peak(build: Any, steps: int) -> dict:
    """The stage's peak as a GPU user reads it: max_memory_allocated over its construction and training, less what
    was allocated before. cuBLAS's workspaces are dropped first (they outlive threads: a handle goes back to a pool)
    and the cache emptied, so the stage allocates its own from fresh segments, as the model assumes."""
    torch.cuda.synchronize()
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    started = time.perf_counter()
    pipe, x, y = build()
    for _ in range(steps):
        pipe.step(x, y)
    pipe.drain()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"peak_bytes": peak, "after_bytes": torch.cuda.memory_allocated() - base,
            "parameters": memory_model._nbytes(pipe.module.parameters()), "train_s": time.perf_counter() - started}


def _cpu_peak(build: Any, steps: int) -> dict:
    measured = memory_model.metered_run(build, steps, quick=True)  # the thread's live tensor bytes
    return {"peak_bytes": measured["peak_tensor_bytes"], "peak_phase": measured["peak_phase"],
            "parameters": measured["parameters"], "optimizer_state": measured["optimizer_state"],
            "train_s": measured["train_s"]}


def measure_stage(model: nn.Sequential, run: dict, rank: int, device: str, timeout: float) -> dict:
    """Rank ``rank`` of ``run``'s pipeline on ``device``, the other ranks on the CPU, all threads of this process
    under the model of NCCL's rules: its measured peak."""
    stages = memory_model.STAGES
    steps = run["steps"] + (stages if run["schedule"] in ASYNCHRONOUS else 0)  # fill the pipeline first
    x, y = memory_model.make_batch(run["model"], run["width"], run["batch"])
    p2p = PointToPointModel(stages, watchdog_s=timeout)

    def rank_main(r: int) -> dict | None:
        here = torch.device(device if r == rank else "cpu")

        def build() -> tuple[Pipeline, Any, Any]:
            pipe = Pipeline(copy.deepcopy(model), loss_fn=nn.functional.mse_loss, optimizer=memory_model.adam,
                            schedule=run["schedule"], chunks=run["chunks"], balance=run["balance"],
                            recompute=run["recompute"], virtual_stages=run["virtual_stages"], device=here,
                            transport="directional", reverse_group=REVERSE)
            return (pipe, x.to(here) if pipe.is_first else None, y.to(here) if pipe.is_last else None)

        if r != rank:
            pipe, xs, ys = build()
            for _ in range(steps):
                pipe.step(xs, ys)
            pipe.drain()
            return None
        return _cuda_peak(build, steps) if here.type == "cuda" else _cpu_peak(build, steps)

    return p2p.run(rank_main, timeout=timeout)[rank]


def memory_section(device: str, quick: bool, timeout: float) -> list[dict]:
    """(a): per model, schedule (with and without recompute unless quick) and stage, predicted against measured."""
    if device == "cuda":
        sizes = {"mlp": (64, 64)} if quick else {"mlp": (1024, 256), "block": (512, 32)}
        capability = tuple(torch.cuda.get_device_capability())
    else:
        sizes = {"mlp": (64, 64)} if quick else {"mlp": (256, 256), "block": (128, 64)}
        capability = (9, 0)
    out: list[dict[str, Any]] = []
    for name, (width, batch) in sizes.items():
        model = memory_model.build_model(name, width)  # once: the ranks' threads share torch's generator
        x, _ = memory_model.make_batch(name, width, batch)
        try:  # profiled where it trains (saved tensors differ by device: attention's, say)
            profile = profile_module(copy.deepcopy(model).to(device), x.to(device), warmup=0, repeats=1,
                                     working_sets=True)
        except Exception as err:  # noqa: BLE001  (recorded: the other model still runs)
            out.append({"model": name, "schedule": "(profile)", "error": _words(err)})
            print(f"(a) {name}: profiling FAILED {_words(err)}", flush=True)
            continue
        for run in memory_model.runs_for(name, len(profile.layers), quick):
            run.update(model=name, width=width, batch=batch, steps=1 if quick else 2)
            sized = stage_bytes(profile, run["balance"], device=device)
            predicted = predict_memory(sized, run["schedule"], run["chunks"], virtual_stages=run["virtual_stages"],
                                       recompute=run["recompute"], optimizer=memory_model.OPTIMIZER, device=device,
                                       cuda_capability=capability)  # type: ignore[arg-type]
            for rank in range(memory_model.STAGES):
                keys: dict[str, Any] = {k: run[k] for k in ("model", "schedule", "recompute", "chunks", "balance")}
                try:
                    measured = measure_stage(model, run, rank, device, timeout)
                except Exception as err:  # noqa: BLE001  (a GPU's time is scarce: record it, check the rest)
                    out.append({**keys, "rank": rank, "error": _words(err)})
                    print(f"(a) {name} {run['schedule']} rank {rank}: FAILED {_words(err)}", flush=True)
                    continue
                terms = predicted[rank].to_json()
                ratio = measured["peak_bytes"] / terms["predicted_peak_bytes"]
                row = {**keys, "rank": rank, "measured": measured, "predicted": terms, "measured_over_predicted": ratio,
                       "within_10_percent": abs(ratio - 1) <= MEMORY_TOLERANCE}
                out.append(row)
                mib = (measured["peak_bytes"] / 2**20, terms["predicted_peak_bytes"] / 2**20)
                print(f"(a) {name:5s} {run['schedule']:11s} rc={int(run['recompute'])} rank {rank}: measured "
                      f"{mib[0]:9.2f} MiB, predicted {mib[1]:9.2f} MiB, ratio {ratio:.3f}", flush=True)
    return out


# ---------------------------------------------------------------------------------------------------------- (b)
def mlp(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(4):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods)


def batches(n: int, width: int, size: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, width, generator=g), torch.randn(size, width, generator=g)) for _ in range(n)]


def pipeline_weights(schedule: str, stages: int, chunks: int, options: dict, device: str, width: int, steps: int,
                     timeout: float) -> dict[str, torch.Tensor]:
    """Every rank on ``device`` as a thread under the model of NCCL's rules: the merged weights after ``steps``."""
    layers, data = mlp(width), batches(steps, width)

    def rank_main(rank: int) -> dict[str, torch.Tensor]:
        pipe = Pipeline(copy.deepcopy(layers), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule=schedule,
                        chunks=chunks, device=device, transport="directional", reverse_group=REVERSE, **options)
        for x, y in data:
            pipe.step(x.to(device) if pipe.is_first else None, y.to(device) if pipe.is_last else None)
        pipe.drain()
        return {k: v.detach().cpu() for k, v in pipe.state_dict().items()}

    parts = PointToPointModel(stages, watchdog_s=timeout).run(rank_main, timeout=timeout)
    return {k: v for part in parts for k, v in part.items()}


def one_device_weights(device: str, width: int, steps: int) -> dict[str, torch.Tensor]:
    """The whole model on one device, a plain loop: the whole batch's mean loss, then an SGD step."""
    model = mlp(width).to(device)
    opt = sgd(model.parameters())
    for x, y in batches(steps, width):
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def max_relative_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    if got.keys() != want.keys():
        raise AssertionError(f"the pipeline's weights are named {sorted(got)}, one device's {sorted(want)}")
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)) for k in want)


def executor_section(device: str, quick: bool, timeout: float) -> list[dict]:
    """(b): every schedule's weights on ``device`` against one device (or, asynchronous, against the CPU's run)."""
    width, steps = (16, 2) if quick else (256, 4)
    out: list[dict[str, Any]] = []
    for schedule, stages, chunks, options in EXECUTOR_CASES:
        started = time.perf_counter()
        against = "the same pipeline on the CPU" if schedule in ASYNCHRONOUS else f"one {device} device, plain loop"
        try:
            got = pipeline_weights(schedule, stages, chunks, options, device, width, steps, timeout)
            if schedule in ASYNCHRONOUS:
                want = pipeline_weights(schedule, stages, chunks, options, "cpu", width, steps, timeout)
            else:
                want = one_device_weights(device, width, steps)
            diff = max_relative_difference(got, want)
        except Exception as err:  # noqa: BLE001  (recorded: the other schedules still run)
            out.append({"schedule": schedule, "stages": stages, "chunks": chunks, **options, "against": against,
                        "error": _words(err), "equal": False})
            print(f"(b) {schedule} x{stages}: FAILED {_words(err)}", flush=True)
            continue
        row = {"schedule": schedule, "stages": stages, "chunks": chunks, **options, "against": against,
               "max_relative_difference": diff, "equal": diff <= TOLERANCE,
               "seconds": round(time.perf_counter() - started, 2)}
        out.append(row)
        print(f"(b) {schedule:11s} x{stages} chunks {chunks}: max relative difference {diff:.2e} against {against}",
              flush=True)
    return out


def _words(err: BaseException) -> str:
    """An error as the JSON keeps it: its type, its words and where it was raised."""
    where = traceback.extract_tb(err.__traceback__)[-3:]
    return f"{type(err).__name__}: {err}"[:2000] + " | " + " <- ".join(f"{f.filename}:{f.lineno}" for f in where)


# ---------------------------------------------------------------------------------------------------------- (c)
def trainer_section(quick: bool, timeout: float) -> dict:
    """(c): with 2 or more GPUs, the Trainer on N GPUs per schedule against one GPU, and torch's pipelining."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        message = f"skipped: needs 2 or more GPUs, this machine has {count}"
        print(f"(c) {message}", flush=True)
        return {"skipped": message}
    from benchmarks.common.worker_process import run_worker

    spec_base = {"devices": count, "width": 256 if quick else 1024, "batches": 6 if quick else 20, "chunks": 4}
    out: dict[str, Any] = {"devices": count, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        # *_fp16: precision="16-mixed" (1f1b: every stage must skip an overflowing step with the others and keep one
        # loss scale, equal to one GPU's)
        for schedule in ("one_device", *SCHEDULES, "one_device_fp16", "1f1b_fp16"):
            spec: dict[str, Any] = {**spec_base, "schedule": schedule, "out": str(Path(tmp) / schedule),
                    "torch_pipelining": schedule == "1f1b"}
            try:
                proc = run_worker("benchmarks.memory.gpu_check", spec, Path(__file__).resolve().parents[2], timeout)
                if proc.returncode != 0:
                    raise RuntimeError(f"rc {proc.returncode}: {proc.stderr[-3000:]}")
                out["runs"][schedule] = json.loads((Path(spec["out"]) / "result.json").read_text())
                out["runs"][schedule]["weights"] = str(Path(spec["out"]) / "final.ckpt")
                scales = sorted(Path(spec["out"]).glob("scale_rank*.txt"))
                if scales:  # every rank's final loss scale
                    out["runs"][schedule]["loss_scales"] = [float(f.read_text()) for f in scales]
            except Exception as err:  # noqa: BLE001  (recorded: the other schedules still run)
                out["runs"][schedule] = {"error": _words(err)}
                print(f"(c) {schedule}: FAILED {_words(err)}", flush=True)
        references = {}
        for name in ("one_device", "one_device_fp16"):
            reference = out["runs"].get(name, {})
            references[name] = _checkpoint_weights(reference["weights"]) if "weights" in reference else None
        for schedule, run in out["runs"].items():
            weights = run.pop("weights", None)
            want = references["one_device_fp16" if schedule.endswith("_fp16") else "one_device"]
            if schedule.startswith("one_device") or schedule in ASYNCHRONOUS or want is None or weights is None:
                continue  # the asynchronous schedules are not one device's training: their rules are tested on CPU
            try:
                got = _checkpoint_weights(weights)
                run["max_relative_difference_vs_one_device"] = max_relative_difference(got, want)
                if schedule.endswith("_fp16"):
                    one = out["runs"]["one_device_fp16"].get("loss_scales", [None])
                    run["loss_scales_agree"] = len(set(run.get("loss_scales", [])) | set(one)) == 1
            except Exception as err:  # noqa: BLE001
                run["error"] = _words(err)
    for schedule, run in out["runs"].items():
        print(f"(c) {schedule:11s}: {run.get('steps_per_s', 0):8.2f} steps/s "
              f"{run.get('max_relative_difference_vs_one_device', '')} {run.get('torch_1f1b_steps_per_s', '')}",
              flush=True)
    return out


def _checkpoint_weights(path: str) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    return {k.removeprefix("layers."): v for k, v in state.items()}


def trainer_worker(spec: dict) -> None:
    """One Lightning run on ``spec["devices"]`` GPUs (``one_device``: one GPU, no strategy), timed; rank 0 writes
    result.json and the gathered final.ckpt; with ``torch_pipelining`` the same processes then time torch's
    Schedule1F1B on the same split."""
    import lightning as L

    from lightning_pipedream import PipeDreamStrategy

    width, n, chunks, schedule = spec["width"], spec["batches"], spec["chunks"], spec["schedule"]
    precision = "16-mixed" if schedule.endswith("_fp16") else "32-true"
    schedule = schedule.removesuffix("_fp16")

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = mlp(width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return sgd(self.parameters())

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    from torch.utils.data import DataLoader, TensorDataset

    data = batches(n, width, size=256)
    loader = DataLoader(TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])),
                        batch_size=256, shuffle=False)
    timer = Timer()
    if schedule == "one_device":
        devices, strategy = 1, "auto"
    else:
        options = {"virtual_stages": 2} if schedule == "interleaved" else {}
        devices = spec["devices"]
        strategy = PipeDreamStrategy(schedule=schedule, chunks=1 if schedule == "pipedream" else chunks, **options)
    trainer = L.Trainer(accelerator="gpu", devices=devices, strategy=strategy, max_epochs=1, logger=False,
                        precision=precision,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer], num_sanity_val_steps=0)
    trainer.fit(Model(), loader)
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(str(out / "final.ckpt"))
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        (out / f"scale_rank{trainer.global_rank}.txt").write_text(str(scaler.get_scale()))
    timed = timer.ends[1:]  # from the end of the first (warm-up) step
    result: dict[str, Any] = {"steps_per_s": (len(timed) - 1) / (timed[-1] - timed[0]) if len(timed) > 1 else None,
                              "loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}
    if spec.get("torch_pipelining"):
        result["torch_1f1b_steps_per_s"] = _torch_pipelining(trainer, width, data, chunks)
    if trainer.is_global_zero:
        (out / "result.json").write_text(json.dumps(result))


def _torch_pipelining(trainer: Any, width: int, data: list, chunks: int) -> float:
    """torch.distributed.pipelining's Schedule1F1B on the same model, evenly split, in the Trainer's processes."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from lightning_pipedream.plan.balance import even_balance, stage_slice

    device = torch.device("cuda", trainer.local_rank)
    torch.cuda.set_device(device)
    if not dist.is_initialized():  # the strategy's teardown may have ended its group: Lightning's env:// still holds
        dist.init_process_group("nccl", rank=trainer.global_rank, world_size=trainer.world_size)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = mlp(width)
    module = stage_slice(model, even_balance(len(model), world), rank).to(device)
    stage = PipelineStage(module, rank, world, device)
    schedule = Schedule1F1B(stage, n_microbatches=chunks, loss_fn=nn.functional.mse_loss)
    opt = sgd(module.parameters())
    ends = []
    for x, y in data:
        if rank == 0:
            schedule.step(x.to(device))
        elif rank == world - 1:
            schedule.step(target=y.to(device))
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        ends.append(time.perf_counter())
    dist.barrier()
    return (len(ends) - 2) / (ends[-1] - ends[1])


# ---------------------------------------------------------------------------------------------------------- main
def _print_table(doc: dict) -> None:
    failed = [r for r in doc["memory"] + doc["executor"] if "error" in r]
    for r in failed:
        print(f"FAILED {r['schedule']} rank {r.get('rank', '-')}: {r['error']}")
    rows = [r for r in doc["memory"] if "error" not in r]
    if rows:
        print(f"\n{'model':5s} {'schedule':11s} {'rc':2s} {'rank':4s} {'measured MiB':>12s} {'predicted MiB':>13s} "
              f"{'ratio':>6s}")
        for r in rows:
            print(f"{r['model']:5s} {r['schedule']:11s} {int(r['recompute']):2d} {r['rank']:4d} "
                  f"{r['measured']['peak_bytes'] / 2**20:12.2f} {r['predicted']['predicted_peak_bytes'] / 2**20:13.2f} "
                  f"{r['measured_over_predicted']:6.3f}")
        ratios = [r["measured_over_predicted"] for r in rows]
        print(f"measured / predicted: median {statistics.median(ratios):.3f}, {min(ratios):.3f} - {max(ratios):.3f}; "
              f"{sum(r['within_10_percent'] for r in rows)} of {len(rows)} within 10 %")
    if doc["executor"]:
        print(f"\n{'schedule':11s} {'stages':>6s} {'chunks':>6s} {'max rel diff':>12s}  against")
        for r in (r for r in doc["executor"] if "error" not in r):
            print(f"{r['schedule']:11s} {r['stages']:6d} {r['chunks']:6d} {r['max_relative_difference']:12.2e}  "
                  f"{r['against']}")
    print(f"\n(c) {doc['trainer'].get('skipped', 'see the JSON')}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/gpu_check_<device>.json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one model, no recompute (CI, ~15 s on CPU)")
    parser.add_argument("--sections", default="memory,executor,trainer", help="comma-separated: which to run")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per pipeline run before it fails")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        trainer_worker(json.loads(args.worker))
        return {}
    device = resolve_device(args.device)
    sections = set(args.sections.split(","))
    started = time.time()
    doc: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.memory.gpu_check", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "cuda_capability": list(torch.cuda.get_device_capability()) if device == "cuda" else None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "quick": args.quick,
        "memory": memory_section(device, args.quick, args.timeout) if "memory" in sections else [],
        "executor": executor_section(device, args.quick, args.timeout) if "executor" in sections else [],
        "trainer": trainer_section(args.quick, 600.0) if "trainer" in sections else {"skipped": "not asked"},
    }
    try:
        import lightning

        doc["lightning"] = lightning.__version__
    except ImportError:
        doc["lightning"] = None
    doc["seconds"] = round(time.time() - started, 1)
    out = args.json or Path(f"benchmarks/results/gpu_check_{device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    _print_table(doc)
    print(f"\n{out} written in {doc['seconds']} s")
    return doc


if __name__ == "__main__":
    main()
