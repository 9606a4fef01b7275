"""One rank's layers: forward and backward of a micro-batch, and the activations kept in between."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from lightning_pipedream.runtime.communication.microbatch import flatten
from lightning_pipedream.runtime.stages.weights import WeightVersions
from lightning_pipedream.tree import tensors
from lightning_pipedream.weight_branches import WeightBranches


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
        leaves = None if self.weights is None else self.weights.forward_params(microbatch, version)
        if leaves is None:  # no versions, or a stage whose forwards run on its parameters (WeightVersions.direct)
            run, params = self.module, dict(self.module.named_parameters())
        else:
            params = leaves

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
            split = None if self.recompute else WeightBranches(tensors, wanted, params)
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
