"""Sequence-to-sequence tasks (translation, video captioning): teacher-forced cross-entropy and BLEU.

BLEU is computed from the argmax of the single teacher-forced pass that the pipeline runs (greedy
autoregressive decoding would need one pipeline pass per output word), per validation batch, then
averaged over batches like every other logged metric.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torchmetrics.functional.text import bleu_score

from recipes.data.vocab import Vocab
from recipes.tasks.base import RecipeTask


class Seq2SeqTask(RecipeTask):
    """Batches are (*inputs, target): the model gets the inputs as one tuple and predicts `target` (B, T)."""

    metric_name, metric_mode = "val_bleu", "max"

    def __init__(self, layers: nn.Sequential, optim: Mapping[str, Any], itos: Sequence[str]) -> None:
        super().__init__(layers, optim)
        self.vocab = Vocab(itos)

    @classmethod
    def from_data(cls, layers: nn.Sequential, optim: Mapping[str, Any], datamodule: Any) -> Seq2SeqTask:
        return cls(layers, optim, datamodule.vocab.itos)

    def _forward_loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        *inputs, target = batch
        logits = self(tuple(inputs))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=0)
        return logits, target, loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, _, loss = self._forward_loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits, target, loss = self._forward_loss(batch)
        self.log("val_loss", loss)
        self.log("val_bleu", self.bleu(logits.argmax(-1), target))
        return loss

    def bleu(self, predicted: torch.Tensor, target: torch.Tensor) -> float:
        """Corpus BLEU-4 of a batch; each prediction is cut at its target's length (what follows is padding)."""
        lengths = (target != 0).sum(dim=1).tolist()
        hyps = [" ".join(self.vocab.decode(p[:n].tolist())) for p, n in zip(predicted, lengths)]
        refs = [[" ".join(self.vocab.decode(t[:n].tolist()))] for t, n in zip(target, lengths)]
        return float(bleu_score(hyps, refs))
