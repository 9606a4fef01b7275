"""Parameters held by several stages (tied embeddings): sum their copies' gradients over a tie group before updates."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipedream.graph.split import get_path


class TiedParameters:
    """One process group per tied parameter, over the ranks of the stages that hold a copy of it.

    Every rank of ``group`` must construct this with the same ``ties`` (``new_group`` is collective over the
    whole group, members or not). :meth:`allreduce_grads`, called on each member right before its optimizer
    step, replaces each copy's gradient by the sum over the copies, so that identical copies with identical
    optimizer states stay bit-identical: the update is what one parameter used in several places receives.
    """

    def __init__(
        self,
        module: nn.Module,
        ties: Mapping[str, Sequence[int]],
        stage_index: int,
        *,
        rank_of_stage: Callable[[int], int] = lambda stage: stage,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.module = module
        self._groups: list[tuple[str, dist.ProcessGroup]] = []
        for name in sorted(ties):  # the same order on every rank
            stages = sorted(ties[name])
            ranks = [rank_of_stage(s) for s in stages]
            if group is not None:
                ranks = [dist.get_global_rank(group, r) for r in ranks]
            tie_group = dist.new_group(ranks)
            if stage_index in stages:
                self._groups.append((name, tie_group))

    @property
    def names(self) -> list[str]:
        """The tied parameters this stage holds a copy of."""
        return [name for name, _ in self._groups]

    def allreduce_grads(self) -> None:
        """Sum each tied parameter's gradient over its copies (a copy without a gradient counts as zero)."""
        for name, tie_group in self._groups:
            param = get_path(self.module, name)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=tie_group)

    def max_difference(self) -> float:
        """The largest difference between this stage's copies and the first copy of each tie (0.0 when identical);
        a check that costs one broadcast per tie."""
        worst = 0.0
        for name, tie_group in self._groups:
            param = get_path(self.module, name).detach()
            first = param.clone()
            dist.broadcast(first, group_src=0, group=tie_group)
            worst = max(worst, float((param - first).abs().max()))
        return worst
