"""A stage's recompute: one replay of the forward per backward half, whatever the stage's depth, and the same
gradients as without it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipedream.runtime.stages.stage import Stage


class Counted(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body, self.forwards = body, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return self.body(x)


def run(depth: int, recompute: bool, split: bool) -> tuple[int, list[torch.Tensor]]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    module = Counted(nn.Sequential(*layers))
    stage = Stage(module, 1, 3, recompute=recompute)
    x = torch.randn(4, 8, requires_grad=True)
    out = stage.forward(0, x)
    if split:  # zero bubble: input gradients first, weight gradients later
        (grad_in,) = stage.backward_input(0, [torch.ones_like(out)])
        stage.backward_weight(0)
    else:
        (grad_in,) = stage.backward(0, [torch.ones_like(out)])
    return module.forwards, [grad_in, *(p.grad for p in module.parameters())]


@pytest.mark.parametrize("depth", [2, 6])
@pytest.mark.parametrize("split", [False, True])
def test_recompute_replays_the_forward_once_per_backward_half(depth, split):
    plain_forwards, plain = run(depth, recompute=False, split=split)
    forwards, grads = run(depth, recompute=True, split=split)
    assert plain_forwards == 1
    # 1f1b: the forward and one replay; zb-h1: one replay for each half (it was one per Linear, 1 + depth + 1)
    assert forwards == (3 if split else 2)
    for got, want in zip(grads, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
