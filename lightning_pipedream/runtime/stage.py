"""One rank's layers: forward and backward of a micro-batch, and the activations kept in between."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_pipedream.runtime.microbatch import flatten
from lightning_pipedream.runtime.weights import WeightVersions


class Stage:
    """The layers of one pipeline stage, run one micro-batch at a time.

    The forward of micro-batch ``m`` keeps its inputs and outputs until ``backward(m)``.
    With ``weights`` (PipeDream's asynchronous schedule) each forward runs on the weight
    version :class:`WeightVersions` hands out; otherwise on the module's own parameters, whose
    gradients simply accumulate over the micro-batches of a step.
    """

    def __init__(self, module: nn.Module, index: int, num_stages: int, weights: WeightVersions | None = None):
        self.module = module
        self.index = index
        self.num_stages = num_stages
        self.weights = weights
        self._saved: dict[int, tuple[list[Tensor], list[Tensor]]] = {}

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def in_flight(self) -> int:
        """Micro-batches whose forward has run and whose backward has not."""
        return len(self._saved)

    def forward(self, microbatch: int, inputs: Any, version: int | None = None) -> Any:
        """Run the stage on ``inputs`` and keep what its backward needs."""
        with torch.enable_grad():
            if self.weights is None:
                output = self.module(inputs)
            else:
                params = self.weights.forward_params(microbatch, version)
                output = functional_call(self.module, params, (inputs,), strict=False)
        in_leaves, _ = flatten(inputs, f"input of stage {self.index}")
        out_leaves, _ = flatten(output, f"output of stage {self.index}")
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

    def backward(self, microbatch: int, output_grads: Any = None) -> list[Tensor | None]:
        """Back-propagate ``microbatch`` and return the gradients of its inputs (None where none is needed)."""
        in_leaves, out_leaves = self._saved.pop(microbatch)
        if output_grads is None:  # the loss
            tensors, grads = out_leaves, [None] * len(out_leaves)
        else:
            # One entry per output tensor, None where the next stage needed no gradient.
            if len(output_grads) != len(out_leaves):
                raise RuntimeError(
                    f"Stage {self.index} received {len(output_grads)} gradients for {len(out_leaves)} outputs."
                )
            pairs = [(t, g) for t, g in zip(out_leaves, output_grads) if t.requires_grad and g is not None]
            tensors, grads = [t for t, _ in pairs], [g for _, g in pairs]
        if tensors:
            torch.autograd.backward(tensors, grads)
        if self.weights is not None:
            self.weights.collect_grads(microbatch)
        return [t.grad if t.requires_grad else None for t in in_leaves]
