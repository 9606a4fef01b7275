"""``precision="16-mixed"`` under the pipeline: one loss scale for every stage, and a step skipped by all of them.

Lightning's mixed-precision plugin scales the loss, unscales each optimizer's gradients, and skips the step when
they hold an inf or NaN, then grows or backs off the scale. With the model cut into stages, the loss is scaled on
the last stage and its scale reaches every stage through the gradients; each stage finds overflows only in its
own gradients. So at every update the stages of a pipeline agree (a max over the pipeline's group) on whether
any of them overflowed, and all skip, or all step, and all back off or grow the scale alike: the scales stay
equal on every rank, as with one device. The agreement is a collective at each update, so only the flushed
schedules take it (each rank updates once per step there, after the flush). Sharded replicas (``shard=``) each hold a
shard of every gradient: their gradients are DTensors, whose unscaling already takes the max of the overflow flag
over the replicas (torch's found-inf handler for DTensor), so they agree too (tests/strategy/test_exactness.py plants
an overflow in one replica's shard alone).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision

from lightning_pipedream.runtime.faults.failures import pipeline_failures


def scaler_of(precision: Precision) -> torch.amp.GradScaler | None:
    """The plugin's gradient scaler (``16-mixed``), if any and enabled."""
    scaler = getattr(precision, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def agreed_step(precision: Precision, optimizer: torch.optim.Optimizer, module: LightningModule,
                group: dist.ProcessGroup | None) -> None:
    """One update under a gradient scaler, as the plugin's ``optimizer_step`` makes it, with the overflow agreed
    over ``group`` (the pipeline's ranks) between the unscaling and the step."""
    scaler = scaler_of(precision)
    assert scaler is not None
    if scaler._scale is None:  # only the last stage scales a loss; the others need the scale to unscale with
        scaler._lazy_init_scale_growth_tracker(_device_of(optimizer))
    scaler.unscale_(optimizer)
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    device = next(iter(found.values())).device if found else _device_of(optimizer)
    overflow = torch.zeros(1, dtype=torch.float32, device=device)
    for flag in found.values():
        overflow = torch.maximum(overflow, flag.to(device).reshape(1))
    if dist.is_initialized():
        with pipeline_failures(None, waiting="the fp16 overflow flags' all-reduce"):
            dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=group)
    if not found:  # no gradients here: the scaler still needs this stage's view of the step to update alike
        found[device] = overflow.clone()
    for flag in found.values():
        flag.copy_(overflow.to(flag.device).reshape(flag.shape))
    precision._after_closure(module, optimizer)  # Lightning's hooks and clipping, on unscaled gradients
    scaler.step(optimizer)
    scaler.update()


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    return torch.device("cpu")


def scaled(loss: torch.Tensor, precision: Precision) -> torch.Tensor:
    """The last stage's loss as its backward must start from: times the scale under ``16-mixed``."""
    scaler = scaler_of(precision)
    return scaler.scale(loss) if scaler is not None else loss


def scale_of(precision: Precision) -> Any:
    """The current scale (for tests and logs), or None without a scaler."""
    scaler = scaler_of(precision)
    return None if scaler is None else scaler.get_scale()
