"""The standalone API: train a pipelined ``nn.Sequential`` with torch.distributed, without Lightning."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipedream.plan.balance import check_balance, even_balance, stage_slice
from lightning_pipedream.runtime.engine import PipelineEngine, StepResult
from lightning_pipedream.runtime.microbatch import batch_size, split
from lightning_pipedream.runtime.transport import Transport
from lightning_pipedream.schedule.builders import check_schedule_options

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Pipeline:
    """One rank's part of a pipeline-parallel ``nn.Sequential``.

    Every rank builds the same full model, then keeps only its stage's layers. Call
    :meth:`step` on every rank with the same batch: the first stage reads ``inputs``, the last
    stage reads ``targets`` and computes ``loss_fn(output, targets)`` (mean-reduced: the step's
    loss is the mean over the whole batch, as without micro-batches). ``schedule='pipedream'``
    keeps the pipeline full between steps: call :meth:`drain` before reading final weights.
    """

    def __init__(
        self,
        layers: nn.Sequential | Sequence[nn.Module],
        *,
        loss_fn: Callable[[Any, Any], Tensor],
        optimizer: OptimizerFactory,
        balance: Sequence[int] | None = None,
        schedule: str = "1f1b",
        chunks: int = 1,
        weight_stashing: bool = True,
        vertical_sync: bool = False,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        record: bool = False,
        before_update: Callable[[], None] | None = None,
    ) -> None:
        # Prebuilt stages (e.g. lightning_pipedream.graph's GraphStage): a list with one module per rank.
        prebuilt = isinstance(layers, (list, tuple))
        if not isinstance(layers, nn.Sequential) and not prebuilt:
            raise TypeError(f"Pipeline needs an nn.Sequential of layers, got {type(layers).__name__}.")
        check_schedule_options(schedule, chunks, vertical_sync)
        self.rank = dist.get_rank(group)
        self.num_stages = dist.get_world_size(group)
        if prebuilt:
            if len(layers) != self.num_stages or balance is not None:
                raise ValueError(f"Pipeline got {len(layers)} prebuilt stage modules for {self.num_stages} processes "
                                 "(and balance must be None with them); give one module per process.")
            self.balance = [1] * self.num_stages
        else:
            self.balance = (
                check_balance(balance, len(layers), self.num_stages)
                if balance is not None
                else even_balance(len(layers), self.num_stages)
            )
        self.device = torch.device(device)
        stage = layers[self.rank] if prebuilt else stage_slice(layers, self.balance, self.rank)
        self.module = stage.to(self.device)
        self.before_update = before_update  # e.g. TiedParameters.allreduce_grads
        self.schedule = schedule
        self.chunks = chunks
        self.loss_fn = loss_fn
        params = [p for p in self.module.parameters() if p.requires_grad]
        # A stage of parameter-free layers (an activation, a reshape) has nothing to optimize.
        self.optimizer = optimizer(params) if params else None
        self.transport = Transport(group=group, device=self.device)
        self.engine = PipelineEngine(
            self.module,
            self.rank,
            self.num_stages,
            self.transport,
            schedule=schedule,
            chunks=chunks,
            weight_stashing=weight_stashing,
            vertical_sync=vertical_sync,
            record=record,
        )

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.num_stages - 1

    def _update(self, minibatch: int) -> None:
        if self.before_update is not None:
            self.before_update()
        if self.optimizer is None:
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, inputs: Any, targets: Any = None) -> float | None:
        """Train on one batch; returns the batch's loss on the last stage (None elsewhere).

        For ``pipedream`` the returned loss is that of this batch's minibatch, whose forward
        finishes on the last stage within the step; its backward on earlier stages, and their
        updates, happen over the next steps.
        """
        chunks = self.chunks
        in_parts = split(inputs, chunks) if self.is_first else None
        tgt_parts = split(targets, chunks) if self.is_last else None
        total = batch_size(targets) if self.is_last else 1
        sizes = [batch_size(t) for t in tgt_parts] if tgt_parts is not None else []

        def micro(mb: int) -> int:  # flushed schedules number micro-batches 0..chunks-1 in a step
            return mb if self.schedule != "pipedream" else 0

        def loss(mb: int, output: Any) -> Tensor:
            assert tgt_parts is not None
            value = self.loss_fn(output, tgt_parts[micro(mb)])
            return value * (sizes[micro(mb)] / total) if chunks > 1 else value

        result = self.engine.train_step(lambda mb: in_parts[micro(mb)], loss, self._update)  # type: ignore[index]
        return float(sum(result.losses.values())) if self.is_last else None

    def drain(self) -> StepResult:
        """Finish the minibatches still in flight (``pipedream``); a no-op for flushed schedules."""
        return self.engine.drain(self._update)

    def state_dict(self) -> dict[str, Tensor]:
        """This stage's parameters and buffers, under the full model's names."""
        return self.module.state_dict()
