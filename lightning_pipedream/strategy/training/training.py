"""Training with one pipeline over a fit: each batch's :class:`TrainingStep`, the updates it makes through
Lightning's precision plugin, drains, clipping, and the divergence guard that goes over to 1f1b."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.types import STEP_OUTPUT

from lightning_pipedream.runtime.faults.failures import pipeline_failures
from lightning_pipedream.strategy.reporting.logs import LogRecorder
from lightning_pipedream.strategy.setup.checks import refuse_guard_with_unequal_replicas
from lightning_pipedream.strategy.setup.options import PipelineOptions
from lightning_pipedream.strategy.setup.stage_pipeline import StagePipeline, clip_grad_by_norm, make_engine
from lightning_pipedream.strategy.training.divergence import Divergence, DivergenceGuard, DrainedWeights, Staleness
from lightning_pipedream.strategy.training.loss_scale import agreed_step, scaler_of
from lightning_pipedream.strategy.training.training_step import TrainingStep
from lightning_pipedream.strategy.training.updates import PipelineDrain, PipelineUpdates

log = logging.getLogger(__name__)

# Under pipedream, Lightning's per-batch SIGTERM broadcast (a collective over all ranks) runs every this many batches.
SIGTERM_CHECK_EVERY = 32


class Training:
    """What a fit keeps from one batch to the next: the pipeline, its updates, the weights of the last drain, the
    staleness record and the divergence guard. ``options`` change once, if the guard goes over to 1f1b."""

    def __init__(self, options: PipelineOptions, pipeline: StagePipeline, trainer: Trainer, module: LightningModule,
                 precision: Precision, device: torch.device, global_rank: int,
                 optimizers: Callable[[], list[torch.optim.Optimizer]], switched: Divergence | None = None) -> None:
        self.options, self.pipeline, self.module = options, pipeline, module
        self.precision, self.device, self.global_rank = precision, device, global_rank
        self._optimizers = optimizers  # the strategy's, whenever Lightning sets them
        self.updates = PipelineUpdates(list(pipeline.stage.parameters()), optimizers, self._update_now,
                                       before_step=self._before_update)
        self.guard: DivergenceGuard | None = None
        self.switched = switched  # on_divergence: why the run went over to 1f1b, once it has (in any fit)
        self._divergence: Divergence | None = None  # seen in this step's summaries, acted on at the step's end
        self._drained_weights = DrainedWeights()
        self._staleness = Staleness()
        self._token_mean_warned = False
        precision.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        if pipeline.lagged is not None:
            _check_sigterm_every_few_batches(trainer)
        if options.on_divergence is not None:
            refuse_guard_with_unequal_replicas(pipeline.placement)  # a plan's replicas are known only now
            self.guard = DivergenceGuard(options.divergence_factor)
            self._drained_weights.take(pipeline.stage, optimizers())

    def step(self, batch: Any, batch_idx: int) -> STEP_OUTPUT:
        """One training batch: its :class:`TrainingStep`, then what the step's end decides (a drain's staleness and
        weights, or going over to 1f1b)."""
        step = TrainingStep(self.module, batch, batch_idx, pipeline=self.pipeline, updates=self.updates,
                            options=self.options, precision=self.precision, device=self.device,
                            global_rank=self.global_rank, warn_token_mean=not self._token_mean_warned)
        self._token_mean_warned |= step.warned_token_mean
        result = step.run(self._observe if self.guard is not None else None)
        self._staleness.add(self.pipeline.engine.take_staleness())
        if self._divergence is not None:
            self._go_over_to_1f1b(self._divergence)
        elif step.drained:
            self._log_staleness()
            if self.guard is not None and self.guard.healthy:  # else the last healthy drain's stay
                self._drained_weights.take(self.pipeline.stage, self._optimizers())
        return result

    def drain(self) -> None:
        """Finish every minibatch in flight (``pipedream``): afterwards all stages hold final weights. Every rank
        calls it at the same point (they run the same steps and hooks)."""
        if self.options.spec.asynchronous:
            with self.updates.pipeline_grads():
                self.pipeline.engine.drain(self.updates.apply)

    def failed(self) -> None:
        """A step raised (here or on a peer): the stages stopped at different places; drain nothing more."""
        self.updates.forget()
        if self.pipeline.lagged is not None:
            self.pipeline.lagged.forget()

    def _observe(self, loss: float) -> None:
        if self.guard is not None and self._divergence is None:
            self._divergence = self.guard.observe(loss)

    def _update_now(self, optimizer: torch.optim.Optimizer) -> None:
        """One of the pipeline's updates, through the precision plugin: Lightning's hooks, clipping, the step."""
        if scaler_of(self.precision) is not None:  # 16-mixed: every stage skips an overflowing step
            agreed_step(self.precision, optimizer, self.module, self.pipeline.groups.pipeline)
            return
        self.precision.optimizer_step(optimizer, model=self.module, closure=_gradients_ready)

    def _before_update(self, batch_idx: int) -> None:
        """Right before each of the pipeline's updates: sum tied copies, then the stage's replicas' gradients."""
        pipeline = self.pipeline
        if pipeline.finite is not None:
            pipeline.finite.check_gradients(batch_idx)
        if pipeline.graph is not None and pipeline.graph.graph is not None:
            pipeline.graph.graph.before_update()
        if pipeline.ties is not None:
            pipeline.ties.allreduce_grads()
        if pipeline.reducer is not None:
            # Shares of one batch's loss are summed (each pipeline's counts 1/pipelines); PipeDream's 1F1B-RR averages
            # its replicas' minibatches (over those that had one, in a drain's last round).
            pipeline.reducer.reduce(average=pipeline.placement.round_robin and self.options.spec.minibatch_updates)

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_by_norm(self.pipeline, optimizer, clip_val, asynchronous=self.options.spec.asynchronous,
                          device=self.device)

    def _log_staleness(self) -> None:
        """At a drain: every stage's mean and largest weight staleness since the last one, logged on every rank."""
        pipeline = self.pipeline
        mean, largest = self._staleness.take()
        mine = torch.tensor([pipeline.placement.stage_index, mean, largest], dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(pipeline.groups.pipeline))]
        with pipeline_failures(pipeline.placement.stage_index, waiting="the staleness figures' all-gather"):
            dist.all_gather(every, mine, group=pipeline.groups.pipeline)
        for stage, stage_mean, stage_largest in sorted(tuple(t.tolist()) for t in every):
            self.module.log(f"pipeline/staleness_stage{int(stage)}", stage_mean, on_step=True, on_epoch=False)
            self.module.log(f"pipeline/staleness_max_stage{int(stage)}", stage_largest, on_step=True, on_epoch=False)

    def _go_over_to_1f1b(self, divergence: Divergence) -> None:
        """on_divergence='flush': drain, go back to the last drained weights and optimizer state, train on under
        1f1b. Every rank gets here at the same step: they all saw the same losses (the step summaries)."""
        pipeline, module = self.pipeline, self.module
        self.drain()
        self.updates.forget()
        if pipeline.lagged is not None:
            for each in pipeline.lagged.take_all():  # the minibatches that were in flight: logged, not guarded
                LogRecorder.replay(module, each.logs)
        self._drained_weights.restore(pipeline.stage, self._optimizers())
        before = self.options.schedule
        chunks = max(self.options.chunks, self.options.minibatches_per_batch, pipeline.placement.num_stages)
        self.options = dataclasses.replace(self.options, schedule="1f1b", chunks=chunks, vertical_sync=False,
                                           on_divergence=None, minibatches_per_batch=1)
        pipeline.placement = dataclasses.replace(pipeline.placement, asynchronous=False)
        pipeline.lagged = None
        pipeline.engine = make_engine(self.options, pipeline.stage, [pipeline.stage], pipeline.placement,
                                      pipeline.groups, self.device)
        self.switched, self._divergence, self.guard = divergence, None, None
        step = module.trainer.global_step
        if self.global_rank == 0:
            log.warning(
                "PipeDreamStrategy(on_divergence='flush'): %s, at training step %d. Every stage went back to the "
                "weights and optimizer state of the last drain and trains on under schedule='1f1b' (chunks=%d) "
                "instead of %r.", divergence.words(), step, chunks, before)
        module.log("pipeline/switched_to_1f1b", 1.0, on_step=True, on_epoch=False)


