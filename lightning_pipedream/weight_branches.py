"""Where a backward graph branches from the inputs' path to the weights: the two halves of a zero-bubble backward."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor


class WeightBranches:
    """Where a stage's graph branches from the inputs' path to the weights, and the gradients arriving there.

    A node on the path from the outputs to the inputs whose other inputs lead only to parameters
    (an addmm: input, weight, bias) is a branch point. The input-gradient pass records the gradient
    that reaches each branch point; the weight pass then runs, per branch point, autograd from there
    to its parameters only, so the activation gradients along the path are not computed twice.
    ``complete`` is False when some parameter is reached otherwise (it is used on the path itself,
    or the outputs reach it without crossing the path): the caller then runs the plain backward.
    """

    def __init__(self, roots: Sequence[Tensor], inputs: Sequence[Tensor], params: Sequence[Tensor]) -> None:
        from torch.autograd.graph import get_gradient_edge

        self._edge = get_gradient_edge
        starts = [t.grad_fn for t in roots if t.grad_fn is not None]
        targets = {get_gradient_edge(t).node for t in inputs}
        owners = {get_gradient_edge(p).node: p for p in params}
        children: dict[Any, list] = {}
        order: list[Any] = []  # every node below the roots, each once
        stack = list(starts)
        while stack:
            node = stack.pop()
            if node in children:
                continue
            children[node] = [(child, i) for i, (child, _) in enumerate(node.next_functions) if child is not None]
            order.append(node)
            stack.extend(child for child, _ in children[node])
        # What each node reaches: an input (on the path), which parameters (in reverse topological order).
        on_path: dict[Any, bool] = {}
        reaches: dict[Any, frozenset] = {}

        def visit(node: Any) -> None:  # iterative post-order
            todo = [(node, False)]
            while todo:
                n, done = todo.pop()
                if n in on_path:
                    continue
                kids = [c for c, _ in children.get(n, [])]
                if not done:
                    todo.append((n, True))
                    todo.extend((c, False) for c in kids if c not in on_path)
                    continue
                on_path[n] = n in targets or any(on_path[c] for c in kids)
                own = frozenset([n]) if n in owners else frozenset()
                reaches[n] = own.union(*(reaches[c] for c in kids))

        for node in starts:
            visit(node)
        self.branches: list[tuple[Any, list[Any]]] = []  # (branch point, its weight-only children's parameter nodes)
        covered: set = set()
        tied = False
        for node in order:
            if not on_path[node]:
                continue
            weight_nodes: set = set()
            for child, _ in children[node]:
                if not on_path[child]:
                    weight_nodes |= reaches[child]
            if not weight_nodes:
                continue
            # A parameter also reached along the path below this node would be counted twice from here.
            below = frozenset().union(*(reaches[c] for c, _ in children[node] if on_path[c]))
            if weight_nodes & below:
                tied = True
            self.branches.append((node, sorted(weight_nodes, key=id)))
            covered |= weight_nodes
        # The weight half goes back through the forward's order, as a backward does (latest node first): the branches of
        # one layer come together, so it frees each layer's kept gradients as it makes that layer's weight gradients
        # (what plan.memory.weight_half_bytes counts on).
        self.branches.sort(key=lambda branch: -branch[0]._sequence_nr())
        reachable = frozenset().union(*(reaches[n] for n in starts)) if starts else frozenset()
        self.complete = not tied and covered == set(reachable)
        self._owners = owners
        self._captured: dict[Any, tuple] = {}

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """A context in which the gradients arriving at the branch points are kept."""
        handles = [node.register_prehook(self._keeper(node)) for node, _ in self.branches]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _keeper(self, node: Any):
        def keep(grad_outputs: tuple) -> None:
            self._captured[node] = grad_outputs

        return keep

    def pending_bytes(self) -> int:
        """Bytes of the gradients kept at the branch points (once per storage): what waits for the weight half."""
        # by storage, not address: fake tensors (the memory model's, on a model built on meta) have none
        kept = {g.untyped_storage()._cdata: g.untyped_storage().nbytes()
                for grads in self._captured.values() for g in grads if g is not None}
        return sum(kept.values())

    def weight_gradients(self) -> None:
        """From each branch point, the gradients of the parameters its weight branches reach, into ``.grad``."""
        from torch.autograd.graph import GradientEdge

        for node, weight_nodes in self.branches:
            arrived = self._captured.pop(node, None)
            if arrived is None:  # no gradient reached it (an unused output)
                continue
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(arrived) if g is not None]
            if not edges:
                continue
            params = [self._owners[w] for w in weight_nodes]
            values = torch.autograd.grad(
                [e for e, _ in edges], [GradientEdge(w, 0) for w in weight_nodes], [g for _, g in edges],
                retain_graph=True, allow_unused=True,
            )
            for p, g in zip(params, values):
                if g is not None:  # in place: one parameter-sized temporary at a time, not two
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad.add_(g)
