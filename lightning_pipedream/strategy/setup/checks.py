"""What the strategy refuses before training (with the way out), and the NaN/inf checks of ``check_finite``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import _configure_optimizers
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_pipedream.strategy.setup.placement import Placement
from lightning_pipedream.tree import tensors


def refuse_guard_with_unequal_replicas(placement: Placement) -> None:
    """``on_divergence='flush'`` goes over to 1f1b, which runs no unequal replicas."""
    if placement.layout is not None:
        raise ValueError(
            "on_divergence='flush' goes over to 1f1b, which does not run unequal stage replicas (1F1B-RR, "
            f"replicas={list(placement.layout.replicas)}). Drop on_divergence, or replicate whole pipelines (stages=)."
        )


def refuse_minibatches_with_replicas(placement: Placement, minibatches_per_batch: int) -> None:
    """``minibatches_per_batch`` runs on straight pipelines only."""
    if minibatches_per_batch > 1 and placement.layout is not None:
        raise ValueError(
            f"PipeDreamStrategy(minibatches_per_batch={minibatches_per_batch}) runs on a straight pipeline (or "
            f"data-parallel copies of one); stages with unequal replicas {list(placement.layout.replicas)} (1F1B-RR) "
            "already cut each batch into one minibatch per input replica. Drop minibatches_per_batch, or use equal "
            "replicas."
        )


def refuse_minibatches_with_accumulation(minibatches_per_batch: int, accumulate_grad_batches: int) -> None:
    """``minibatches_per_batch`` makes an update per minibatch, which accumulation would add up."""
    if minibatches_per_batch > 1 and accumulate_grad_batches > 1:
        raise ValueError(
            f"PipeDreamStrategy(minibatches_per_batch={minibatches_per_batch}) makes an update per minibatch; "
            f"accumulate_grad_batches={accumulate_grad_batches} would add up several. Use a larger "
            "batch with fewer minibatches_per_batch, or drop accumulate_grad_batches."
        )


def check_training_supported(module: LightningModule, precision: Precision, schedule: str = "1f1b",
                             asynchronous: bool = False) -> None:
    """Refuse, before anything runs, what the pipeline cannot train correctly."""
    if not module.automatic_optimization:
        raise ValueError(
            f"{type(module).__name__} uses manual optimization (automatic_optimization=False), which "
            "PipeDreamStrategy does not support: the pipeline runs each stage's optimizer steps itself, at the "
            "points its schedule gives. Use automatic optimization (return the loss from training_step)."
        )
    if getattr(precision, "scaler", None) is not None and asynchronous:
        raise ValueError(
            f"PipeDreamStrategy(schedule={schedule!r}) does not support precision='16-mixed' with a gradient scaler: "
            "its stages update at different times, for different minibatches, so skipping an overflowing step on "
            "every stage would stop the whole pipeline at each update to agree. Use precision='bf16-mixed' (no "
            "scaler needed), or a flushed schedule (1f1b, gpipe, zb-h1, interleaved), where every stage skips the "
            "step together."
        )


def sharded_param_dtype(precision: str, shard: str) -> torch.dtype | None:
    """The dtype sharded stages gather their parameters in under Lightning's ``precision``: bfloat16 under
    ``bf16-mixed`` (FSDP2's mixed precision, with float32 shards, gradient sums and optimizer state; Lightning's
    autocast stays on), the parameters' own dtype otherwise (``16-mixed`` too: float32 shards under Lightning's
    autocast; every replica agrees on an overflow, see strategy/training/loss_scale.py)."""
    return torch.bfloat16 if precision == "bf16-mixed" else None


def check_last_batch_fits(loader: Any, chunks: int, pipelines: int, schedule: str) -> None:
    """A schedule that admits ``chunks`` micro-batches in every step cannot run a last batch of fewer samples:
    refuse it before training when the loader's size tells so, not after an epoch of work."""
    batch_size = getattr(loader, "batch_size", None)
    if not isinstance(batch_size, int) or getattr(loader, "drop_last", True):
        return
    try:
        samples = len(loader.dataset)
    except TypeError:  # an iterable dataset: its length is unknown before the epoch
        return
    last = -(-samples // pipelines) % batch_size  # each pipeline's share, padded as DistributedSampler pads it
    if 0 < last < chunks:
        raise ValueError(
            f"schedule={schedule!r} admits chunks={chunks} micro-batches in every step, but the training data's last "
            f"batch has {last} samples ({samples} samples in batches of {batch_size}), so the epoch would stop "
            f"there. Pass DataLoader(..., drop_last=True), choose a batch size that leaves a last batch of at least "
            f"{chunks} samples, or use a synchronous schedule (1f1b, gpipe, zb-h1, interleaved), which runs such a "
            "batch with one micro-batch per sample."
        )


def check_optimizers(optimizers: list[torch.optim.Optimizer]) -> None:
    """Refuse optimizers that need to re-evaluate the loss, which a pipeline stage cannot do alone."""
    for optimizer in optimizers:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "PipeDreamStrategy does not support LBFGS (or any optimizer that re-evaluates the loss inside "
                "step()): a pipeline stage cannot recompute the loss on its own. Use an optimizer that steps once "
                "from the gradients, such as SGD or Adam."
            )


