"""What the user's loss holds, found on fake tensors: the memory model's last term for a model split from its graph.

The memory model counts what the model's layers keep for their backward (:func:`~lightning_pipedream.graph.estimate.
with_working_sets`); the loss is the step's own code after the model call, run on the last stage once per
micro-batch, and it keeps tensors too until that micro-batch's backward (a cross-entropy its log-probabilities, as
large as the logits). :func:`loss_bytes` runs the step on fake tensors of the call's output and the batch, as the
strategy runs it on the last stage (the pipeline's output replayed into the step), and measures both: nothing is
allocated, and a step that reads a value (``.item()``) is left uncounted, said in the log.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torch.fx import Node
from torch.utils import _pytree as pytree

from lightning_pipedream.strategy.setup.calls import ForwardCall, loss_of

log = logging.getLogger("lightning_pipedream.strategy")


@contextmanager
def _attributes_kept(module: LightningModule) -> Iterator[None]:
    """Every submodule's attributes as they were, after: what the step assigns on fake tensors (a metric's state, a
    counter) goes. (Tensors it changes in place are real ones wrapped for the fake mode: their data stays.)"""
    tables = ("_parameters", "_buffers", "_modules")
    saved = [(m, dict(m.__dict__), {t: dict(getattr(m, t)) for t in tables}) for m in module.modules()]
    try:
        yield
    finally:
        for m, attributes, registered in saved:
            m.__dict__.clear()
            m.__dict__.update(attributes)
            for table, entries in registered.items():
                getattr(m, table).clear()
                getattr(m, table).update(entries)


@contextmanager
def _logs_ignored(module: LightningModule) -> Iterator[None]:
    """``self.log`` does nothing for the duration (a fake value has no number to log)."""
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]  # an instance attribute shadows it
    try:
        yield
    finally:
        del module.log


def loss_bytes(module: LightningModule, call: ForwardCall, hook: str, part: Any, captured: Any,
               device: torch.device) -> tuple[int, int] | None:
    """Per call of the step on ``part`` (one micro-batch, or the batch): the bytes the loss keeps for its backward
    (the model's output among them when it saves it: a cross-entropy keeps its log-probabilities, not the logits,
    which then go), and the most its backward holds at once (the gradients of its intermediates and of the model's
    output). None when the step does not run on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_pipedream.plan.live_bytes import LiveTensorBytes
    from lightning_pipedream.tree import map_tensors

    values = [n.meta.get("val") if isinstance(n, Node) else n for n in captured.outputs]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            leaves = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
                      .requires_grad_(v.is_floating_point()) if isinstance(v, Tensor) else v for v in values]
            tree = pytree.tree_unflatten(leaves, captured.out_spec)
            output = tree if captured.rebuild_output is None else captured.rebuild_output(tree)
            batch = map_tensors(lambda t: mode.from_tensor(t.to(device) if t.device != device else t), part)
            saved: dict[int, int] = {}

            def pack(t: Tensor) -> Tensor:  # the model's output too, when the loss saves it
                storage = t.untyped_storage()
                saved[storage._cdata] = storage.nbytes()
                return t

            with _attributes_kept(module), call.replaying(module, output), _logs_ignored(module), \
                    torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = loss_of(getattr(module, hook)(batch, 0))
            wanted = [t for t in leaves if isinstance(t, Tensor) and t.requires_grad]
            meter = LiveTensorBytes(device.type)
            with meter:
                base = meter.live
                torch.autograd.grad(loss, wanted, allow_unused=True)
            return sum(saved.values()), meter.peak - base
    except Exception as unknown:  # noqa: BLE001 - any step code may fail on fake tensors; the estimate goes without
        log.info("PipeDreamStrategy: the memory of %s's loss is not predicted (its step does not run on fake tensors: "
                 "%s: %s)", type(module).__name__, type(unknown).__name__, unknown)
        return None


def with_loss(profile: Any, loss: tuple[int, int] | None) -> Any:
    """``profile`` with the loss's bytes on its last layer (the last stage runs the loss): what it keeps, added to what
    the layer keeps; what its backward holds, when more than the layer's own backward."""
    if loss is None or not profile.layers:
        return profile
    kept, working = loss
    last = profile.layers[-1]
    last = dataclasses.replace(last, saved_bytes=(last.saved_bytes or 0) + kept,
                               grad_working_bytes=max(last.grad_working_bytes or 0, working))
    return dataclasses.replace(profile, layers=[*profile.layers[:-1], last])


def memory_profile(profile: Any, captured: Any, device: torch.device, module: torch.nn.Module,
                   loss: tuple[int, int] | None) -> Any:
    """``profile`` with the memory model's figures found on fake tensors (``graph.estimate.with_working_sets``; the
    ``module``'s frozen parameters get no gradients) and the loss's; a graph whose layers do not run on fake tensors
    (one that reads a value, ``.item()``) keeps the model's own estimates of them, said in the log."""
    from lightning_pipedream.graph.estimate import with_working_sets

    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    try:
        profile = with_working_sets(profile, captured, device, frozen, outputs_kept=loss is None)
    except Exception as unknown:  # noqa: BLE001 - any op may lack a fake-tensor rule; the model's estimates stand
        log.info("PipeDreamStrategy: the layers' memory is estimated from their outputs (they do not run on fake "
                 "tensors: %s: %s)", type(unknown).__name__, str(unknown).split("\n")[0])
        return profile
    return with_loss(profile, loss)
