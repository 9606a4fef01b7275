"""PipelineUpdates in one process: gradients kept aside from Lightning's, accumulation groups, admitted settings."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_pipedream.strategy.training.updates import PipelineUpdates


def make(lr: float = 0.1):
    torch.manual_seed(0)
    layer = nn.Linear(3, 1, bias=False)
    optimizer = torch.optim.SGD(layer.parameters(), lr=lr)
    stepped: list[int] = []
    updates = PipelineUpdates(list(layer.parameters()), lambda: [optimizer], lambda opt: opt.step(),
                              before_step=stepped.append)
    return layer, optimizer, updates, stepped


def backward(layer: nn.Linear, x: torch.Tensor) -> None:
    layer(x).sum().backward()


def test_pipeline_gradients_are_kept_aside_from_lightnings() -> None:
    layer, _, updates, _ = make()
    lightning_grad = torch.full((1, 3), 7.0)
    layer.weight.grad = lightning_grad
    with updates.pipeline_grads():
        assert layer.weight.grad is None  # the pipeline starts from its own clean slate
        backward(layer, torch.ones(1, 3))
    assert layer.weight.grad is lightning_grad  # Lightning's zero_grad and hooks see their own
    with updates.pipeline_grads():
        torch.testing.assert_close(layer.weight.grad, torch.ones(1, 3))  # still accumulated


def test_an_update_applies_a_whole_accumulation_group_with_the_settings_admitted() -> None:
    layer, optimizer, updates, stepped = make(lr=0.1)
    start = layer.weight.detach().clone()
    updates.admit(0, batch_idx=0, closes_group=False)
    updates.admit(1, batch_idx=1, closes_group=True)
    optimizer.param_groups[0]["lr"] = 5.0  # a scheduler stepped after minibatch 1 was admitted
    with updates.pipeline_grads():
        backward(layer, torch.ones(1, 3))
        updates.apply(0)  # not the group's end: nothing applied yet
        torch.testing.assert_close(layer.weight.detach(), start)
        backward(layer, 2 * torch.ones(1, 3))
        updates.apply(1)
        assert layer.weight.grad is None  # zeroed after the update
    torch.testing.assert_close(layer.weight.detach(), start - 0.1 * 3 * torch.ones(1, 3))  # lr of admission
    assert optimizer.param_groups[0]["lr"] == 5.0  # the optimizer's own setting is put back
    assert stepped == [1] and updates.in_flight == 0


def test_a_schedulers_first_step_before_the_first_update_is_not_called_out_of_order() -> None:
    # Under pipedream stage 0's first update runs stages - 1 steps after Lightning's first scheduler step, with the
    # rate read at admission: torch must not warn that the schedule's first value is skipped.
    def first_scheduler_step(admit: bool) -> list[str]:
        _, optimizer, updates, _ = make()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        if admit:
            updates.admit(0, batch_idx=0, closes_group=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            scheduler.step()
        return [str(w.message) for w in seen]

    assert first_scheduler_step(admit=True) == []
    assert any("before `optimizer.step()`" in m for m in first_scheduler_step(admit=False))  # torch's check is on


def test_forget_drops_what_was_admitted_and_accumulated() -> None:
    layer, _, updates, stepped = make()
    updates.admit(0, batch_idx=0, closes_group=True)
    with updates.pipeline_grads():
        backward(layer, torch.ones(1, 3))
    updates.forget()
    assert updates.in_flight == 0
    with updates.pipeline_grads():
        assert layer.weight.grad is None
    assert stepped == []


def test_changed_parameter_groups_are_refused_with_the_fix() -> None:
    layer, optimizer, updates, _ = make()
    updates.admit(0, batch_idx=0, closes_group=True)
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    with pytest.raises(RuntimeError, match="The optimizer's parameter groups changed during training .* put them all "
                                           "in configure_optimizers, freeze with requires_grad=False"):
        updates.admit(1, batch_idx=1, closes_group=True)
