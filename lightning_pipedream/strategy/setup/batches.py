"""Batches as the strategy meets them: a loop's first batch, a step's arguments, a batch's shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lightning_pipedream.runtime.communication.microbatch import TensorTreeError, flatten, merge

# The LightningModule hook each Trainer function runs, and the loop of the evaluating ones.
STEP_OF = {
    TrainerFn.FITTING: "training_step",
    TrainerFn.VALIDATING: "validation_step",
    TrainerFn.TESTING: "test_step",
    TrainerFn.PREDICTING: "predict_step",
}
EVALUATION_LOOP: dict[TrainerFn, Callable[[Trainer], Any]] = {
    TrainerFn.VALIDATING: lambda trainer: trainer.validate_loop,
    TrainerFn.TESTING: lambda trainer: trainer.test_loop,
    TrainerFn.PREDICTING: lambda trainer: trainer.predict_loop,
}


def loop_loader(loop: Any) -> Any:
    """A Trainer loop's (first) dataloader as the user gave it, before the loop sets it up; None if none."""
    source = getattr(loop, "_data_source", None)
    if source is None or not source.is_defined():
        return None
    loader = source.dataloader()
    return loader[0] if isinstance(loader, (list, tuple)) else loader


def first_batch(loop: Any) -> Any:
    """The first batch of a Trainer loop's data (for profiling or capturing before the first step); None if none."""
    loader = loop_loader(loop)
    if loader is None:
        return None
    try:
        return next(iter(loader))
    except (StopIteration, TypeError):
        return None


def batch_args(args: tuple, kwargs: dict) -> tuple[Any, int]:
    """``(batch, batch_idx)`` of a step hook's arguments, however Lightning passed them."""
    batch = args[0] if args else kwargs.get("batch")
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
    return batch, batch_idx


def batch_shapes(tree: Any) -> tuple:
    """What decides whether a batch needs a capture of its own: its structure, shapes and dtypes."""
    leaves, spec = flatten(tree, "batch")
    return (repr(spec), tuple((tuple(t.shape), str(t.dtype)) for t in leaves))


def merge_outputs(values: list[Any]) -> Any:
    """One batch's output from its micro-batches' outputs; the list itself when they don't concatenate."""
    try:
        return merge(values)
    except (TensorTreeError, RuntimeError):  # not tensors, or shapes that differ beyond dim 0
        return values


_CPU = torch.device("cpu")  # where outputs go before they travel pickled


def to_cpu(t: Tensor) -> Tensor:
    """A detached copy on the CPU: what travels pickled between ranks."""
    return t.detach().to(_CPU)
