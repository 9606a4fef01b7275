"""Resuming a fit where it stopped: the training data's order after a restart, and a warning when it cannot match.

A resumed run equals an uninterrupted one when every rank reads the rest of the interrupted epoch in the order the
uninterrupted run would have: the data loader must resume mid-epoch (torchdata's ``StatefulDataLoader``, whose state
Lightning saves in the checkpoint) and its sampler's order must follow from the epoch alone (Lightning's
``DistributedSampler``, seeded, a new order each epoch through ``set_epoch``).
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch import LightningModule, Trainer

_warned = False  # once per process: a run resumes once


def samplers(dataloader: object) -> list[Any]:
    """The loader's sampler and its batch sampler's (Lightning's own lookup: either may hold the order)."""
    found = {id(s): s for s in (getattr(dataloader, "sampler", None),
                                getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)) if s is not None}
    return list(found.values())


def prepare_training_loader(dataloader: object, module: LightningModule | None) -> None:
    """Before Lightning makes the training loader's iterator (its fit loop's ``setup_data``); other loaders pass.

    Lightning sets the sampler's epoch after it made the iterator, which a resumed run keeps for the rest of the
    interrupted epoch: without this, that rest is read in epoch 0's order. Setting the restored epoch first is what the
    uninterrupted run had at that point, and the same value Lightning sets a moment later."""
    trainer = module.trainer if module is not None and module._trainer is not None else None
    if trainer is None or not trainer.training:
        return
    epoch = trainer.fit_loop.epoch_progress.current.processed
    for sampler in samplers(dataloader):
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)
    if trainer.fit_loop.restarting and trainer.fit_loop.epoch_loop.batch_progress.current.ready > 0:
        warn_if_inexact(dataloader, trainer)


def warn_if_inexact(dataloader: object, trainer: Trainer) -> None:
    """Once: a mid-epoch resume whose loader cannot read the rest of the epoch as the interrupted run would have."""
    global _warned
    if _warned:
        return
    done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    why = None
    if not callable(getattr(dataloader, "state_dict", None)):
        why = (f"the training DataLoader ({type(dataloader).__name__}) cannot resume mid-epoch: the rest of epoch "
               f"{trainer.current_epoch} starts again from its first batch instead of batch {done}")
    elif drawn := [s.dataset._sampler for s in samplers(dataloader) if isinstance(s, DistributedSamplerWrapper)
                   and hasattr(s.dataset._sampler, "generator")]:  # a random sampler of its own, behind Lightning's
        why = (f"its sampler ({type(drawn[0]).__name__}, wrapped by Lightning's DistributedSamplerWrapper) draws its "
               "order anew after a restart")
    if why is None:
        return
    _warned = True
    warnings.warn(
        f"Resuming in the middle of epoch {trainer.current_epoch} (after {done} batches), but {why}: the resumed run "
        "will not equal an uninterrupted one. For an exact resume, use torchdata's StatefulDataLoader with Lightning's "
        "sampler (shuffle through `sampler=RandomSampler(dataset)` or `shuffle=True` on a torch DataLoader) and seed "
        "the run (docs/strategy.md, 'Long runs').", stacklevel=2)
