"""Layers whose cost is a sleep in proportion to their batch, and one of them slower once training starts than when the
profiler timed it: the model that shows a plan corrected from a run's measured times (``plan --from-trace``).

Sleeping instead of computing keeps the layers' costs what they are said to be on a machine whose cores are shared
(the tests' and benchmarks' 2-core machine): a sleeping rank leaves the cores to the others. Each layer holds a
``Linear`` so that every stage has weights to train.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in the forward and ``backward_s`` in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepyLinear(nn.Module):
    """``Linear(n_in, n_out)`` then a sleep of ``seconds_per_sample`` per sample of the batch in the forward (twice
    that in the backward); once :func:`arm` is called, ``extra_per_sample`` more in the forward."""

    def __init__(self, n_in: int, n_out: int, seconds_per_sample: float, extra_per_sample: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)
        self.seconds_per_sample = seconds_per_sample
        self.extra_per_sample = extra_per_sample
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        forward_s = (self.seconds_per_sample + (self.extra_per_sample if self.armed else 0.0)) * rows
        return torch.tanh(_Sleep.apply(self.linear(x), forward_s, 2 * self.seconds_per_sample * rows))


def sleepy_layers(count: int, seconds_per_sample: float, slow_layer: int | None = None,
                  extra_per_sample: float = 0.0, width: int = 16, n_in: int = 8, n_out: int = 4) -> nn.Sequential:
    """``count`` :class:`SleepyLinear` layers (``n_in`` -> ``width`` ... -> ``n_out``) of equal cost; layer
    ``slow_layer`` sleeps ``extra_per_sample`` more per sample once armed."""
    sizes = [n_in] + [width] * (count - 1) + [n_out]
    return nn.Sequential(*(SleepyLinear(sizes[i], sizes[i + 1], seconds_per_sample,
                                        extra_per_sample if i == slow_layer else 0.0) for i in range(count)))


def arm(module: nn.Module) -> None:
    """From now on the slow layer is slow (call it after the strategy profiled the layers: at the train start)."""
    for layer in module.modules():
        if isinstance(layer, SleepyLinear):
            layer.armed = True
