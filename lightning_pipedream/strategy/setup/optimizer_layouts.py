"""The optimizers' layout over the whole model (checkpoints' single-device form), read only when fitting.

``configure_optimizers`` runs only in ``fit``, as under Lightning's own strategies: a ``trainer.validate()``,
``test()`` or ``predict()`` before any fit (a model loaded from a checkpoint and tested, say) never calls it. It
often cannot: a one-cycle or warm-up scheduler sized by ``self.trainer.estimated_stepping_batches`` reads the
training data, which a test-only data module does not set up. A pipeline built by one of those calls learns the
layout at its first fit instead; the layers of other stages, gone from this rank by then, are kept as
meta-device shadows (no memory) so that ``configure_optimizers`` sees the whole model's parameters, in their
order, as it does before the split.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

from lightning.pytorch import LightningModule
from torch import nn

from lightning_pipedream.strategy.checkpoints.checkpoint import OptimizerLayout
from lightning_pipedream.strategy.setup.checks import optimizers_unvalidated


def layouts_when_fitting(module: LightningModule, fitting: bool) -> list[OptimizerLayout]:
    """The layouts of ``configure_optimizers`` on the whole module when fitting (refusing several optimizers);
    none otherwise: the first fit learns them (:func:`learn_layouts`)."""
    if not fitting:
        return []
    layouts = OptimizerLayout.of_module(module, optimizers_unvalidated)
    if len(layouts) > 1:
        raise ValueError(
            f"{type(module).__name__}.configure_optimizers returns {len(layouts)} optimizers; "
            "PipeDreamStrategy trains with one (automatic optimization, which takes one). Use one optimizer "
            "with a parameter group per part of the model for different learning rates or settings."
        )
    return layouts


def meta_shadow(layer: nn.Module, kept: set[int]) -> nn.Module:
    """A copy of ``layer`` on the meta device, without copying its data; a parameter this rank keeps (``kept``:
    ids, a weight tied to one of its own layers) stays that same object, so the shadow names it as the model did."""
    memo: dict[int, object] = {}
    for p in layer.parameters():
        memo[id(p)] = p if id(p) in kept else nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in layer.buffers():
        memo[id(b)] = b.to("meta")
    return copy.deepcopy(layer, memo)


@contextmanager
def shadows_in_place(layers: nn.Sequential | None) -> Iterator[None]:
    """The other stages' layers back in ``layers`` as their meta shadows (each placeholder's ``shadow``)."""
    if layers is None:
        yield
        return
    placeholders = {name: m for name, m in layers._modules.items() if getattr(m, "shadow", None) is not None}
    for name, placeholder in placeholders.items():
        layers._modules[name] = placeholder.shadow  # type: ignore[union-attr]
    try:
        yield
    finally:
        layers._modules.update(placeholders)


def learn_layouts(module: LightningModule, layers: nn.Sequential | None) -> list[OptimizerLayout]:
    """At the first fit of a pipeline built by ``validate``/``test``/``predict``: the layouts, read with the other
    stages' layers in place as shadows (``layers``: the split Sequential; None on the graph path, whose every rank
    holds the whole module)."""
    with shadows_in_place(layers):
        return layouts_when_fitting(module, fitting=True)
