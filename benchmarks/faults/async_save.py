"""How long a save stalls the pipeline: ``checkpoint="sharded-async"`` against ``checkpoint="sharded"``, in one run.

Run from the repository root::

    python -m benchmarks.faults.async_save                    # results/async_save.json (~2 min on 2 quiet cores)
    python -m benchmarks.faults.async_save --quick --json /tmp/quick.json   # 8 MB per stage, 2 rounds (smoke run)

The model is one ``nn.Sequential`` of ``layers`` x ``Linear(width, width)`` (12 x 1024 x 1024 fp32 on 2 stages: 24
MB of weights and 48 MB of Adam's state per stage, 72 MB), trained under ``PipeDreamStrategy(schedule="1f1b",
chunks=4, checkpoint="sharded-async")`` on 2 CPU processes (gloo), one thread each. A callback saves with
``trainer.save_checkpoint`` from ``on_train_batch_end``, as ``ModelCheckpoint`` does, every ``gap`` steps,
alternating an asynchronous save and a synchronous one (``checkpoint="sharded"`` for that save; which comes first
alternates by round), after one warm-up pair that is not counted (the first asynchronous save makes its process group
and its staging memory). Per save and rank: ``stall_s``, the time the training loop spent inside the save (what it
waits for: the copy into memory, the step's bookkeeping and Lightning's collectives around a save; and for a
synchronous save, the writing; ``previous_done`` False when it first waited for the one before). Per step: its wall
time from one ``on_train_batch_end`` to the next, less the save inside it, labelled ``during_async`` when an
asynchronous save was being written while it ran, ``quiet`` when no save was (the steps right after a synchronous
save included). Figures: each kind's median over the rounds (and the rounds), ``async_stall_over_step`` (the median
asynchronous stall over the median quiet step), ``sync_over_async_stall`` (of the medians; ``_by_round``: each
round's pair), and steps per second during an
asynchronous save against quiet. The machine's load average before and after is in the JSON: the figures are
noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.figures import spread, write_result
from benchmarks.common.worker_process import run_worker

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 2


def _worker(spec: dict) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.common.wide_module import wide_module
    from lightning_pipedream import PipeDreamStrategy

    torch.set_num_threads(1)
    width, layers, out = spec["width"], spec["layers"], Path(spec["out"])
    gap, rounds = spec["gap"], spec["rounds"]

    def optimizer(params):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(params, lr=1e-5)

    class Saves(L.Callback):
        """Every ``gap`` steps a save (async and sync in turn, paired by round); each step's time and kind."""

        def __init__(self) -> None:
            self.saves: list[dict] = []
            self.steps: list[dict] = []
            self.last = time.perf_counter()
            self.in_flight = False

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            now = time.perf_counter()
            background = trainer.strategy.checkpoints.background
            writing = self.in_flight  # an asynchronous save was being written during (part of) this step
            self.in_flight = background.in_flight is not None and not background.in_flight.future.done()
            step = trainer.global_step
            self.steps.append({"step": step, "seconds": now - self.last,
                               "kind": "during_async" if writing or self.in_flight else "quiet"})
            if step % gap == 0 and step // gap <= 2 * (rounds + 1):
                index = step // gap - 1  # 0, 1: the warm-up pair; then round r's pair at 2 + 2r, 3 + 2r
                pair, second = divmod(index, 2)
                first_async = pair % 2 == 0
                kind = "async" if (second == 0) == first_async else "sync"
                trainer.strategy.checkpoints.mode = "sharded-async" if kind == "async" else "sharded"
                writing_before = background.in_flight is not None and not background.in_flight.future.done()
                start = time.perf_counter()
                trainer.save_checkpoint(out / f"save-{index}.ckpt")
                stall = time.perf_counter() - start
                trainer.strategy.checkpoints.mode = "sharded-async"
                self.in_flight = kind == "async"
                if index >= 2:  # previous_done: False if the save had to wait for the one before to finish
                    self.saves.append({"round": pair - 1, "kind": kind, "stall_s": stall, "step": step,
                                       "previous_done": not writing_before, **parts})
                parts.clear()
                if index >= 1:  # the one before goes (after the save in flight is complete, if any)
                    trainer.strategy.remove_checkpoint(out / f"save-{index - 1}.ckpt")
            self.last = time.perf_counter()

    parts = _time_parts()
    torch.manual_seed(0)  # every rank the same data
    batch = spec["batch"]
    data = TensorDataset(torch.randn(batch * 4, width), torch.randn(batch * 4, width))
    saves = Saves()
    strategy = PipeDreamStrategy(schedule="1f1b", chunks=4, checkpoint="sharded-async", keep_freed_memory=False)
    trainer = L.Trainer(accelerator="cpu", devices=PROCESSES, strategy=strategy, max_steps=gap * (2 * rounds + 3),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, callbacks=[saves])
    trainer.fit(wide_module(width, layers, optimizer), DataLoader(data, batch_size=batch))
    module, optimizer = strategy.lightning_module, trainer.optimizers[0]
    state = [*module.parameters(), *(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
    result = {"rank": trainer.global_rank, "saves": saves.saves, "steps": saves.steps[1:],  # the first: setup's too
              "stage_state_mb": sum(t.numel() * t.element_size() for t in state) / 2**20}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _time_parts() -> dict[str, float]:
    """Where a save's stall goes, filled in at each save: ``strategy_s`` (the strategy's save: paths, the optimizers'
    groups, ``meta.pt``, and the writing or its start), ``start_s`` (of which: starting the background save) and
    ``copy_s`` (of which: the copy into the staging memory); the rest of ``stall_s`` is Lightning's (its checkpoint
    dict, the drain, its barrier)."""
    from lightning_pipedream.strategy.checkpoints import async_save, sharded_checkpoint

    parts: dict[str, float] = {}

    def timed(owner: object, name: str, key: str) -> None:
        original = getattr(owner, name)

        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                parts[key] = parts.get(key, 0.0) + time.perf_counter() - start

        setattr(owner, name, call)

    timed(sharded_checkpoint.PipelineCheckpoints, "save", "strategy_s")
    timed(async_save.BackgroundSaves, "start", "start_s")
    from torch.distributed.checkpoint.staging import DefaultStager

    timed(DefaultStager, "stage", "copy_s")  # the strategy's stager is torch's, copying in the caller's thread
    return parts


def _summary(ranks: list[dict]) -> dict:
    """Medians over the rounds: each save kind's stall (the slower rank's, as the pipeline waits for it), the steps'
    seconds by kind (every rank's), and the ratios."""
    stalls: dict[str, list[float]] = {"async": [], "sync": []}
    by_round: dict[int, dict[str, float]] = {}
    for save in ranks[0]["saves"]:
        same = [next(s for s in r["saves"] if s["step"] == save["step"]) for r in ranks]
        stalls[save["kind"]].append(max(s["stall_s"] for s in same))
        by_round.setdefault(save["round"], {})[save["kind"]] = stalls[save["kind"]][-1]
    steps = {kind: [s["seconds"] for r in ranks for s in r["steps"] if s["kind"] == kind]
             for kind in ("quiet", "during_async")}
    step = statistics.median(steps["quiet"])
    during = statistics.median(steps["during_async"]) if steps["during_async"] else None
    asynchronous = [s for r in ranks for s in r["saves"] if s["kind"] == "async"]
    parts = {key: statistics.median(s.get(key, 0.0) for s in asynchronous)
             for key in ("strategy_s", "start_s", "copy_s")}
    return {
        "async_stall_s": spread(stalls["async"]), "sync_stall_s": spread(stalls["sync"]),
        "async_stall_parts_s": parts,
        "step_s_quiet": spread(steps["quiet"]),
        "step_s_during_async": spread(steps["during_async"]) if during is not None else None,
        "async_stall_over_step": statistics.median(stalls["async"]) / step,
        "sync_over_async_stall": statistics.median(stalls["sync"]) / statistics.median(stalls["async"]),
        "sync_over_async_stall_by_round": spread([r["sync"] / r["async"] for r in by_round.values()]),
        "steps_per_s_quiet": 1 / step,
        "steps_per_s_during_async": 1 / during if during else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="8 MB per stage, 2 rounds (smoke run)")
    parser.add_argument("--rounds", type=int, default=5, help="pairs of saves counted (after one warm-up pair)")
    parser.add_argument("--json", type=Path, help="default: benchmarks/results/async_save.json")
    parser.add_argument("--timeout", type=float, default=1200.0)
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    width, layers, batch, gap, rounds = (512, 4, 64, 4, 2) if args.quick else (1024, 12, 256, 6, args.rounds)
    json_path = args.json or ROOT / "benchmarks" / "results" / "async_save.json"
    result: dict = {"model": f"{layers} x Linear({width}, {width}), fp32, Adam; batch {batch}",
                    "layout": f"{PROCESSES} stages, 1f1b, chunks 4, gloo on CPU, one thread per process",
                    "saves": f"every {gap} steps, async and sync in turn, {rounds} rounds after a warm-up pair",
                    "when": time.strftime("%Y-%m-%d %H:%M"), "load_before": os.getloadavg(),
                    "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"width": width, "layers": layers, "batch": batch, "gap": gap, "rounds": rounds, "out": tmp}
        proc = run_worker("benchmarks.faults.async_save", spec, ROOT, args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the training failed:\n{proc.stderr[-3000:]}")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(PROCESSES)]
    result["stage_state_mb"] = [r["stage_state_mb"] for r in ranks]
    result.update(_summary(ranks))
    result["ranks"] = ranks
    print(f"state per stage {', '.join(f'{mb:.0f}' for mb in result['stage_state_mb'])} MB; median stall: async "
          f"{result['async_stall_s']['median'] * 1e3:.0f} ms, sync {result['sync_stall_s']['median'] * 1e3:.0f} ms "
          f"({result['sync_over_async_stall']:.1f}x); a quiet step {result['step_s_quiet']['median'] * 1e3:.0f} ms "
          f"(async stall {result['async_stall_over_step']:.1%} of it); steps/s quiet {result['steps_per_s_quiet']:.2f},"
          f" during an async save {result['steps_per_s_during_async'] or float('nan'):.2f}; load "
          f"{result['load_before'][0]:.1f}")
    write_result(json_path, result)


if __name__ == "__main__":
    sys.exit(main())
