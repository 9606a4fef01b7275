"""Models that are not one nn.Sequential, trained by a Trainer: `python graph_trainer.py OUT_DIR JSON_OPTIONS`.

The LightningModule wraps one of the graph test families (tests/scripts/graph_models.py): an
nn.Transformer LM with two inputs, a ResNet, a GPT with tied embeddings, an LSTM LM with a tied decoder.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))  # the libraries the tests share
from graph_models import batches, loss_fn, make  # noqa: E402
from script_runs import main_runs  # noqa: E402

from lightning_pipedream import PipeDreamStrategy


class FamilyModule(L.LightningModule):
    def __init__(self, family: str, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model, _ = make(family)  # seeded: every process builds the same weights

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(*args)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        args, targets = batch
        loss = loss_fn(self(*args), targets)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        args, targets = batch
        self.log("val_loss", loss_fn(self(*args), targets))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class DataDependent(FamilyModule):
    """A forward whose Python control flow depends on the data: no graph can stand for it."""

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if args[0].float().mean() > 1000:  # a branch on a value
            return self.model(args[0].flip(1))
        return self.model(*args)


class Batches:
    """A fixed list of batches (a plain iterable: Lightning leaves it as it is)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


def train(out: str, options: dict[str, Any]) -> None:
    """One training run written to ``out``: final.ckpt, and metrics.json on rank 0."""
    os.makedirs(out, exist_ok=True)
    family = options.pop("family")
    torch.set_num_threads(1)  # the same kernels' reduction order in every run, whatever the process count
    module_class = DataDependent if options.pop("untraceable", False) else FamilyModule
    model = module_class(family, **options.pop("model", {}))
    trainer_args: dict[str, Any] = dict(
        accelerator="cpu", devices=options.pop("devices", 1), max_steps=options.pop("steps", 3), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=options.pop("limit_val_batches", 0),
    )
    strategy = options.pop("strategy", None)
    if strategy is not None:
        trainer_args["strategy"] = PipeDreamStrategy(**strategy)
    trainer = L.Trainer(**trainer_args)
    size = options.pop("batch_size", 4)
    trainer.fit(model, Batches(batches(family, 3, size)), Batches(batches(family, 1, size)))
    trainer.save_checkpoint(os.path.join(out, "final.ckpt"))
    if trainer.is_global_zero:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump(metrics, f)
    if options:
        raise SystemExit(f"unused options: {options}")


if __name__ == "__main__":
    main_runs(train)
