"""The LightningModule shape the pipeline strategy expects: one `nn.Sequential` in `self.layers`, and
steps that call `self(x)` exactly once and reduce to a mean loss."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from torch import nn

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


class RecipeTask(L.LightningModule):
    """Base of the four tasks. Subclasses name their quality metric and how to read it from logged values."""

    metric_name: str = "val_loss"
    metric_mode: str = "min"  # "max": higher is better

    def __init__(self, layers: nn.Sequential, optim: Mapping[str, Any]) -> None:
        super().__init__()
        self.layers = layers
        self.optim = dict(optim)

    @classmethod
    def from_data(cls, layers: nn.Sequential, optim: Mapping[str, Any], datamodule: Any) -> RecipeTask:
        """Build the task for `layers`; subclasses take what they need from the data (e.g. the vocabulary)."""
        return cls(layers, optim)

    def forward(self, x: Any) -> Any:
        return self.layers(x)

    def metric_from(self, logged: Mapping[str, Any]) -> float | None:
        """This task's quality metric from the epoch's logged values (None if it was not logged)."""
        value = logged.get(self.metric_name)
        return None if value is None else float(value)

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.metric_mode == "max" else value <= target

    def configure_optimizers(self) -> Any:
        cfg = dict(self.optim)
        name = cfg.pop("name", "sgd")
        if name not in OPTIMIZERS:
            raise ValueError(f"optim.name={name!r} is not supported; choose one of: {', '.join(OPTIMIZERS)}")
        policy = cfg.pop("lr_policy", "constant")
        power = float(cfg.pop("lr_power", 1.0))
        optimizer = OPTIMIZERS[name](self.parameters(), **cfg)
        if policy == "constant":
            return optimizer
        if policy != "polynomial":
            raise ValueError(f"optim.lr_policy={policy!r} is not supported; choose constant or polynomial")
        total = max(1, int(self.trainer.estimated_stepping_batches))
        # PipeDream's 'polynomial' policy: lr * (1 - step / total) ** power
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / total) ** power)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class ClassificationTask(RecipeTask):
    """Image classification: cross-entropy, validation accuracy."""

    metric_name, metric_mode = "val_acc", "max"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("val_loss", loss)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())
        return loss


class LanguageModelTask(RecipeTask):
    """Next-token prediction; the metric is perplexity, exp of the mean validation cross-entropy."""

    metric_name, metric_mode = "perplexity", "min"

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss)
        return loss

    def metric_from(self, logged: Mapping[str, Any]) -> float | None:
        value = logged.get("val_loss")
        return None if value is None else math.exp(min(float(value), 50.0))
