"""Split batches (tensor trees) into micro-batches and merge micro-batch outputs back."""

from __future__ import annotations

from typing import Any

import torch

# The tree walker lives in lightning_pipedream.tree (plan/ uses it too); re-exported for the runtime.
from lightning_pipedream.tree import TensorTreeError, TreeSpec, flatten, unflatten


def batch_size(tree: Any) -> int:
    """The size of dim 0 shared by the tensors of a batch."""
    leaves, _ = flatten(tree, "batch")
    sizes = {t.shape[0] for t in leaves if t.dim() > 0}
    if not sizes:
        raise ValueError("The batch has no tensor with a batch dimension (dim 0) to split into micro-batches.")
    if len(sizes) > 1:
        raise ValueError(
            f"The batch's tensors have different sizes along dim 0 ({sorted(sizes)}); pipeline schedules split "
            "every tensor of a batch along dim 0, so make the batch dimension first in all of them."
        )
    return sizes.pop()


def split(tree: Any, chunks: int) -> list[Any]:
    """Split every tensor of a batch along dim 0 into ``chunks`` micro-batches (sizes differ by at most one)."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}.")
    size = batch_size(tree)
    if size < chunks:
        raise ValueError(
            f"A batch of {size} samples cannot be split into chunks={chunks} micro-batches; "
            f"use a batch size of at least {chunks} or fewer chunks."
        )
    leaves, spec = flatten(tree, "batch")
    pieces = [torch.tensor_split(t, chunks, dim=0) if t.dim() > 0 else (t,) * chunks for t in leaves]
    return [unflatten([p[i] for p in pieces], spec) for i in range(chunks)]


def merge(parts: list[Any]) -> Any:
    """Concatenate micro-batch outputs along dim 0 (0-dim tensors are stacked)."""
    flat = [flatten(p, "micro-batch output") for p in parts]
    spec = flat[0][1]
    columns = zip(*(leaves for leaves, _ in flat))
    merged = [torch.cat(col) if col[0].dim() > 0 else torch.stack(col) for col in columns]
    return unflatten(merged, spec)


__all__ = ["TensorTreeError", "TreeSpec", "batch_size", "flatten", "merge", "split", "unflatten"]
