"""Which piece of a batch each micro-batch is, and how much its loss counts: one rule for Pipeline and the strategy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipedream.runtime.communication.microbatch import batch_size, flatten, split

IGNORE_INDEX = -100  # the label torch's cross_entropy (and Hugging Face's models) leave out of a token mean


@dataclass(frozen=True)
class BatchShares:
    """A training batch cut into the schedule's micro-batches.

    Without replicated stages the batch is split into ``chunks`` micro-batches. With a replicated input
    stage (PipeDream's 1F1B-RR, ``shards`` = its replicas) the batch is first split into one shard per replica
    and each shard into ``chunks`` (shard-major); the schedule's micro-batch m comes from shard ``m % shards``
    (``Layout.shard_of``) and is chunk ``m // shards`` of it. The asynchronous schedules number micro-batches
    on across steps: m is taken modulo the step's count first.

    How much a micro-batch's loss counts: its share of the batch (``size / total``), so that the summed
    gradient of a mean-reduced loss is the whole batch's; under ``minibatch_updates`` (PipeDream with replicated
    stages) each shard is a minibatch of its own and counts fully (its replicas average their gradients).
    A loss that is a mean over something else (the labelled tokens of a padded language-model batch) gives
    ``mean_over``, which counts those in a piece of the batch: a micro-batch's share is then its count over
    the whole batch's, which makes the summed gradient the whole batch's mean over them, exactly.

    ``fewer_if_small``: a batch with fewer samples than ``chunks`` (an epoch's last) becomes one micro-batch
    per sample, rather than an error; the schedule must then run ``len(parts)`` micro-batches.
    """

    parts: tuple[Any, ...]
    sizes: tuple[int, ...]
    chunks: int
    shards: int = 1
    minibatch_updates: bool = False
    counts: tuple[float, ...] | None = None  # mean_over of each part, when the loss is a mean over those

    @classmethod
    def of(cls, batch: Any, chunks: int, shards: int = 1, minibatch_updates: bool = False, *,
           fewer_if_small: bool = False, mean_over: Callable[[Any], Any] | None = None) -> BatchShares:
        """Cut ``batch`` (any tensor tree) into ``shards`` x ``chunks`` pieces, shard-major."""
        if shards == 1:
            if fewer_if_small:
                chunks = min(chunks, batch_size(batch))
            parts = split(batch, chunks) if chunks > 1 else [batch]
        else:
            parts = [part for shard in split(batch, shards) for part in split(shard, chunks)]
        counts = None if mean_over is None else tuple(_count(mean_over, part) for part in parts)
        return cls(tuple(parts), tuple(batch_size(p) for p in parts), chunks, shards, minibatch_updates, counts)

    @property
    def total(self) -> int:
        """Samples in the whole batch."""
        return sum(self.sizes)

    def piece(self, microbatch: int) -> int:
        """The index in :attr:`parts` of the schedule's micro-batch ``microbatch``."""
        m = microbatch % len(self.parts)
        return (m % self.shards) * self.chunks + m // self.shards

    def part(self, microbatch: int) -> Any:
        """The piece of the batch that micro-batch ``microbatch`` computes on."""
        return self.parts[self.piece(microbatch)]

    def size(self, microbatch: int) -> int:
        """Samples in micro-batch ``microbatch``."""
        return self.sizes[self.piece(microbatch)]

    def log_weight(self, microbatch: int) -> float:
        """How much micro-batch ``microbatch``'s logged values count in the batch's: its samples, or its
        ``mean_over`` count when given (then a logged token-mean loss combines into the batch's exactly)."""
        return self.counts[self.piece(microbatch)] if self.counts is not None else float(self.size(microbatch))

    def share(self, microbatch: int) -> float:
        """Micro-batch ``microbatch``'s share of the batch's samples (of its ``mean_over`` count, when given)."""
        if self.counts is not None:
            total = sum(self.counts)
            return self.counts[self.piece(microbatch)] / total if total else 0.0
        return self.size(microbatch) / self.total

    def unequal_labelled_tokens(self) -> tuple[int, ...] | None:
        """When the batch's labels leave out padding (IGNORE_INDEX) unevenly, so that a mean over each micro-batch's
        labelled tokens is not the batch's: each micro-batch's count of labelled tokens; else None."""
        if self.counts is not None or len(self.parts) == 1:
            return None
        counts = []
        for part in self.parts:
            labels = [t for t in flatten(part, "batch")[0] if not t.is_floating_point() and not t.is_complex()
                      and t.dim() > 1 and bool((t == IGNORE_INDEX).any())]
            if not labels:
                return None
            counts.append(int((labels[-1] != IGNORE_INDEX).sum()))
        per_sample = {count / size for count, size in zip(counts, self.sizes)}
        return tuple(counts) if len(per_sample) > 1 else None

    def weight(self, microbatch: int) -> float:
        """The factor of micro-batch ``microbatch``'s loss: its share of the batch, or 1 for a minibatch of its own."""
        if self.minibatch_updates or len(self.parts) == 1:
            return 1.0
        return self.share(microbatch)


def labelled_tokens(labels: torch.Tensor, shifted: bool = False) -> int:
    """What a token-mean loss over ``labels`` averages over: its labels that are not IGNORE_INDEX. ``shifted``: those
    of ``labels[..., 1:]``, for a causal language model's loss, which predicts each token from the ones before it (a
    row's first label is never a target), as Hugging Face's Trainer counts ``num_items_in_batch``."""
    return int(((labels[..., 1:] if shifted else labels) != IGNORE_INDEX).sum())


def _count(mean_over: Callable[[Any], Any], part: Any) -> float:
    value = mean_over(part)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"mean_over must return a number (what the loss averages over in a piece of the batch, "
                             f"such as its labelled tokens), got a tensor of shape {tuple(value.shape)}.")
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"mean_over must return a number >= 0 (what the loss averages over in a piece of the "
                         f"batch, such as its labelled tokens), got {value!r}.")
    return float(value)
