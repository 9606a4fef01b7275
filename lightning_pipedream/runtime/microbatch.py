"""Tensor trees: flatten and rebuild them, split batches into micro-batches and merge them back."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

# A tree spec is a nested description of a tensor tree with the tensors taken out:
#   ("T",)                      a tensor leaf
#   ("C", value)                a constant leaf (None, a number, a string) carried as is
#   ("tuple"|"list", [specs])   a sequence
#   ("dict", [keys], [specs])   a mapping
TreeSpec = tuple


class TensorTreeError(TypeError):
    """A value that is not a tensor tree was given where one was expected."""


_CONSTANT_TYPES = (type(None), bool, int, float, str)


def flatten(tree: Any, where: str = "value") -> tuple[list[Tensor], TreeSpec]:
    """Return the tensors of ``tree`` in a fixed order, and a spec to rebuild it."""
    leaves: list[Tensor] = []
    spec = _flatten_into(tree, where, where, leaves)
    return leaves, spec


# Module-level recursion, not nested closures: a closure that calls itself is a reference cycle,
# which kept every tree (and its autograd graph, and stashed weights) alive until the garbage
# collector ran; pipedream's resident memory grew by ~300 MB in the benchmark because of it.
def _flatten_into(node: Any, path: str, where: str, leaves: list[Tensor]) -> TreeSpec:
    if isinstance(node, Tensor):
        leaves.append(node)
        return ("T",)
    if isinstance(node, _CONSTANT_TYPES):
        return ("C", node)
    if isinstance(node, (tuple, list)):
        kind = "list" if isinstance(node, list) else "tuple"
        return (kind, [_flatten_into(child, f"{path}[{i}]", where, leaves) for i, child in enumerate(node)])
    if isinstance(node, dict):
        keys = list(node.keys())
        return ("dict", keys, [_flatten_into(node[k], f"{path}[{k!r}]", where, leaves) for k in keys])
    raise TensorTreeError(
        f"{where} contains {path} of type {type(node).__name__}, which cannot cross a pipeline stage. "
        "Stage outputs must be tensors or tuples/lists/dicts of tensors (None, numbers and strings "
        "are carried as constants); convert it to a tensor or return it from the last stage only."
    )


def unflatten(leaves: list[Tensor], spec: TreeSpec) -> Any:
    """Rebuild the tree described by ``spec`` from its tensors."""
    return _build(iter(leaves), spec)


def _build(leaves: Iterator[Tensor], node: TreeSpec) -> Any:
    kind = node[0]
    if kind == "T":
        return next(leaves)
    if kind == "C":
        return node[1]
    if kind == "dict":
        return {k: _build(leaves, child) for k, child in zip(node[1], node[2])}
    children = [_build(leaves, child) for child in node[1]]
    return children if kind == "list" else tuple(children)


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
