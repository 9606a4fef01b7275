"""The standalone API: train a pipelined ``nn.Sequential`` with torch.distributed, without Lightning."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipedream.plan.balance import check_balance, check_chunk_count, even_balance, stage_slice
from lightning_pipedream.runtime.communication.transport import Transport, transport_kind
from lightning_pipedream.runtime.execution.engine import PipelineEngine, StepResult
from lightning_pipedream.runtime.execution.shares import BatchShares
from lightning_pipedream.runtime.stages.replicas import ReplicaGroups
from lightning_pipedream.runtime.stages.sharding import ShardedStep, check_shard, full_state, shard_stage
from lightning_pipedream.schedule.actions import Layout
from lightning_pipedream.schedule.builders import check_schedule_options, rank_stages, v_virtual_stages
from lightning_pipedream.schedule.specs import spec_of

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Pipeline:
    """One rank's part of a pipeline-parallel ``nn.Sequential``.

    Every rank builds the same full model, then keeps only its stage's layers. Call
    :meth:`step` on every rank with the same batch: the first stage reads ``inputs``, the last
    stage reads ``targets`` and computes ``loss_fn(output, targets)`` (mean-reduced: the step's
    loss is the mean over the whole batch, as without micro-batches). ``schedule='pipedream'``
    keeps the pipeline full between steps: call :meth:`drain` before reading final weights.

    ``replicas`` (one count per stage, e.g. ``[2, 1]`` on 3 processes, ``[2, 2]`` for two
    data-parallel copies of a 2-stage pipeline) replicates stages: ranks are laid out stage-major
    (:class:`Layout`), every rank gets the step's whole batch, which is split into ``replicas[0]``
    equal shards (one per input replica, as a distributed sampler would) and each shard into
    ``chunks`` micro-batches; a stage's replicas all-reduce their gradients (:class:`ReplicaGroups`).
    Flushed schedules then equal one process training on the whole batch; ``pipedream`` runs
    1F1B-RR, each shard being one minibatch, a replicated stage updating with the mean gradient
    of each round of its replicas' minibatches.

    ``schedule='interleaved'`` with ``virtual_stages=v`` cuts the model into ``processes * v``
    stages (``balance`` then lists that many layer counts); process r holds stages r, r + p, ...
    ``schedule='zb-v'`` and ``'dualpipev'`` cut it into ``2 * processes`` stages in a V: process r holds stages r
    and ``2p-1-r``, so the loss (and ``step``'s returned loss) is on process 0.
    ``schedule='2bw'`` (PipeDream-2BW) keeps the pipeline full like ``pipedream`` (call
    :meth:`drain` before reading weights) but splits each batch into ``chunks`` micro-batches and
    updates once per batch. ``recompute=True`` keeps only each stage's inputs and replays its
    forward in the backward (dropout masks included).

    ``loss_fn`` is a mean over the samples; one that is a mean over something else (a language model's
    labelled tokens, padding left out) gives ``mean_over``, a function counting that in a piece of the
    targets (``lambda t: (t != -100).sum()``): each micro-batch's loss then counts by its share of the
    batch's count, and the step equals one process on the whole batch.

    ``transport``: how ranks on one machine talk: ``"auto"`` (shared memory for CPU tensors over gloo, see
    :mod:`.shared_memory`), ``"gloo"`` (torch.distributed always), ``"shm"``, or ``"directional"`` (the path
    NCCL takes, which GPUs always use: messages to lower ranks on ``reverse_group``, a second group of the same
    ranks; made here when ``group`` is None, to be given with any other ``group``); None reads the environment's
    ``LIGHTNING_PIPEDREAM_TRANSPORT`` (default ``"auto"``). Every rank must choose alike.

    ``shard="full"`` or ``"grad_op"`` (with ``replicas=[d] * stages``) shards each stage over its replicas (FSDP2,
    :mod:`.sharding`). ``param_dtype=torch.bfloat16`` with it is mixed precision the FSDP2 way: each stage gathers
    its parameters in bfloat16 and computes with them, while the float32 shards, their gradients (each
    micro-batch's added in float32, the sum reduce-scattered in float32) and the optimizer state stay float32.
    Run :meth:`step` under ``torch.autocast(device_type, dtype=torch.bfloat16)`` as well, so that the operations
    autocast keeps in float32 (losses, softmax) stay there, as the strategy's ``precision="bf16-mixed"`` does.
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
        replicas: Sequence[int] | None = None,
        recompute: bool | Sequence[bool] = False,
        virtual_stages: int = 1,
        mean_over: Callable[[Any], Any] | None = None,
        transport: str | None = None,
        reverse_group: dist.ProcessGroup | None = None,
        shard: str | None = None,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        # Prebuilt stages (e.g. lightning_pipedream.graph's GraphStage): a list with one module per rank.
        prebuilt = isinstance(layers, (list, tuple))
        if not isinstance(layers, nn.Sequential) and not prebuilt:
            raise TypeError(f"Pipeline needs an nn.Sequential of layers, got {type(layers).__name__}.")
        virtual_stages = v_virtual_stages(schedule, virtual_stages)  # a V schedule's default: its two chunks
        check_schedule_options(schedule, chunks, vertical_sync, virtual_stages=virtual_stages, recompute=recompute)
        if replicas is not None and not spec_of(schedule).unequal_replicas:
            raise ValueError(f"schedule={schedule!r} does not support replicas yet; use replicas=None.")
        if prebuilt and virtual_stages != 1:
            raise ValueError("Prebuilt stage modules run one stage per process; use virtual_stages=1 with them.")
        spec = spec_of(schedule)
        check_shard(shard, schedule, asynchronous=spec.asynchronous, replicas=replicas, param_dtype=param_dtype)
        self.rank = dist.get_rank(group)
        self.num_stages = dist.get_world_size(group)
        self.virtual_stages = virtual_stages
        self.layout = None
        if replicas is not None:
            self.layout = Layout(tuple(replicas))
            self.groups = ReplicaGroups(self.layout, group=group, device_type=torch.device(device).type)
            self.num_stages = self.layout.num_stages
        self.stage_index = self.rank if self.layout is None else self.layout.stage_of(self.rank)
        if prebuilt:
            if len(layers) != self.num_stages or balance is not None:
                raise ValueError(f"Pipeline got {len(layers)} prebuilt stage modules for {self.num_stages} processes "
                                 "(and balance must be None with them); give one module per process.")
            self.balance = [1] * self.num_stages
        else:
            total = self.num_stages * virtual_stages
            if virtual_stages > 1:
                check_chunk_count(len(layers), self.num_stages, virtual_stages, schedule)
            self.balance = (
                check_balance(balance, len(layers), total) if balance is not None else even_balance(len(layers), total)
            )
        self.device = torch.device(device)
        if prebuilt:
            stage = layers[self.stage_index]
        elif virtual_stages > 1:
            # Chunk c of this process is stage c * p + rank (a V: rank, 2p-1-rank); a ModuleList keeps the names.
            mine = rank_stages(schedule, self.num_stages, self.stage_index, virtual_stages)
            stage = nn.ModuleList(stage_slice(layers, self.balance, s) for s in mine)
        else:
            stage = stage_slice(layers, self.balance, self.stage_index)
        self.module = stage.to(self.device)
        self.shard = shard
        if shard is not None:  # before the optimizer: it keeps state for this rank's shards only
            self.module = shard_stage(self.module, self.groups.data_group, shard, self.device, param_dtype)
        self.before_update = before_update  # e.g. TiedParameters.allreduce_grads
        self.schedule = schedule
        self.chunks = chunks
        self.loss_fn = loss_fn
        self.mean_over = mean_over  # what loss_fn averages over, counted in a piece of the targets
        params = [p for p in self.module.parameters() if p.requires_grad]
        # A stage of parameter-free layers (an activation, a reshape) has nothing to optimize.
        self.optimizer = optimizer(params) if params else None
        if reverse_group is None and group is None and _needs_reverse_group(self.device, transport):
            reverse_group = dist.new_group()  # every rank builds its Pipeline alike: this collective is safe
        self.transport = Transport(group=group, device=self.device, kind=transport, reverse_group=reverse_group)
        # Sharded replicas reduce-scatter their gradients in the step's last backward: nothing to all-reduce after.
        self.reducer = None if self.layout is None or shard is not None else self.groups.reducer(params)
        self.engine = PipelineEngine(
            self.module,
            self.stage_index,
            self.num_stages,
            self.transport,
            schedule=schedule,
            chunks=chunks,
            weight_stashing=weight_stashing,
            vertical_sync=vertical_sync,
            record=record,
            replicas=None if self.layout is None else self.layout.replicas,
            rank=self.rank,
            allreduce=_reduced_in_backward if shard is not None else (
                None if self.reducer is None else self.reducer.reduce),
            recompute=recompute,
            virtual_stages=virtual_stages,
            sharded_step=ShardedStep([self.module], self.num_stages, shard, split_backward=spec.splits_backward)
            if shard is not None else None,
        )

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """This process computes the loss: it holds the model's last stage (rank 0 under a V schedule)."""
        return self.stage_index == (0 if spec_of(self.schedule).v_shape else self.num_stages - 1)

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
        d = 1 if self.layout is None else self.layout.input_replicas
        minibatch_updates = d > 1 and self.engine.spec.minibatch_updates
        chunks = 1 if minibatch_updates else self.chunks
        in_parts = BatchShares.of(inputs, chunks, d, minibatch_updates) if self.is_first else None
        tgt_parts = (BatchShares.of(targets, chunks, d, minibatch_updates, mean_over=self.mean_over) if self.is_last
                     else None)

        def loss(mb: int, output: Any) -> Tensor:
            assert tgt_parts is not None
            value = self.loss_fn(output, tgt_parts.part(mb))
            weight = tgt_parts.weight(mb)
            return value * weight if weight != 1.0 else value

        result = self.engine.train_step(lambda mb: in_parts.part(mb), loss, self._update)  # type: ignore[union-attr]
        if not self.is_last:
            return None
        losses = result.losses.values()
        # A replicated pipedream stage's shards are minibatches of their own: the step's loss is their mean.
        return float(sum(losses) / len(losses)) if minibatch_updates and losses else float(sum(losses))

    def drain(self) -> StepResult:
        """Finish the minibatches still in flight (``pipedream``); a no-op for flushed schedules."""
        return self.engine.drain(self._update)

    def state_dict(self) -> dict[str, Tensor]:
        """This stage's parameters and buffers, under the full model's names (sharded ones gathered whole: call it on
        every replica of the stage)."""
        if isinstance(self.module, nn.ModuleList):  # interleaved: every chunk's, under the model's names
            return {k: v for chunk in self.module for k, v in chunk.state_dict().items()}
        return full_state(self.module) if self.shard is not None else self.module.state_dict()


def _needs_reverse_group(device: torch.device, transport: str | None) -> bool:
    """Whether this pipeline's transport sends each direction of a link on a group of its own (see Transport)."""
    nccl = device.type == "cuda" or (dist.is_initialized() and dist.get_backend() == "nccl")
    return nccl or transport_kind(transport) == "directional"


def _reduced_in_backward(average: bool = False) -> None:
    """Sharded replicas: the step's last backward reduce-scattered the gradients already."""
