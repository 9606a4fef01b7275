"""The check that every stage of a pipeline reads the same data: a fingerprint of each batch (its shapes and a few
sampled values) and the epoch's batch count, compared across the pipeline's ranks, with advice that fits the cause."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipedream.runtime.communication.microbatch import flatten
from lightning_pipedream.runtime.faults.failures import pipeline_failures

# Steps between two checks of the data; an epoch's first batch is always checked, an iterable dataset's every batch.
CHECK_EVERY = 1  # gpipe, 1f1b, zb-h1, interleaved: the fingerprints ride with the step summary's collective, free
# pipedream, 2bw: the fingerprints are messages of their own to the last stage (an A/B of benchmarks/speed/lightning.py
# on 2 CPU ranks could not tell every 8 steps from none; every step looked to add gloo loop-thread CPU there)
CHECK_EVERY_ASYNC = 8
RECORD_SLOTS = 32  # float64 numbers per fingerprint
_LEAVES = 4  # the batch's first leaves are fingerprinted
_SAMPLES = 4  # values sampled from each, evenly spaced
_HEAD = 8  # [rank, stage, epoch, batch index, batches in the epoch (-1: unknown), last of the epoch, samples, leaves]
_NAN = -1.2345e300  # a NaN in the data compares equal to itself


class DataMismatchError(RuntimeError):
    """The stages of a pipeline read different data (or a different number of batches)."""


def batch_record(batch: Any, rank: int, stage: int, epoch: int, index: int, batches: float, last: bool) -> Tensor:
    """The fingerprint of a training batch: where it is in the epoch, and each of its first leaves' shape and a few
    of its values (sampled on the batch's device: no copy of the batch to the host)."""
    leaves, _ = flatten(batch, "batch")
    device = leaves[0].device if leaves else torch.device("cpu")
    numbers = [rank, stage, epoch, index, batches if math.isfinite(batches) else -1.0, float(last),
               float(leaves[0].shape[0] if leaves and leaves[0].dim() else 0), float(len(leaves))]
    samples = []
    for t in leaves[:_LEAVES]:
        flat = (torch.view_as_real(t) if t.is_complex() else t).detach().reshape(-1)
        numbers += [t.dim(), _shape_hash(t.shape)]
        if flat.numel():
            positions = torch.linspace(0, flat.numel() - 1, _SAMPLES, device=flat.device).long()
            samples.append(torch.nan_to_num(flat[positions].to(device, torch.float64), nan=_NAN))
        else:
            samples.append(torch.zeros(_SAMPLES, dtype=torch.float64, device=device))
    # [head, shapes of the leaves..., zeros, samples of the leaves...]: built where the batch is (no wait for it)
    head = torch.tensor(numbers, dtype=torch.float64)
    padding = torch.zeros(RECORD_SLOTS - head.numel() - _SAMPLES * len(samples), dtype=torch.float64)
    return torch.cat([torch.cat([head, padding]).to(device, non_blocking=True), *samples])


def _shape_hash(shape: Sequence[int]) -> float:
    """A shape as one number, exact in a float64 (different shapes with equal element counts differ)."""
    value = len(shape)
    for size in shape:
        value = (value * 1_000_003 + int(size)) % (1 << 52)
    return float(value)


def is_due(index: int, batches: float, every: int = CHECK_EVERY) -> bool:
    """Whether the step of batch ``index`` checks the data: every ``every`` batches from the epoch's first, and every
    batch when the epoch's length is unknown (an iterable dataset: its end must be seen at the step it comes)."""
    return every <= 1 or not math.isfinite(batches) or index % every == 0


def check_records(rows: Sequence[Tensor]) -> None:
    """Raise :class:`DataMismatchError` on every rank that calls it if the ranks' fingerprints ``rows`` disagree."""
    rows = [row.cpu() for row in rows]
    first = rows[0]
    for other in rows[1:]:
        if not torch.equal(first[2:], other[2:]):
            raise DataMismatchError(mismatch_words(first, other))


def mismatch_words(a: Tensor, b: Tensor) -> str:
    """What two ranks' fingerprints say about how their data differ, and what to do about it."""
    rank_a, stage_a, epoch_a, index_a, batches_a, last_a, size_a = (float(v) for v in a[:7])
    rank_b, stage_b, epoch_b, index_b, batches_b, last_b, size_b = (float(v) for v in b[:7])
    who_a, who_b = f"rank {rank_a:.0f} (stage {stage_a:.0f})", f"rank {rank_b:.0f} (stage {stage_b:.0f})"
    same = ("Every stage of a pipeline must read the same batches in the same order (stage 0 reads the inputs, the "
            "last stage the targets): give every rank the same dataset, sampler and batch size.")
    if batches_a != batches_b:
        counts = [f"{who} has {_count(n)}" for who, n in ((who_a, batches_a), (who_b, batches_b))]
        return (f"The pipeline's ranks have unequal numbers of training batches per epoch: {counts[0]}, {counts[1]} "
                f"(epoch {epoch_a:.0f}). {same} With use_distributed_sampler=False, shard by pipelines, not ranks.")
    if (epoch_a, index_a) != (epoch_b, index_b) or last_a != last_b:
        ended, going = (who_a, who_b) if last_a > last_b else (who_b, who_a)
        if (epoch_a, index_a) != (epoch_b, index_b):
            where = (f"{who_a} is at batch {index_a:.0f} of epoch {epoch_a:.0f} while {who_b} is at batch "
                     f"{index_b:.0f} of epoch {epoch_b:.0f}")
        else:
            where = f"{ended}'s data ended at batch {index_a:.0f} of epoch {epoch_a:.0f} while {going}'s goes on"
        return (f"The pipeline's ranks have unequal numbers of training batches in epoch {min(epoch_a, epoch_b):.0f}: "
                f"{where}. {same} An iterable dataset must yield as many batches on every rank of a pipeline.")
    at = f"batch {index_a:.0f} of epoch {epoch_a:.0f}"
    if size_a != size_b or not torch.equal(_shapes(a), _shapes(b)):
        return (f"The pipeline stages received batches of different shapes at {at}: {who_a} {size_a:.0f} samples, "
                f"{who_b} {size_b:.0f}. {same}")
    text = f"The pipeline stages received different training batches at {at}: {who_a} and {who_b} disagree. "
    if index_a == 0 and epoch_a == 0:
        return text + (f"{same} Keep Lightning's default sampler, or with use_distributed_sampler=False seed every "
                       "rank's shuffling identically.")
    if index_a == 0:
        return text + ("The earlier epochs matched, this one's order does not: a shuffling sampler without a generator "
                       "of its own draws each epoch's order from the global random state, which the stages consume "
                       "differently (dropout or random augmentation on one stage). Give the sampler a generator of its "
                       "own: DataLoader(..., shuffle=True, generator=torch.Generator().manual_seed(0)).")
    return text + ("The epoch began with the same batches, so they drifted apart: randomness in the data (a random "
                   "crop, masking or sampling in the dataset or collate_fn, a sampler drawing from the global random "
                   "state) is drawn from each process's random state, which the stages consume differently (dropout on "
                   "one stage). Draw it from a torch.Generator of its own, seeded alike on every rank (e.g. from the "
                   "sample's index and the epoch).")


def _count(n: float) -> str:
    return "an unknown number (an iterable dataset)" if n < 0 else f"{n:.0f}"


def _shapes(row: Tensor) -> Tensor:
    return row[_HEAD: _HEAD + 2 * min(int(row[7]), _LEAVES)]


def check_epoch_start(record: Tensor, group: dist.ProcessGroup | None, device: torch.device, stage: int) -> None:
    """At an epoch's first batch, on every rank of a pipeline: the batch counts and the first batch agree (one
    all-gather of the fingerprints; every rank raises the same error)."""
    size = dist.get_world_size(group)
    rows = [torch.zeros(RECORD_SLOTS, dtype=torch.float64, device=device) for _ in range(size)]
    with pipeline_failures(stage, waiting="the data check at the epoch's first batch"):
        dist.all_gather(rows, record.to(device), group=group)
    check_records(rows)
