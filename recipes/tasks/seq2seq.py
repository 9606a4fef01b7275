"""Sequence-to-sequence tasks (translation, video captioning): teacher-forced cross-entropy, greedy-decoded BLEU.

The task's metric `val_bleu` is corpus BLEU-4 of greedy decoding over the whole held-out set: under
PipeDreamStrategy through the pipeline's decode ring, every rank running its own stage and keeping its LSTMs' states
per lane (`pipelined_held_out_metric`, `lightning_pipedream.generate`), otherwise on rank 0 with the gathered weights,
one forward pass of the whole model per generated word (`held_out_metric`). The pipelined
validation step logs `val_bleu_teacher_forced`, the BLEU of the argmax of its one teacher-forced pass, per batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torchmetrics.functional.text import bleu_score

from recipes.data.vocab import BOS, EOS, PAD, Vocab
from recipes.tasks.base import RecipeTask


class Seq2SeqTask(RecipeTask):
    """Batches are (*inputs, target): the model gets the inputs as one tuple and predicts `target` (B, T)."""

    metric_name, metric_mode = "val_bleu", "max"

    def __init__(self, layers: nn.Sequential, optim: Mapping[str, Any], itos: Sequence[str]) -> None:
        super().__init__(layers, optim)
        self.vocab = Vocab(itos)

    @classmethod
    def from_data(cls, layers: nn.Sequential, optim: Mapping[str, Any], datamodule: Any,
                  **options: Any) -> Seq2SeqTask:
        if options:
            raise ValueError(f"task options {sorted(options)} are not known to {cls.__name__}; remove them from "
                             "the task config")
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
        self.log("val_bleu_teacher_forced", self.bleu(logits.argmax(-1), target))
        return loss

    @torch.no_grad()
    def held_out_metric(self, layers: nn.Sequential, datamodule: Any) -> float:
        """Corpus BLEU-4 of greedy decoding over every held-out sample (each against its own reference), by one
        process holding the whole model (``layers``)."""

        def decode(sources: tuple[torch.Tensor, ...], max_len: int) -> torch.Tensor:
            return greedy_decode(layers, sources, self.vocab.stoi[BOS], self.vocab.stoi[EOS], max_len=max_len,
                                 pad=self.vocab.stoi[PAD])

        return self._corpus_bleu(decode, datamodule)

    @torch.no_grad()
    def pipelined_held_out_metric(self, datamodule: Any, micro_batches: int | None = None) -> float:
        """The same BLEU, decoded by ``lightning_pipedream.generate``: under PipeDreamStrategy every rank calls it and
        runs only its own stage's layers around the decode ring (no weights gathered; each stage keeps its own LSTMs'
        states per lane, so a step feeds one word where ``greedy_decode`` recomputes the prefix); on one device it
        decodes there. The same tokens as ``held_out_metric``."""
        from lightning_pipedream import generate

        bos, eos, pad = self.vocab.stoi[BOS], self.vocab.stoi[EOS], self.vocab.stoi[PAD]
        was_training = self.training
        self.eval()

        def decode(sources: tuple[torch.Tensor, ...], max_len: int) -> torch.Tensor:
            prompt = torch.full((sources[0].size(0), 1), bos, dtype=torch.long)
            ids = generate(self, prompt, max_new_tokens=max_len, eos_token_id=eos, pad_token_id=pad,
                           micro_batches=micro_batches and min(micro_batches, prompt.size(0)),
                           forward=lambda rows, words: self.layers((*(s[rows] for s in sources), words)))
            return ids[:, 1:]

        try:
            return self._corpus_bleu(decode, datamodule)
        finally:
            self.train(was_training)

    def _corpus_bleu(self, decode: Any, datamodule: Any) -> float:
        hyps: list[str] = []
        refs: list[list[str]] = []
        for *sources, _teacher_forced_input, target in datamodule.val_dataloader():
            decoded = decode(tuple(sources), target.size(1) + 10)
            hyps += [" ".join(self.vocab.decode(row.tolist())) for row in decoded]
            refs += [[" ".join(self.vocab.decode(row.tolist()))] for row in target]
        self.last_hypotheses = hyps  # what was decoded, for a comparison of two ways to decode
        return float(bleu_score(hyps, refs))

    def bleu(self, predicted: torch.Tensor, target: torch.Tensor) -> float:
        """Corpus BLEU-4 of a batch; each prediction is cut at its target's length (what follows is padding)."""
        lengths = (target != 0).sum(dim=1).tolist()
        hyps = [" ".join(self.vocab.decode(p[:n].tolist())) for p, n in zip(predicted, lengths)]
        refs = [[" ".join(self.vocab.decode(t[:n].tolist()))] for t, n in zip(target, lengths)]
        return float(bleu_score(hyps, refs))


def greedy_decode(layers: nn.Module, inputs: tuple[torch.Tensor, ...], bos: int, eos: int, max_len: int,
                  pad: int = 0) -> torch.Tensor:
    """Greedy decoding with a model trained by teacher forcing: `layers((*inputs, prefix))` returns logits (B, T, V)
    for every prefix position; each step feeds the words chosen so far and appends the argmax of the last position.
    The models are causal in the target (LSTM decoders), so this equals step-by-step decoding; it recomputes the
    prefix each step (one forward pass per generated word). Returns (B, <= max_len) ids; rows end with EOS, then
    padding."""
    batch = inputs[0].size(0)
    words = torch.full((batch, 1), bos, dtype=torch.long)
    finished = torch.zeros(batch, dtype=torch.bool)
    for _ in range(max_len):
        next_word = layers((*inputs, words))[:, -1].argmax(-1)
        next_word = next_word.masked_fill(finished, pad)
        words = torch.cat([words, next_word[:, None]], dim=1)
        finished |= next_word == eos
        if bool(finished.all()):
            break
    return words[:, 1:]
