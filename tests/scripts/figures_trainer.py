"""Fits of the tiny classifier with a CSVLogger, for the tests of what a run tells its user (stage figures, traces):
`python figures_trainer.py OUT_DIR JSON_OPTIONS` or `--runs RUNS.json`.

Options: ``devices``, ``schedule``, ``chunks``, ``batches`` (per epoch), ``epochs``, ``every`` (log_every_n_steps),
``log_figures``, ``profiler`` ("pytorch": Trainer(profiler=...) writing under OUT_DIR), ``hidden`` (layers),
``slow_stage`` / ``slow_s`` (a layer that sleeps that long per forward on that stage), ``logger`` ("csv" or "broken":
a logger that raises on names ending in _ms), ``trace`` (a trace directory under OUT_DIR), ``trace_steps``,
``trace_memory`` (each stage's live tensor bytes over the traced steps),
``sleepy`` ({"layers", "per_sample_s", "slow_layer", "extra_s"}: instead of the tiny classifier, layers that sleep in
proportion to their batch, one of them slower from the train start on, and no balance=: the strategy profiles and plans;
rank 0 writes ``explanation.json``, the strategy's explanation of the fit). Each rank writes
``rank{r}.json``: its clock at the start of every training batch (callback), so a test can compare the step time the
strategy measured with one read independently.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, Logger
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from script_runs import main_runs, refuse_unused, trainer_args, write_json  # noqa: E402
from tiny import TinyClassifier, data  # noqa: E402

from lightning_pipedream import PipeDreamStrategy  # noqa: E402
from lightning_pipedream.testing.slow_layers import arm, sleepy_layers  # noqa: E402


class Sleep(nn.Module):
    """Passes its input on after sleeping ``seconds``: a stage slower than the others."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


class BatchClock(L.Callback):
    """This rank's clock at each training batch's start, written at the end of the fit."""

    def __init__(self, out: str) -> None:
        self.out, self.starts, self.bubbles = out, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())
        self.bubbles.append(trainer.progress_bar_metrics.get("bubble"))

    def on_train_start(self, trainer, pl_module):
        arm(pl_module)  # after the strategy profiled the layers: the slow layer is slower than the profile says

    def on_train_end(self, trainer, pl_module):
        # What the progress bar shows at the end (its own view of the metrics), where there is one; and the measured
        # bubble in it at each batch start (rank 0: the figures reach it while training, not only at the end)
        bar = trainer.progress_bar_callback
        shown = bar.get_metrics(trainer, pl_module) if bar is not None else None
        write_json(os.path.join(self.out, f"rank{trainer.global_rank}.json"), {"starts": self.starts,
                                                                                "progress_bar": shown,
                                                                                "bubbles": self.bubbles})


class BrokenLogger(Logger):
    """A logger that refuses every metric whose name ends in ``_ms`` (as a tracker's naming rules might)."""

    @property
    def name(self) -> str:
        return "broken"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        bad = [name for name in metrics if name.endswith("_ms")]
        if bad:
            raise ValueError(f"cannot take the name {bad[0]!r}")

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def train(out: str, options: dict[str, Any]) -> None:
    devices = options.pop("devices", 2)
    schedule = options.pop("schedule", "1f1b")
    chunks = options.pop("chunks", 2)
    batches = options.pop("batches", 12)
    epochs = options.pop("epochs", 2)
    every = options.pop("every", 3)
    hidden = options.pop("hidden", 2 * devices)
    slow_stage, slow_s = options.pop("slow_stage", None), options.pop("slow_s", 0.0)
    profiler = options.pop("profiler", None)
    logger_kind = options.pop("logger", "csv")
    trace = options.pop("trace", None)
    log_figures = options.pop("log_figures", True)
    trace_steps = options.pop("trace_steps", None)
    trace_memory = options.pop("trace_memory", False)
    sleepy = options.pop("sleepy", None)
    progress_bar = options.pop("progress_bar", False)
    refuse_unused(options)
    L.seed_everything(0)
    model = TinyClassifier(hidden=hidden, scheduler=False)
    layers = list(model.layers)
    per = len(layers) // devices
    balance: list[int] | None = [per] * (devices - 1) + [len(layers) - per * (devices - 1)]
    if sleepy is not None:  # the strategy profiles these layers and plans the split itself
        model.layers = sleepy_layers(sleepy["layers"], sleepy["per_sample_s"], sleepy["slow_layer"],
                                     sleepy["extra_s"])
        balance = None
    if slow_stage is not None and balance is not None:  # a sleeping layer at the start of that stage
        at = sum(balance[:slow_stage])
        layers.insert(at, Sleep(slow_s))
        balance[slow_stage] += 1
        model.layers = nn.Sequential(*layers)
    loggers: list[Logger] = [CSVLogger(out, name="csv", version=0)]
    if logger_kind == "broken":
        loggers.insert(0, BrokenLogger())
    if profiler == "pytorch":
        from lightning.pytorch.profilers import PyTorchProfiler

        profiler = PyTorchProfiler(dirpath=out, filename="prof", export_to_chrome=True,
                                   schedule=torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1))
    strategy = PipeDreamStrategy(schedule=schedule, chunks=chunks if schedule != "pipedream" else 1, balance=balance,
                                 log_figures=log_figures, trace_steps=trace_steps, trace_memory=trace_memory,
                                 trace=os.path.join(out, trace) if trace is not None else None)
    # Under the profiler, no validation: torch 2.14's Kineto crashed (SIGSEGV in prepare_trace) in most of 5 runs here
    # when Lightning's PyTorchProfiler stepped its schedule inside a validation step on this CPU-only machine.
    trainer = L.Trainer(**trainer_args(devices=devices, strategy=strategy, max_epochs=epochs, logger=loggers,
                                       log_every_n_steps=every, limit_val_batches=0 if profiler else 2,
                                       profiler=profiler, enable_progress_bar=progress_bar,
                                       callbacks=[BatchClock(out)]))
    loader = DataLoader(data(8 * batches), batch_size=8)
    trainer.fit(model, loader, DataLoader(data(16), batch_size=8))
    explanation = trainer.strategy.explanation  # set at the fit's end, after the callbacks' on_train_end
    if trainer.global_rank == 0 and explanation is not None:
        write_json(os.path.join(out, "explanation.json"), explanation.to_json())


if __name__ == "__main__":
    main_runs(train)
