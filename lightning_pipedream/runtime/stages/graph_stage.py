"""One rank's stage of a model split from its captured forward graph: captures per input shape and mode, ties."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from lightning_pipedream.graph import CapturedGraph, GraphStage, build_stages, call_signature, capture, split_graph
from lightning_pipedream.runtime.stages.ties import TiedParameters

log = logging.getLogger("lightning_pipedream.graph")


class CapturedStage:
    """This rank's :class:`GraphStage` of ``module``, cut at ``split_points``.

    A capture is specialised to its input shapes and to train/eval mode, so :meth:`ensure` captures
    the model again (on every rank, at the same step: they see the same batches) whenever a call
    with a new signature comes, and adds this stage's program of it. Parameters used by several
    stages (tied embeddings) are held by each of them; :meth:`before_update` sums their gradients.
    """

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        split_points: list[str],
        args: tuple,
        kwargs: dict[str, Any],
        captured: CapturedGraph | None = None,
        through: str | None = None,
    ) -> None:
        self.through = through  # trace this submodule's call rather than the module's forward (see capture)
        captured = captured if captured is not None else capture(module, args, kwargs, through)
        self.capture_s, self.cached = captured.capture_s, captured.cached  # the first capture's cost, for the log
        if stage_index == 0:  # once per run, not once per rank
            log.info("Captured %s's forward call in %.2f s%s.", type(module).__name__, captured.capture_s,
                     " (same module structure as before: from the cache)" if captured.cached else "")
        split = split_graph(captured, split_points)
        if split.num_stages != num_stages:
            raise ValueError(
                f"split_points={split_points} cut the model into {split.num_stages} stages, but {num_stages} "
                f"processes run it; give {num_stages - 1} split points."
            )
        self.split_points = list(split_points)
        self.stage_index = stage_index
        self.stage: GraphStage = build_stages(module, split, [stage_index])[0]
        self.ties = dict(split.ties)
        # Every name (aliases included) of the state the graph reads, whichever stage holds it.
        self.graph_state_names = {alias for name in split.owners for alias in captured.aliases.get(name, [name])}
        self._attach(module, captured.aliases)
        # new_group is collective over all ranks: every rank builds the tie groups, members or not.
        self.tied = TiedParameters(self.stage, split.ties, stage_index) if num_stages > 1 else None
        self._captured = {(module.training, call_signature(args, kwargs))}

    def _attach(self, module: nn.Module, aliases: dict[str, list[str]]) -> None:
        """Make ``module`` use this stage's copy of each tied parameter, so its optimizer updates that copy."""
        for name in self.ties:
            if self.stage_index not in self.ties[name]:
                continue
            copy = self.stage.canonical_parameters()[name]
            for alias in aliases.get(name, [name]):
                owner_path, _, leaf = alias.rpartition(".")
                owner = module.get_submodule(owner_path) if owner_path else module
                owner._parameters[leaf] = copy

    def ensure(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Capture ``module(*args, **kwargs)`` in its current mode if no capture serves that call yet."""
        key = (module.training, call_signature(args, kwargs))
        if key in self._captured:
            return
        self.stage.add_split(split_graph(capture(module, args, kwargs, self.through), self.split_points))
        self._captured.add(key)

    def before_update(self) -> None:
        """Sum the gradients of the tied copies over the stages that hold them (call on every holder)."""
        if self.tied is not None:
            self.tied.allreduce_grads()

    def tie_copies_held_elsewhere_first(self) -> set[int]:
        """Ids of this stage's tied copies whose first holder is another stage (counted there in a global norm)."""
        params = self.stage.canonical_parameters()
        return {id(params[name]) for name, stages in self.ties.items()
                if self.stage_index in stages and min(stages) != self.stage_index}
