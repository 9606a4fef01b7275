"""Which piece of a batch each micro-batch is, and how much its loss counts: one rule for Pipeline and the strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_pipedream.runtime.microbatch import batch_size, split


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
    """

    parts: tuple[Any, ...]
    sizes: tuple[int, ...]
    chunks: int
    shards: int = 1
    minibatch_updates: bool = False

    @classmethod
    def of(cls, batch: Any, chunks: int, shards: int = 1, minibatch_updates: bool = False) -> BatchShares:
        """Cut ``batch`` (any tensor tree) into ``shards`` x ``chunks`` pieces, shard-major."""
        if shards == 1:
            parts = split(batch, chunks) if chunks > 1 else [batch]
        else:
            parts = [part for shard in split(batch, shards) for part in split(shard, chunks)]
        return cls(tuple(parts), tuple(batch_size(p) for p in parts), chunks, shards, minibatch_updates)

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

    def share(self, microbatch: int) -> float:
        """Micro-batch ``microbatch``'s share of the batch's samples."""
        return self.size(microbatch) / self.total

    def weight(self, microbatch: int) -> float:
        """The factor of micro-batch ``microbatch``'s loss: its share of the batch, or 1 for a minibatch of its own."""
        if self.minibatch_updates or len(self.parts) == 1:
            return 1.0
        return self.share(microbatch)
