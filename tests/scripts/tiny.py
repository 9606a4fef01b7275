"""A tiny LightningModule trained by the strategy tests in a subprocess: `python tiny.py OUT_DIR JSON_OPTIONS`."""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipedream  # noqa: F401  (registers the strategy names)
from lightning_pipedream import PipeDreamStrategy


class TinyClassifier(L.LightningModule):
    def __init__(self, width: int = 16, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.layers = nn.Sequential(
            nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4)
        )
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", self.val_acc)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": sched}


def data(n: int = 60):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].argmax(-1)).long()
    return TensorDataset(x, y)


def main() -> None:
    out, options = sys.argv[1], json.loads(sys.argv[2])
    L.seed_everything(0, verbose=False)
    model = TinyClassifier()
    strategy = options.pop("strategy", None)
    if isinstance(strategy, dict):
        strategy = PipeDreamStrategy(**strategy)
    trainer_args = dict(
        accelerator="cpu", devices=options.pop("devices", 1), max_steps=options.pop("max_steps", 3),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=options.pop("limit_val_batches", 0), num_sanity_val_steps=0,
        # Lightning shuffles training data under multi-process strategies; compare like with like.
        use_distributed_sampler=False,
    )
    if strategy is not None:
        trainer_args["strategy"] = strategy
    trainer_args.update(options.pop("trainer", {}))
    trainer = L.Trainer(**trainer_args)
    train = DataLoader(data(), batch_size=options.pop("batch_size", 12), shuffle=False)
    val = DataLoader(data(24), batch_size=12)
    trainer.fit(model, train, val, ckpt_path=options.pop("resume", None))
    trainer.save_checkpoint(os.path.join(out, "final.ckpt"))
    if trainer.is_global_zero:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump(metrics, f)


if __name__ == "__main__":
    main()
