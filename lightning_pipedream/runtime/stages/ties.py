"""Parameters held by several stages (tied embeddings): sum their copies' gradients over a tie group before updates."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipedream.graph.split import get_path
from lightning_pipedream.runtime.faults.failures import pipeline_failures
from lightning_pipedream.runtime.faults.timeouts import group_timeout


class TiedParameters:
    """One process group per tied parameter, over the ranks of the stages that hold a copy of it.

    Every rank of ``group`` must construct this with the same ``ties`` (``new_group`` is collective over the
    whole group, members or not). :meth:`allreduce_grads`, called on each member right before its optimizer
    step, replaces each copy's gradient by the sum over the copies, so that identical copies with identical
    optimizer states stay bit-identical: the update is what one parameter used in several places receives.

    ``names``: where this stage's copy of each tie lives in ``module`` when that differs from the tie's name
    (a Sequential's decoder holds the embedding's weight under its own name).

    Each tie's group carries ``timeout`` (default: the world's, as every group of the pipeline), and each wait runs
    under :func:`~.failures.pipeline_failures`: a holder that never joins ends every rank within the timeout, with
    words naming the tie and the ranks waited for. Under ``pipedream`` the holders reduce minibatch t at different
    steps (the last stage in step t, the first in step t + stages - 1), so the all-reduce spans the batch boundaries
    between: no other blocking collective may be issued there (docs/strategy.md, "Collectives").
    """

    def __init__(
        self,
        module: nn.Module,
        ties: Mapping[str, Sequence[int]],
        stage_index: int,
        *,
        rank_of_stage: Callable[[int], int] = lambda stage: stage,
        group: dist.ProcessGroup | None = None,
        names: Mapping[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        self.module = module
        self._local = dict(names or {})
        self._stage_index = stage_index
        self._groups: list[tuple[str, dist.ProcessGroup]] = []
        self._first_holder: dict[str, int] = {}  # local name -> the first stage holding that tie
        self._others: dict[str, tuple[int, ...]] = {}  # local name -> the other holders' global ranks
        me = dist.get_rank()
        timeout = timeout if timeout is not None else group_timeout()
        for name in sorted(ties):  # the same order on every rank
            stages = sorted(ties[name])
            ranks = [rank_of_stage(s) for s in stages]
            if group is not None:
                ranks = [dist.get_global_rank(group, r) for r in ranks]
            tie_group = dist.new_group(ranks, timeout=timeout)
            if stage_index in stages:
                self._groups.append((self._local.get(name, name), tie_group))
                self._first_holder[self._local.get(name, name)] = stages[0]
                self._others[self._local.get(name, name)] = tuple(r for r in ranks if r != me)

    @property
    def names(self) -> list[str]:
        """The tied parameters this stage holds a copy of (their paths in ``module``)."""
        return [name for name, _ in self._groups]

    def copies(self) -> list[nn.Parameter]:
        """This stage's copies of the tied parameters."""
        return [get_path(self.module, name) for name, _ in self._groups]

    def held_first_elsewhere(self) -> set[int]:
        """Ids of this stage's copies whose first holder is another stage (a whole-model norm counts them there)."""
        return {id(get_path(self.module, name)) for name, _ in self._groups
                if self._first_holder[name] != self._stage_index}

    def allreduce_grads(self) -> None:
        """Sum each tied parameter's gradient over its copies (a copy without a gradient counts as zero)."""
        for name, tie_group in self._groups:
            param = get_path(self.module, name)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            others = self._others[name]
            with pipeline_failures(self._stage_index, waiting=self._words("all-reduce", name), peers=others):
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=tie_group)

    def max_difference(self) -> float:
        """The largest difference between this stage's copies and the first copy of each tie (0.0 when identical);
        a check that costs one broadcast per tie."""
        worst = 0.0
        for name, tie_group in self._groups:
            param = get_path(self.module, name).detach()
            first = param.clone()
            others = self._others[name]
            with pipeline_failures(self._stage_index, waiting=self._words("broadcast", name), peers=others):
                dist.broadcast(first, group_src=0, group=tie_group)
            worst = max(worst, float((param - first).abs().max()))
        return worst

    def _words(self, collective: str, name: str) -> str:
        """``"the tied weight 'decoder.weight''s all-reduce with ranks [0]"``: what a wait's error names."""
        return f"the tied weight {name!r}'s {collective} with rank{'s' if len(self._others[name]) > 1 else ''} " \
               f"{', '.join(map(str, self._others[name]))}"
