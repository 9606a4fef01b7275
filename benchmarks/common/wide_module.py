"""A stack of square ``Linear`` layers as a LightningModule built per stage (``configure_model``): the checkpoint
benchmarks' model, whose state size is set by ``width`` and ``layers`` alone."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import lightning as L
import torch
from torch import nn


def wide_module(width: int, layers: int,
                optimizer: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]) -> L.LightningModule:
    """``layers`` x ``Linear(width, width)`` trained on the MSE of ``(x, y)`` batches, with ``optimizer``."""

    class Wide(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers: nn.Sequential | None = None

        def configure_model(self) -> None:  # each rank materializes only its stage
            if self.layers is None:
                self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert self.layers is not None
            return self.layers(x)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer(self.parameters())

    return Wide()
