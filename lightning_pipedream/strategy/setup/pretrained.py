"""A model built on the meta device gets real tensors for this rank's stage only: pretrained ones where
``PipeDreamStrategy(pretrained=...)`` names a checkpoint (each rank reads only its own), initialized ones otherwise."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

import torch
from lightning.pytorch import LightningModule

from lightning_pipedream.graph import GraphSplit
from lightning_pipedream.runtime.faults.failures import from_rank_zero
from lightning_pipedream.runtime.stages.loading import (
    PretrainedWeights,
    find_prefix,
    load_own,
    match_names,
    module_names,
)
from lightning_pipedream.runtime.stages.materialize import keep_meta_tensors, materialize
from lightning_pipedream.strategy.setup.options import PipelineOptions

log = logging.getLogger("lightning_pipedream.strategy")


def refuse_pretrained_with_real_weights(options: PipelineOptions, module: LightningModule) -> None:
    """``pretrained=`` fills a model built on the meta device; one built with real weights would silently keep them."""
    if options.pretrained is not None:
        raise ValueError(
            f"PipeDreamStrategy(pretrained=...) loads each stage's weights into a model built on the meta device, "
            f"but {type(module).__name__} was built with real weights. Build it in configure_model (or under "
            "trainer.init_module(empty_init=True)), or load the weights yourself and drop pretrained=."
        )


class StageWeights:
    """Materializes (and loads) one stage of ``module``. Built on every rank alike: it checks the checkpoint's names
    against the whole module from headers alone, so a mismatch stops every rank before anything is read."""

    def __init__(self, options: PipelineOptions, module: LightningModule, device: torch.device) -> None:
        self.module = module
        self.device = device
        # Rank 0's initial seed initializes every layer: the weights do not depend on which rank holds a layer.
        self.seed = int(from_rank_zero("share its random seed", torch.initial_seed))
        self.weights = PretrainedWeights.open(options.pretrained) if options.pretrained is not None else None
        self.source: dict[str, str] = {}
        if self.weights is not None:
            prefix = find_prefix(self.weights.keys(), module, options.pretrained_prefix)
            self.source = match_names(self.weights.keys(), module, prefix)
        self.aliases = module_names(module)
        self.read_bytes = 0
        self.read_s = 0.0  # wall time of materializing and reading this rank's stage

    def of_split(self, split: GraphSplit, stage_indices: Collection[int]) -> None:
        """Materialize the tensors that stages ``stage_indices`` of ``split`` hold (every name of each)."""
        owned = {alias for name, stages in split.owners.items() if set(stages) & set(stage_indices)
                 for alias in split.captured.aliases.get(name, [name])}
        self.of_names(owned)

    def of_names(self, owned: Collection[str] | None) -> None:
        """Materialize the tensors named in ``owned`` (qualified names, aliases included; None: all the module
        still holds) and load the pretrained ones; the rest of the module stays on the meta device."""
        started = time.perf_counter()
        every = owned is None
        owned = {a for names in module_names(self.module).values() for a in names} if owned is None else set(owned)
        firsts = [first for first, names in self.aliases.items() if owned.intersection(names)]
        loaded = {alias for first in firsts if first in self.source for alias in self.aliases[first]}
        materialize(self.module, self.device, self.seed, names=None if every else owned, loaded=loaded)
        if self.weights is not None:
            self.read_bytes = load_own(self.module, self.weights, self.source, firsts)
        self.read_s = time.perf_counter() - started
        if self.weights is not None:
            log.info("PipeDreamStrategy: read %.1f MiB of pretrained weights for this stage from %s in %.2f s.",
                     self.read_bytes / 2**20, self.weights.path, self.read_s)
        keep_meta_tensors(self.module)
