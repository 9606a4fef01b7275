"""A 2-process Trainer whose rank STOP_RANK stops itself (SIGSTOP) at batch STOP_AT: `python hang_trainer.py OUT STOP_RANK STOP_AT`."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from datetime import timedelta

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipedream  # noqa: F401  (registers the strategy names)
from lightning_pipedream import PipeDreamStrategy


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StopAt(L.Callback):
    """Stops this process (as a debugger or a frozen machine would) at the start of batch ``at`` on rank ``rank``."""

    def __init__(self, rank: int, at: int) -> None:
        self.rank, self.at = rank, at

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.at:
            time.sleep(1.5)  # its heartbeat (one a second) reports the last action first
            os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    out, stop_rank, stop_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    faulthandler.register(signal.SIGUSR1)  # the test dumps every thread's stack with it before killing a hang
    os.environ.setdefault("LIGHTNING_PIPEDREAM_FLIGHT_RECORDER", os.path.join(out, "flight"))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, generator=g)
    data = DataLoader(TensorDataset(x, x[:, :4].argmax(-1)), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=12, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[StopAt(stop_rank, stop_at)],
        strategy=PipeDreamStrategy(schedule="1f1b", chunks=2, timeout=timedelta(seconds=10)),
    )
    trainer.fit(Model(), data)


if __name__ == "__main__":
    main()
