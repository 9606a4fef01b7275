"""What a run reports: per-epoch lines, `results.json` in the Hydra run dir, and a multirun summary table."""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig

from recipes.tasks.base import RecipeTask

RESULT_KEYS = (
    "task",
    "model",
    "schedule",
    "stages",
    "chunks",
    "metric_name",
    "metric",
    "throughput_samples_per_s",
    "time_to_target_s",
    "error",  # null, or why the job failed (a sweep goes on past a failed job)
    "contender",  # the `contender=` config chosen (a reproduction sweep), or null
    "seed",
    "history",  # one entry per validation: epoch, step, metric, seconds (see ResultsCallback)
    "explanation",  # a planned pipeline: the plan's prediction against the measured steps (plan/explain.py), or null
)
NESTED_KEYS = ("history", "explanation")  # left out of a sweep's summary table
SUMMARY_COLUMNS = ("run", *(key for key in RESULT_KEYS if key not in NESTED_KEYS))


def _batch_size(batch: Any) -> int:
    while isinstance(batch, (list, tuple)):
        batch = batch[0]
    return int(batch.shape[0]) if isinstance(batch, torch.Tensor) else 1


def _data_parallel_readers(trainer: L.Trainer) -> int:
    """Processes that each read a different share of every batch (DDP: all of them; a pipeline: its data-parallel
    degree), so that throughput counts the samples of the whole update."""
    if not trainer._accelerator_connector.use_distributed_sampler:
        return 1
    return int((trainer.distributed_sampler_kwargs or {}).get("num_replicas", 1))


def _straight_pipeline(trainer: L.Trainer) -> bool:
    """One pipeline of one stage per process: what ``lightning_pipedream.generate`` decodes through."""
    from lightning_pipedream import PipeDreamStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, PipeDreamStrategy) or strategy._pipeline is None:
        return False
    placement = strategy._pipeline.placement
    straight = placement.num_pipelines == 1 and not placement.round_robin and strategy.options.virtual_stages == 1
    return straight and placement.num_stages == trainer.world_size > 1 and strategy._pipeline.graph is None


