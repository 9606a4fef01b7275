"""What one Lightning training batch becomes in the pipeline: its shares, the engine's inputs and losses, its data
record, the logs replayed from the last stage, and the result Lightning gets."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor

from lightning_pipedream.runtime.execution.shares import BatchShares
from lightning_pipedream.strategy.reporting.consistency import (
    CHECK_EVERY,
    CHECK_EVERY_ASYNC,
    batch_record,
    check_epoch_start,
    is_due,
)
from lightning_pipedream.strategy.reporting.logs import LogRecorder
from lightning_pipedream.strategy.reporting.summaries import StepSummary
from lightning_pipedream.strategy.setup.batches import to_cpu
from lightning_pipedream.strategy.setup.calls import explaining_meta_calls, loss_of
from lightning_pipedream.strategy.setup.labels import labelled_token_counter
from lightning_pipedream.strategy.setup.options import PipelineOptions
from lightning_pipedream.strategy.setup.stage_pipeline import StagePipeline
from lightning_pipedream.strategy.training.loss_scale import scaled
from lightning_pipedream.strategy.training.updates import PipelineUpdates
from lightning_pipedream.tree import map_tensors

TOKEN_MEAN_ADVICE = (
    "A loss that is a mean over each micro-batch's tokens (cross_entropy with ignore_index=-100, Hugging Face models) "
    "then weighs tokens unequally and differs from one device. PipeDreamStrategy weighs each micro-batch by its "
    "labelled tokens itself when it sees the labels: passed to the model as labels= (self.model(input_ids=..., "
    "labels=...)), or a dict batch's 'labels'; here it sees neither. Pass the labels so, or pass "
    "PipeDreamStrategy(mean_over=...) a function counting a batch's labelled tokens, e.g. mean_over=lambda batch: "
    "(batch[1] != -100).sum(), to weigh each micro-batch by its tokens (exact). A loss that is a mean over samples "
    "needs nothing."
)


class TrainingStep:
    """One training batch on this rank, built when Lightning hands it over.

    :meth:`run` admits the batch's minibatches into the updates, runs this rank's actions of the step (and a drain
    at the end of the data under ``pipedream``), shares the last stage's summary with every rank, replays its logs
    and returns what Lightning expects of a step. ``observe`` sees every training loss that arrives (the divergence
    guard); ``warn_token_mean`` is false once the token-mean warning was given.
    """

    def __init__(self, module: LightningModule, batch: Any, batch_idx: int, *, pipeline: StagePipeline,
                 updates: PipelineUpdates, options: PipelineOptions, precision: Precision, device: torch.device,
                 global_rank: int, warn_token_mean: bool = False) -> None:
        self.module, self.batch, self.batch_idx = module, batch, batch_idx
        self.pipeline, self.updates, self.options = pipeline, updates, options
        self.precision, self.device, self.global_rank = precision, device, global_rank
        trainer = module.trainer
        epoch_loop = trainer.fit_loop.epoch_loop
        self.closes_group = not epoch_loop._should_accumulate()  # Lightning steps the optimizer after this batch
        self.end_of_data = epoch_loop._num_ready_batches_reached()
        self.last_step = self.closes_group and 0 < trainer.max_steps <= trainer.global_step + 1
        self.drained = options.spec.asynchronous and (self.end_of_data or self.last_step)
        self.record = self._data_record()
        self.shares = self._shares()
        self.warned_token_mean = warn_token_mean and self._warn_if_token_means_differ()
        # As Lightning divides the loss of each accumulated batch; and each pipeline's loss counts 1/pipelines in
        # the replicas' summed gradient.
        self.scale = 1.0 / (trainer.accumulate_grad_batches * pipeline.placement.num_pipelines)
        self.logs = LogRecorder()
        self.outputs: list[Any] = []
        self.loss_sum = 0.0
        # minibatches_per_batch: the batch's minibatches, numbered from ``first`` by the engine, from 0 by the shares.
        several = options.minibatches_per_batch > 1
        self.minibatches = len(self.shares.parts) if several else 1
        self.first = pipeline.engine.next_minibatch if several else 0

    # -- what the engine calls -------------------------------------------------------------------------------
    def inputs(self, mb: int) -> Any:
        """Micro-batch ``mb``'s input to the first stage."""
        return self.pipeline.call.input_of(self.module, "training_step", self.shares.part(mb - self.first),
                                           self.batch_idx)

    def loss(self, mb: int, output: Any) -> Tensor:
        """On the last stage: the user's ``training_step`` on micro-batch ``mb`` with the pipeline's ``output``
        replayed into it, its logs captured, its loss weighted by the micro-batch's share."""
        mb -= self.first
        shares, module = self.shares, self.module
        logged = self.logs.capture(module, shares.log_weight(mb), shares.size(mb))
        with self.pipeline.call.replaying(module, output), logged, explaining_meta_calls(module, "training_step"):
            step_output = module.training_step(shares.part(mb), self.batch_idx)
        value = loss_of(step_output)
        # Detached: the loss's graph goes with its backward. (Kept whole, a split backward's weight half, which never
        # reaches the loss, left every micro-batch's loss tensors, such as its log-probabilities, until the step's end.)
        self.outputs.append(map_tensors(Tensor.detach, step_output))
        self.loss_sum += float(value.detach()) * shares.share(mb)
        weight = shares.weight(mb) * self.scale
        return scaled(value * weight if weight != 1.0 else value, self.precision)  # 16-mixed

    # -- the step --------------------------------------------------------------------------------------------
    def run(self, observe: Callable[[float], None] | None = None) -> STEP_OUTPUT:
        """This rank's part of the step; returns Lightning's step output (a NaN loss while the pipeline fills)."""
        pipeline, updates, module = self.pipeline, self.updates, self.module
        if pipeline.graph is not None:
            pipeline.graph.ensure_captured(module, "training_step", self.shares.parts, self.batch_idx)
        pipeline.step_context = f"training step {self.batch_idx} of epoch {module.trainer.current_epoch}"
        for minibatch in self._admitted_here(pipeline.engine.next_minibatch):
            updates.admit(minibatch, self.batch_idx, self.closes_group)
        # A batch with fewer samples than chunks (an epoch's last) runs one micro-batch per sample.
        micro_batches = len(self.shares.parts) if self.shares.shards == 1 and self.minibatches == 1 else None
        with self.precision.train_step_context(), updates.pipeline_grads():
            pipeline.engine.train_step(self.inputs, self.loss, updates.apply, micro_batches, self.minibatches)
            if self.drained:
                # Every stage finishes its minibatches before the epoch's end hooks, validation and checkpoints.
                pipeline.engine.drain(updates.apply)
        return self._result(observe)

    def _result(self, observe: Callable[[float], None] | None) -> STEP_OUTPUT:
        """Share the step's loss, extra outputs and logs from the last stage with every rank (pipedream: the
        summary of the minibatch that finished), log them, and return what Lightning expects of a step."""
        pipeline, module = self.pipeline, self.module
        summary = None
        if pipeline.placement.is_last_stage:  # a replica of a replicated last stage may own none of the step's
            last = self.outputs[-1] if self.outputs else None
            extra = {}
            if isinstance(last, Mapping):
                extra = {k: map_tensors(to_cpu, v) for k, v in last.items() if k != "loss"}
            summary = StepSummary(self.loss_sum, extra, self.logs.aggregate())
        if pipeline.lagged is not None:  # pipedream: minibatch t's summary is used at step t + stages - 1
            summaries = pipeline.lagged.step(summary, self.record)
            if self.end_of_data or self.last_step:
                summaries += pipeline.lagged.take_all()
        else:
            summaries = [pipeline.summary.exchange(summary, self.record)]
        for each in summaries:
            LogRecorder.replay(module, each.logs)
            if observe is not None:
                observe(each.loss)
        if not summaries:  # the pipeline is filling: no minibatch has finished since the last drain
            return torch.tensor(float("nan"), device=self.device, requires_grad=True)
        newest = summaries[-1]
        loss_tensor = torch.tensor(newest.loss, device=self.device, requires_grad=True)
        return {"loss": loss_tensor, **newest.extra} if newest.extra else loss_tensor

    # -- built with the step ---------------------------------------------------------------------------------
    def _shares(self) -> BatchShares:
        """The batch's micro-batches and their loss weights (see :class:`BatchShares`): by what ``mean_over`` counts,
        else by the labelled tokens where the labels are visible (strategy/setup/labels.py), else by samples."""
        options, placement = self.options, self.pipeline.placement
        mean_over = options.mean_over or labelled_token_counter(self.module, self.pipeline.call, "training_step",
                                                                self.batch, self.batch_idx)
        k = options.minibatches_per_batch
        if k > 1:  # each piece a minibatch of its own: its loss counts fully in its own update
            return BatchShares.of(self.batch, k, minibatch_updates=True, fewer_if_small=True, mean_over=mean_over)
        return BatchShares.of(self.batch, options.chunks, placement.input_shards,
                              minibatch_updates=placement.round_robin and options.spec.minibatch_updates,
                              fewer_if_small=True, mean_over=mean_over)

    def _warn_if_token_means_differ(self) -> bool:
        """Warn (on rank 0) when the micro-batches hold labelled tokens unevenly; whether it warned."""
        counts = self.shares.unequal_labelled_tokens() if self.global_rank == 0 else None
        if counts is None:
            return False
        rank_zero_warn(
            f"PipeDreamStrategy: this batch's labels leave out padding (-100) unevenly: its micro-batches hold "
            f"{list(counts)} labelled tokens for {list(self.shares.sizes)} samples. {TOKEN_MEAN_ADVICE}"
        )
        return True

    def _admitted_here(self, first: int) -> list[int]:
        """The minibatches of this step whose updates this rank will make: the step's one (its ``minibatches``
        under ``minibatches_per_batch``), or under 1F1B-RR pipedream those of the step's ``d`` minibatches that
        this rank's replica owns (m % replicas)."""
        placement = self.pipeline.placement
        layout = placement.layout
        if layout is None or not self.options.spec.minibatch_updates:
            return list(range(first, first + self.minibatches))
        r = layout.replicas[placement.stage_index]
        return [m for m in range(first, first + layout.input_replicas) if m % r == placement.replica_index]

    def _data_record(self) -> Tensor | None:
        """The batch's fingerprint for the data check (strategy/reporting/consistency.py), sent with the step's
        summary; None on the steps that skip it. At an epoch's first batch every rank of the pipeline compares them at
        once."""
        pipeline = self.pipeline
        placement = pipeline.placement
        if placement.num_stages == 1:
            return None
        trainer = self.module.trainer
        batches = float(trainer.num_training_batches)
        due = is_due(self.batch_idx, batches, CHECK_EVERY_ASYNC if pipeline.lagged is not None else CHECK_EVERY)
        if not due and self.batch_idx != 0:
            return None
        record = batch_record(self.batch, self.global_rank, placement.stage_index, trainer.current_epoch,
                              self.batch_idx, batches, self.end_of_data)
        if self.batch_idx == 0:
            check_epoch_start(record, pipeline.groups.pipeline, self.device, placement.stage_index)
        return record if due else None
