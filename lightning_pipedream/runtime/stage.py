"""One rank's layers: forward and backward of a micro-batch, and the activations kept in between."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from lightning_pipedream.runtime.microbatch import flatten
from lightning_pipedream.runtime.weights import WeightVersions
from lightning_pipedream.tree import tensors


class Stage:
    """The layers of one pipeline stage, run one micro-batch at a time.

    The forward of micro-batch ``m`` keeps its inputs and outputs until ``backward(m)``.
    With ``weights`` (PipeDream's asynchronous schedule, 2BW) each forward runs on the weight
    version :class:`WeightVersions` hands out; otherwise on the module's own parameters, whose
    gradients simply accumulate over the micro-batches of a step.

    ``recompute=True`` keeps only each micro-batch's inputs: the forward runs under
    ``torch.utils.checkpoint`` (non-reentrant), which replays it in the backward with the RNG
    state of the first run restored, so dropout masks are the same.

    The backward can run whole (:meth:`backward`) or split in two (zero-bubble schedules):
    :meth:`backward_input` computes only the input gradients the previous stage waits for, and
    keeps the graph; :meth:`backward_weight` later computes the parameters' gradients from it.

    ``track_activations=True`` counts the bytes a micro-batch keeps between its forward and its
    backward (its inputs, and every tensor autograd saves other than the parameters), in
    :attr:`activation_bytes` (now) and :attr:`peak_activation_bytes` (the most at any time).
    """

    def __init__(
        self,
        module: nn.Module,
        index: int,
        num_stages: int,
        weights: WeightVersions | None = None,
        *,
        recompute: bool = False,
    ) -> None:
        self.module = module
        self.index = index
        self.num_stages = num_stages
        self.weights = weights
        self.recompute = recompute
        self.track_activations = False
        self.activation_bytes = 0
        self.peak_activation_bytes = 0
        self._saved: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        self._pending_weight: dict[int, tuple[list[Tensor], list[Tensor | None]]] = {}  # after backward_input
        self._bytes: dict[int, int] = {}

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def in_flight(self) -> int:
        """Micro-batches whose forward has run and whose backward (both halves, when split) has not."""
        return len(self._saved) + len(self._pending_weight)

    def forward(self, microbatch: int, inputs: Any, version: int | None = None) -> Any:
        """Run the stage on ``inputs`` and keep what its backward needs."""
        if self.weights is None:
            run, params = self.module, dict(self.module.named_parameters())
        else:
            params = self.weights.forward_params(microbatch, version)

            def run(x: Any) -> Any:
                return functional_call(self.module, params, (x,), strict=False)

        in_leaves, _ = flatten(inputs, f"input of stage {self.index}")
        with torch.enable_grad(), self._counting(microbatch, in_leaves, params.values()):
            if self.recompute:
                output = checkpoint(run, inputs, use_reentrant=False, preserve_rng_state=True)
            else:
                output = run(inputs)
        # The last stage's output stays in this process (the loss reads it), so it may be any object, such as a model's
        # output dataclass; an earlier stage's crosses to the next and must be a tensor tree.
        out_leaves = tensors(output) if self.is_last else flatten(output, f"output of stage {self.index}")[0]
        self._saved[microbatch] = (in_leaves, out_leaves)
        return output

    def infer(self, inputs: Any) -> Any:
        """Forward without autograd and without keeping anything (evaluation)."""
        with torch.no_grad():
            return self.module(inputs)

    def keep_loss(self, microbatch: int, loss: Tensor) -> None:
        """On the last stage the backward starts from the loss rather than from the outputs."""
        in_leaves, _ = self._saved[microbatch]
        self._saved[microbatch] = (in_leaves, [loss])

    def _roots(self, microbatch: int, output_grads: Any) -> tuple[list[Tensor], list[Tensor], list[Tensor | None]]:
        """The inputs, and the tensors (with their gradients) a backward starts from."""
        in_leaves, out_leaves = self._saved.pop(microbatch)
        if output_grads is None:  # the loss
            return in_leaves, out_leaves, [None] * len(out_leaves)
        # One entry per output tensor, None where the next stage needed no gradient.
        if len(output_grads) != len(out_leaves):
            raise RuntimeError(
                f"Stage {self.index} received {len(output_grads)} gradients for {len(out_leaves)} outputs."
            )
        pairs = [(t, g) for t, g in zip(out_leaves, output_grads) if t.requires_grad and g is not None]
        return in_leaves, [t for t, _ in pairs], [g for _, g in pairs]

    def backward(self, microbatch: int, output_grads: Any = None) -> list[Tensor | None]:
        """Back-propagate ``microbatch`` and return the gradients of its inputs (None where none is needed)."""
        in_leaves, tensors, grads = self._roots(microbatch, output_grads)
        if self.weights is not None:
            self.weights.accumulate_in_place(microbatch)
        if tensors:
            torch.autograd.backward(tensors, grads)
        self._release(microbatch)
        if self.weights is not None:
            self.weights.collect_grads(microbatch)
        return [t.grad if t.requires_grad else None for t in in_leaves]

    def backward_input(self, microbatch: int, output_grads: Any = None) -> list[Tensor | None]:
        """The first half of a split backward: only the input gradients; the graph stays for :meth:`backward_weight`.

        On the way it keeps the gradient arriving at each node where a branch to the weights leaves
        the inputs' path (a Linear's matmul, say), so that the weight half starts from there instead of
        walking the whole stage again.
        """
        in_leaves, tensors, grads = self._roots(microbatch, output_grads)
        wanted = [t for t in in_leaves if t.requires_grad]
        params = [p for p in self.module.parameters() if p.requires_grad]
        found: dict[int, Tensor | None] = {}
        split = None
        if tensors and wanted:
            # Under recompute every autograd call over the stage replays its forward (the checkpoint keeps only the
            # inputs), so the weight half runs as one call from the outputs: one replay per half, not one per
            # branch point.
            split = None if self.recompute else _WeightBranches(tensors, wanted, params)
            with split.capturing() if split is not None else nullcontext():
                # allow_unused: an input may feed only a branch that does not reach the outputs.
                values = torch.autograd.grad(tensors, wanted, grads, retain_graph=True, allow_unused=True)
            found = {id(t): g for t, g in zip(wanted, values)}
        self._pending_weight[microbatch] = (tensors, grads, split)
        return [found.get(id(t)) if t.requires_grad else None for t in in_leaves]

    def backward_weight(self, microbatch: int) -> None:
        """The second half of a split backward: the parameters' gradients, accumulated into ``.grad``."""
        tensors, grads, split = self._pending_weight.pop(microbatch)
        params = [p for p in self.module.parameters() if p.requires_grad]
        if tensors and params:
            if split is not None and split.complete:
                split.weight_gradients()
            else:  # from the outputs (the first stage: B computed nothing; or a graph the branches do not cover)
                torch.autograd.backward(tensors, grads, inputs=params)
        self._release(microbatch)

    # ---- stored activations

    @contextmanager
    def _counting(self, microbatch: int, in_leaves: list[Tensor], weights: Any) -> Iterator[None]:
        """A context that adds up what ``microbatch``'s forward keeps (when :attr:`track_activations` is on)."""
        if not self.track_activations:
            yield
            return
        params = {p.untyped_storage().data_ptr() for p in weights}
        seen: dict[int, int] = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in in_leaves}

        def pack(t: Tensor) -> Tensor:  # every tensor autograd saves, once per storage, parameters aside
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self._bytes[microbatch] = sum(seen.values())
        self.activation_bytes += self._bytes[microbatch]
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.activation_bytes)

    def _release(self, microbatch: int) -> None:
        self.activation_bytes -= self._bytes.pop(microbatch, 0)



class _WeightBranches:
    """Where a stage's graph branches from the inputs' path to the weights, and the gradients arriving there.

    A node on the path from the outputs to the inputs whose other inputs lead only to parameters
    (an addmm: input, weight, bias) is a branch point. The input-gradient pass records the gradient
    that reaches each branch point; the weight pass then runs, per branch point, autograd from there
    to its parameters only, so the activation gradients along the path are not computed twice.
    ``complete`` is False when some parameter is reached otherwise (it is used on the path itself,
    or the outputs reach it without crossing the path): the caller then runs the plain backward.
    """

    def __init__(self, roots: list[Tensor], inputs: list[Tensor], params: list[Tensor]) -> None:
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
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g