class ResultsCallback(L.Callback):
    """Measures training throughput (samples per second of training steps, validation excluded) and, after each
    validation, the task's quality metric of the whole model on the whole held-out set (`RecipeTask.held_out_metric`:
    rank 0 gathers the weights from every stage and evaluates them in one process, so every strategy is measured
    alike), and the time at which it first reached `target`.

    Times count from `start` and leave out that held-out evaluation (a measurement, not training): `history` has one
    entry per validation with the epoch, the optimizer steps, the metric, those seconds, and the seconds and samples
    of training steps so far."""

    def __init__(self, target: float | None, start: float, echo: Callable[[str], None] = print) -> None:
        self.target, self.start, self.echo = target, start, echo
        self.samples, self.steps, self.train_seconds = 0, 0, 0.0
        self.metric: float | None = None
        self.time_to_target: float | None = None
        self.history: list[dict[str, Any]] = []
        self.eval_seconds = 0.0
        self._step_start = 0.0
        self._model: torch.nn.Module | None = None
        self.samples_file: Path | None = None  # where rank 0 appends the language model's samples

    @property
    def throughput(self) -> float | None:
        return self.samples / self.train_seconds if self.train_seconds > 0 else None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # before the strategy splits the module: rank 0 keeps a whole copy to load the gathered weights into
        if trainer.is_global_zero and isinstance(pl_module, RecipeTask) and self._model is None:
            self._model = copy.deepcopy(pl_module.layers).cpu()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.train_seconds += time.perf_counter() - self._step_start
        self.samples += _batch_size(batch) * _data_parallel_readers(trainer)
        self.steps += 1

    def held_out_metric(self, trainer: L.Trainer, pl_module: RecipeTask) -> float | None:
        """Every rank: hand in its weights (a pipeline gathers its stages' shares on rank 0). Rank 0: evaluate.

        A task that decodes (translation, captioning) under a straight pipeline decodes through it instead: every
        rank runs its own stage around the decode ring and nothing is gathered."""
        if _straight_pipeline(trainer) and hasattr(pl_module, "pipelined_held_out_metric"):
            metric = pl_module.pipelined_held_out_metric(trainer.datamodule)
            return metric if trainer.is_global_zero else None
        state = trainer.strategy.lightning_module_state_dict()
        if not trainer.is_global_zero or self._model is None:
            return None
        prefix = "layers."
        self._model.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        self._model.eval()
        return pl_module.held_out_metric(self._model, trainer.datamodule)

    def held_out_samples(self, trainer: L.Trainer, pl_module: RecipeTask) -> tuple[list[tuple[str, str]], str] | None:
        """The language model's samples (`LanguageModelTask.held_out_samples`) and how they were decoded, on rank 0
        (None elsewhere).

        Under a straight pipeline every rank decodes its own stage around the decode ring (nothing gathered); under
        another PipeDreamStrategy layout rank 0 decodes its whole copy, which `held_out_metric` has just loaded with
        the gathered weights; otherwise (one device, DDP: rank 0 holds the whole model) rank 0 decodes the module."""
        from lightning_pipedream import PipeDreamStrategy

        if getattr(getattr(pl_module, "samples", None), "count", 0) == 0:
            return None
        if _straight_pipeline(trainer):
            samples = pl_module.held_out_samples(trainer.datamodule)  # type: ignore[attr-defined]
            how = f"through the pipeline's decode ring ({trainer.world_size} stages)"
            return (samples, how) if trainer.is_global_zero else None
        if isinstance(trainer.strategy, PipeDreamStrategy) and trainer.world_size > 1:
            whole, how = self._model, "on rank 0 with the gathered weights"
        else:
            whole, how = None, "on one device"
        if not trainer.is_global_zero:
            return None
        return pl_module.held_out_samples(trainer.datamodule, whole), how  # type: ignore[attr-defined]

    def report_samples(self, trainer: L.Trainer, samples: list[tuple[str, str]], how: str) -> None:
        """Rank 0: print the samples, append them to `samples_file` and give them to a logger that takes text."""
        head = f"samples after epoch {trainer.current_epoch} (step {trainer.global_step}), decoded {how}:"
        lines = [head] + [f"  {i}: {prompt!r} -> {continuation!r}" for i, (prompt, continuation) in enumerate(samples)]
        self.echo("\n".join(lines))
        if self.samples_file is not None:
            with self.samples_file.open("a", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
        experiment = getattr(trainer.logger, "experiment", None) if trainer.logger is not None else None
        if hasattr(experiment, "add_text"):  # TensorBoard
            experiment.add_text("samples", "\n\n".join(f"{p} **{c}**" for p, c in samples), trainer.global_step)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not isinstance(pl_module, RecipeTask):
            return
        began = time.perf_counter()
        metric = self.held_out_metric(trainer, pl_module)
        samples = self.held_out_samples(trainer, pl_module)
        self.eval_seconds += time.perf_counter() - began
        if samples is not None and samples[0]:
            self.report_samples(trainer, *samples)
        if metric is None or math.isnan(metric):
            return
        self.metric = metric
        elapsed = time.perf_counter() - self.start - self.eval_seconds
        if self.time_to_target is None and self.target is not None and pl_module.reached(metric, self.target):
            self.time_to_target = elapsed
        self.history.append({"epoch": trainer.current_epoch, "step": trainer.global_step, "metric": metric,
                             "seconds": elapsed, "train_seconds": self.train_seconds, "samples": self.samples})
        rate = f"{self.throughput:.1f}" if self.throughput else "n/a"
        self.echo(
            f"epoch {trainer.current_epoch:>3}  step {trainer.global_step:>5}  "
            f"{pl_module.metric_name}={metric:.4f}  throughput={rate} samples/s  elapsed={elapsed:.1f}s"
        )


class PlanPrinter(L.Callback):
    """When training starts, print on rank 0 which layers each pipeline stage runs (the strategy prints the
    plan's predicted times when it partitions; this adds the layer names, which only the full model knows)."""

    def __init__(self, layer_names: list[str]) -> None:
        self.layer_names = layer_names

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        balance = getattr(trainer.strategy, "balance", None)
        if not balance or not trainer.is_global_zero:
            return
        head = f"pipeline: {len(balance)} stages, layers per stage {list(balance)}"
        copies = getattr(trainer.strategy, "num_pipelines", 1)
        if copies > 1:  # data-parallel pipelines: each stage has that many replicas, whole or sharded
            shard = trainer.strategy.options.shard
            head += f"; {copies} data-parallel copies" + (f", each stage sharded ({shard})" if shard else "")
        lines, start = [head], 0
        for stage, count in enumerate(balance):
            names = self.layer_names[start : start + count]
            lines.append(f"  stage {stage}: layers {start}..{start + count - 1}: {', '.join(names)}")
            start += count
        print("\n".join(lines), flush=True)


def write_results(path: Path, results: dict[str, Any]) -> None:
    """Write results.json with exactly the documented keys (missing ones as null)."""
    path.write_text(json.dumps({key: results.get(key) for key in RESULT_KEYS}, indent=2) + "\n")


def summarize(sweep_dir: Path) -> str:
    """Collect the `results.json` of every run under `sweep_dir` (without their histories) into summary.json and a
    summary.md table."""
    rows = []
    for result in sorted(sweep_dir.glob("*/results.json"), key=lambda p: (len(p.parent.name), p.parent.name)):
        job = json.loads(result.read_text())
        rows.append({"run": result.parent.name, **{k: v for k, v in job.items() if k not in NESTED_KEYS}})
    (sweep_dir / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")

    def cell(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else ("" if value is None else str(value))

    lines = ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in SUMMARY_COLUMNS) + " |" for row in rows]
    table = "\n".join(lines) + "\n"
    (sweep_dir / "summary.md").write_text(table)
    return table


class MultirunSummary(HydraCallback):
    """Hydra callback: after a `-m` sweep, write summary.md / summary.json in the sweep dir and print the table."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        print(f"summary of {sweep_dir}:\n" + summarize(sweep_dir), flush=True)
        from recipes.reproduction import write_reproduction

        comparison = write_reproduction(sweep_dir)  # a sweep over contender=...: the curves and their table
        if comparison is not None:
            print(f"comparison (reproduction.md, .csv, .png in {sweep_dir}):\n{comparison}", flush=True)
        failed = failed_jobs(sweep_dir)
        if failed:
            lines = [f"  job {run}: {error}" for run, error in failed]
            print(f"{len(failed)} job(s) failed:\n" + "\n".join(lines), file=sys.stderr, flush=True)
            sys.exit(1)  # after every job ran: the sweep's exit status says some failed


def failed_jobs(sweep_dir: Path) -> list[tuple[str, str]]:
    """(job dir name, error) of every job of the sweep whose results.json records an error."""
    rows = json.loads((sweep_dir / "summary.json").read_text())
    return [(row["run"], row["error"]) for row in rows if row.get("error")]