def check_stage_trains(stage: nn.Module, index: int, balance: list[int]) -> None:
    """A stage without parameters would give its optimizer an empty parameter list, which torch refuses."""
    if not any(p.requires_grad for p in stage.parameters()):
        raise ValueError(
            f"Stage {index} of balance={balance} holds layers {list(stage._modules)}, which have no trainable "
            "parameters, and torch's optimizers refuse an empty parameter list. Choose a balance (or fewer stages) "
            "that gives every stage a layer with parameters."
        )


def optimizers_unvalidated(module: LightningModule) -> tuple[list[torch.optim.Optimizer], None]:
    """``configure_optimizers``' optimizers, before Lightning's checks (so that ours can say what to do instead)."""
    conf = module.configure_optimizers()
    return (_configure_optimizers(conf)[0] if conf is not None else []), None


class NonFiniteError(FloatingPointError):
    """A stage's output or gradient held NaN or inf (``PipeDreamStrategy(check_finite=True)``)."""


def non_finite(tree: Any) -> str:
    """"nan", "inf" or "inf and nan" when the tree's floating-point tensors hold them; "" when all are finite."""
    found = set()
    for t in tensors(tree):
        if t.is_floating_point() or t.is_complex():
            if torch.isnan(t).any():
                found.add("nan")
            if torch.isinf(t).any():
                found.add("inf")
    return " and ".join(sorted(found))


_WAY_OUT = "Lower the learning rate, clip gradients, or check the data of that step; check_finite=False turns this off."


class FiniteChecks:
    """``check_finite=True``: raise at the first NaN/inf in a stage's layer outputs or gradients, naming where.

    Each layer (or the whole stage, for a traced graph's stage) gets a forward hook; gradients are
    checked right before each of the pipeline's updates. ``context`` says what the pipeline runs now.
    """

    def __init__(self, stage: nn.Module, stage_index: int, context: Callable[[], str], per_layer: bool) -> None:
        self.stage, self.stage_index, self.context = stage, stage_index, context
        layers = list(stage.named_children()) if per_layer else []
        for name, layer in layers or [("(the whole stage)", stage)]:
            layer.register_forward_hook(self._output_check(name))

    def _output_check(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def check(layer: nn.Module, inputs: Any, output: Any) -> None:
            bad = non_finite(output)
            if bad:
                raise NonFiniteError(
                    f"Stage {self.stage_index}: layer {name!r} ({type(layer).__name__}) produced {bad} in its output "
                    f"at {self.context()}. Its inputs were {non_finite(inputs) or 'finite'}. {_WAY_OUT}"
                )

        return check

    def check_gradients(self, batch_idx: int) -> None:
        for name, p in self.stage.named_parameters():
            bad = non_finite(p.grad) if p.grad is not None else ""
            if bad:
                raise NonFiniteError(
                    f"Stage {self.stage_index}: the gradient of {name} holds {bad} before the update for the "
                    f"minibatch of training step {batch_idx}. {_WAY_OUT}"
                )
