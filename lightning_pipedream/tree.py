"""Tensor trees (tensors inside tuples, lists and dicts): the one walker every layer uses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor

# A tree spec is a nested description of a tensor tree with the tensors taken out:
#   ("T",)                            a tensor leaf
#   ("C", value)                      a constant leaf carried as is
#   ("tuple"|"list", [specs])         a sequence
#   ("namedtuple", type, [specs])     a namedtuple (lenient walks only: its type need not pickle)
#   ("dict", [keys], [specs])         a mapping
TreeSpec = tuple


class TensorTreeError(TypeError):
    """A value that is not a tensor tree was given where one was expected."""


_CONSTANT_TYPES = (type(None), bool, int, float, str)


def flatten(tree: Any, where: str = "value") -> tuple[list[Tensor], TreeSpec]:
    """The tensors of ``tree`` in a fixed order, and a spec to rebuild it (:func:`unflatten`).

    Strict: the tree may hold only tensors, tuples, lists, dicts, None, numbers and strings, because
    its spec crosses process boundaries; anything else raises :class:`TensorTreeError` naming
    ``where`` and the path to it.
    """
    leaves: list[Tensor] = []
    spec = _flatten_into(tree, where, where, leaves, strict=True)
    return leaves, spec


def unflatten(leaves: list[Tensor], spec: TreeSpec) -> Any:
    """Rebuild the tree described by ``spec`` from its tensors."""
    return _build(iter(leaves), spec)


def tensors(tree: Any) -> list[Tensor]:
    """Every tensor in ``tree``, in :func:`flatten`'s order; any other leaf is skipped."""
    leaves: list[Tensor] = []
    _flatten_into(tree, "", "", leaves, strict=False)
    return leaves


def map_tensors(fn: Callable[[Tensor], Any], tree: Any) -> Any:
    """The same tree with ``fn(t)`` in place of each tensor ``t``; other leaves, namedtuples kept as they are."""
    leaves: list[Tensor] = []
    spec = _flatten_into(tree, "", "", leaves, strict=False)
    return _build(iter([fn(t) for t in leaves]), spec)


# Module-level recursion, not nested closures: a closure that calls itself is a reference cycle,
# which kept every tree (and its autograd graph, and stashed weights) alive until the garbage
# collector ran; pipedream's resident memory grew by ~300 MB in the benchmark because of it.
def _flatten_into(node: Any, path: str, where: str, leaves: list[Tensor], strict: bool) -> TreeSpec:
    if isinstance(node, Tensor):
        leaves.append(node)
        return ("T",)
    if isinstance(node, _CONSTANT_TYPES):
        return ("C", node)
    if isinstance(node, tuple) and hasattr(node, "_fields") and not strict:
        return ("namedtuple", type(node), [_flatten_into(c, "", where, leaves, strict) for c in node])
    if isinstance(node, (tuple, list)):
        kind = "list" if isinstance(node, list) else "tuple"
        children = [_flatten_into(c, f"{path}[{i}]", where, leaves, strict) for i, c in enumerate(node)]
        return (kind, children)
    if isinstance(node, dict):
        keys = list(node.keys())
        return ("dict", keys, [_flatten_into(node[k], f"{path}[{k!r}]", where, leaves, strict) for k in keys])
    if not strict:
        return ("C", node)
    raise TensorTreeError(
        f"{where} contains {path} of type {type(node).__name__}, which cannot cross a pipeline stage. "
        "Stage outputs must be tensors or tuples/lists/dicts of tensors (None, numbers and strings "
        "are carried as constants); convert it to a tensor or return it from the last stage only."
    )


def _build(leaves: Iterator[Any], node: TreeSpec) -> Any:
    kind = node[0]
    if kind == "T":
        return next(leaves)
    if kind == "C":
        return node[1]
    if kind == "dict":
        return {k: _build(leaves, child) for k, child in zip(node[1], node[2])}
    if kind == "namedtuple":
        return node[1](*(_build(leaves, child) for child in node[2]))
    children = [_build(leaves, child) for child in node[1]]
    return children if kind == "list" else tuple(children)
