"""One rank's stage of a model split from its captured forward graph: captures per input shape and mode, ties."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from lightning_pipedream.graph import (
    CapturedGraph,
    GraphSplit,
    GraphStage,
    build_stages,
    call_signature,
    capture,
    split_graph,
)
from lightning_pipedream.runtime.stages.ties import TiedParameters

log = logging.getLogger("lightning_pipedream.graph")


class CapturedStage:
    """This rank's :class:`GraphStage` of ``module``, cut at ``split_points``.

    A capture is specialised to its input shapes and to train/eval mode, so :meth:`ensure` captures
    the model again (on every rank, at the same step: they see the same batches) whenever a call
    with a new signature comes, and adds this stage's program of it. Parameters used by several
    stages (tied embeddings) are held by each of them; :meth:`before_update` sums their gradients.

    Model chunks (interleaved, zb-v, dualpipev): ``chunks`` lists the stages this rank holds (``num_stages`` counts
    them all, ``stage_index`` is then the rank) and ``rank_of_stage`` where each stage lives. :attr:`chunks` are their
    stage modules and :attr:`stage` a ModuleList of them; a parameter tied between chunks of this rank is one
    parameter shared by them (no message), one tied with another rank's chunk is summed over the ranks.
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
        *,
        chunks: Sequence[int] | None = None,
        rank_of_stage: Callable[[int], int] | None = None,
        on_meta: bool = False,
        prepare: Callable[[GraphSplit, list[int]], None] | None = None,
    ) -> None:
        """``on_meta``: capture with shapes only (a model built on the meta device, see capture); ``prepare``: called
        with the split and this rank's stage indices before the stages take their tensors from ``module`` (to
        materialize and load them)."""
        self.through = through  # trace this submodule's call rather than the module's forward (see capture)
        self.on_meta = on_meta
        captured = captured if captured is not None else capture(module, args, kwargs, through, on_meta=on_meta)
        self.capture_s, self.cached = captured.capture_s, captured.cached  # the first capture's cost, for the log
        if stage_index == 0:  # once per run, not once per rank
            log.info("Captured %s's forward call in %.2f s%s.", type(module).__name__, captured.capture_s,
                     " (same module structure as before: from the cache)" if captured.cached else "")
        split = split_graph(captured, split_points)
        if split.num_stages != num_stages:
            who = f"{num_stages} processes run it" if chunks is None else f"{num_stages} model chunks run it"
            raise ValueError(
                f"split_points={split_points} cut the model into {split.num_stages} stages, but {who}; give "
                f"{num_stages - 1} split points."
            )
        self.split_points = list(split_points)
        self.stage_index = stage_index
        own = list(chunks) if chunks is not None else [stage_index]
        if prepare is not None:
            prepare(split, own)
        self.chunks: list[GraphStage] = build_stages(module, split, own)
        self.stage: nn.Module = self.chunks[0] if chunks is None else nn.ModuleList(self.chunks)
        self.ties = dict(split.ties)
        # Every name (aliases included) of the state the graph reads, whichever stage holds it.
        self.graph_state_names = {alias for name in split.owners for alias in captured.aliases.get(name, [name])}
        # Which stages hold each tensor, under every name (aliases included): every rank knows the whole split.
        self.owners = {alias: list(stages) for name, stages in split.owners.items()
                       for alias in captured.aliases.get(name, [name])}
        local = self._share_local_ties(captured.aliases)
        self._attach(module, captured.aliases, local)
        rank_of = rank_of_stage if rank_of_stage is not None else (lambda stage: stage)
        ranks = {rank_of(s) for s in range(num_stages)}
        # A tie between ranks: its copies' gradients are summed over the ranks that hold one (each once).
        rank_ties = {name: sorted({rank_of(s) for s in stages}) for name, stages in split.ties.items()}
        rank_ties = {name: holders for name, holders in rank_ties.items() if len(holders) > 1}
        names = None if chunks is None else {name: f"{i}.{name}" for name, i in local.items()}
        # new_group is collective over all ranks: every rank builds the tie groups, members or not.
        self.tied = TiedParameters(self.stage, rank_ties, stage_index, names=names) if len(ranks) > 1 else None
        self._captured = {(module.training, call_signature(args, kwargs))}

    def _share_local_ties(self, aliases: dict[str, list[str]]) -> dict[str, int]:
        """Each tied parameter this rank holds, and the first of its chunks that holds it: the other chunks that hold
        it take that chunk's copy (one parameter, whose gradient gathers both uses)."""
        local: dict[str, int] = {}
        for name in self.ties:
            holders = [i for i, chunk in enumerate(self.chunks) if name in chunk.owned]
            if not holders:
                continue
            local[name] = holders[0]
            shared = self.chunks[holders[0]].canonical_parameters()[name]
            for i in holders[1:]:
                for alias in aliases.get(name, [name]):
                    self.chunks[i]._container(alias).register_parameter(alias.rsplit(".", 1)[-1], shared)
        return local

    def _attach(self, module: nn.Module, aliases: dict[str, list[str]], local: dict[str, int]) -> None:
        """Make ``module`` use this rank's copy of each tied parameter, so its optimizer updates that copy."""
        for name, chunk in local.items():
            copy = self.chunks[chunk].canonical_parameters()[name]
            for alias in aliases.get(name, [name]):
                owner_path, _, leaf = alias.rpartition(".")
                owner = module.get_submodule(owner_path) if owner_path else module
                owner._parameters[leaf] = copy

    def ensure(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Capture ``module(*args, **kwargs)`` in its current mode if no capture serves that call yet."""
        key = (module.training, call_signature(args, kwargs))
        if key in self._captured:
            return
        split = split_graph(capture(module, args, kwargs, self.through, on_meta=self.on_meta), self.split_points)
        for chunk in self.chunks:
            chunk.add_split(split)
        self._captured.add(key)

    def state_dict(self) -> dict[str, Tensor]:
        """This rank's share of the model's state, under the model's own names (every chunk's)."""
        share: dict[str, Tensor] = {}
        for chunk in self.chunks:
            share.update(chunk.state_dict())
        return share

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters under the model's own names (one entry per parameter, shared ones once)."""
        out: dict[str, nn.Parameter] = {}
        seen: set[int] = set()
        for chunk in self.chunks:
            for name, param in chunk.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    out[name] = param
        return out

    def before_update(self) -> None:
        """Sum the gradients of the tied copies over the stages that hold them (call on every holder)."""
        if self.tied is not None:
            self.tied.allreduce_grads()