def drain_before_callbacks(trainer: Trainer, drain: Callable[[], None],
                           failed: Callable[[BaseException], None]) -> None:
    """The callback that drains the pipeline before any other callback looks at the model (it goes first)."""
    if not any(isinstance(c, PipelineDrain) for c in trainer.callbacks):
        trainer.callbacks.insert(0, PipelineDrain(drain, failed))


def _check_sigterm_every_few_batches(trainer: Trainer) -> None:
    """Lightning broadcasts rank 0's SIGTERM flag before every training batch: a collective over all ranks, which
    would re-synchronize the asynchronous pipeline at each step. Under ``pipedream`` it runs before every
    ``SIGTERM_CHECK_EVERY``-th batch instead (the same batches on every rank), so a SIGTERM (e.g. a cluster's
    preemption notice) stops training within that many steps."""
    epoch_loop = trainer.fit_loop.epoch_loop
    check = getattr(type(epoch_loop), "_broadcast_sigterm_tensor", None)
    if check is None:  # a Lightning version without the per-batch broadcast
        return
    batches = itertools.count()

    def every_few_batches() -> None:
        if next(batches) % SIGTERM_CHECK_EVERY == 0:
            check(epoch_loop)

    epoch_loop._broadcast_sigterm_tensor = every_few_batches  # type: ignore[method-assign]


def _gradients_ready() -> None:
    """The closure of the pipeline's optimizer steps: the gradients are already in ``.grad``."""
    return None
