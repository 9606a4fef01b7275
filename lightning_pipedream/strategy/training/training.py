"""Training with one pipeline over a fit: each batch's :class:`TrainingStep`, the updates it makes through
Lightning's precision plugin, drains, clipping, the divergence guard that goes over to 1f1b, and the stop that a
SIGTERM asks for (at the same step on every rank, see ``stop_signal.py``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.types import STEP_OUTPUT

from lightning_pipedream.runtime.execution.layer_clock import LayerClock
from lightning_pipedream.runtime.faults.failures import pipeline_failures
from lightning_pipedream.schedule.merged_trace import merged_chrome_trace
from lightning_pipedream.strategy.reporting.collectives import inside_step
from lightning_pipedream.strategy.reporting.explanation import explain_fit, fit_minibatches, measured_ranks
from lightning_pipedream.strategy.reporting.live_memory import WindowMemory, stage_tensors
from lightning_pipedream.strategy.reporting.logs import LogRecorder
from lightning_pipedream.strategy.reporting.stage_figures import (
    TRACE_FILE,
    StageFigures,
    check_trace_dir,
    predicted_events,
    rank_trace,
    simulated_bubble,
)
from lightning_pipedream.strategy.reporting.stop_signal import install as install_stop_requests
from lightning_pipedream.strategy.setup.calls import SequentialCall
from lightning_pipedream.strategy.setup.checks import refuse_guard_with_unequal_replicas
from lightning_pipedream.strategy.setup.options import PipelineOptions
from lightning_pipedream.strategy.setup.sequential_memory import sequential_predicted_memory
from lightning_pipedream.strategy.setup.stage_pipeline import StagePipeline, clip_grad_by_norm, make_engine
from lightning_pipedream.strategy.training.divergence import Divergence, DivergenceGuard, DrainedWeights, Staleness
from lightning_pipedream.strategy.training.loss_scale import agreed_step, scaler_of
from lightning_pipedream.strategy.training.training_step import TrainingStep
from lightning_pipedream.strategy.training.updates import PipelineDrain, PipelineUpdates

log = logging.getLogger(__name__)


class Training:
    """What a fit keeps from one batch to the next: the pipeline, its updates, the weights of the last drain, the
    staleness record and the divergence guard. ``options`` change once, if the guard goes over to 1f1b."""

    def __init__(self, options: PipelineOptions, pipeline: StagePipeline, trainer: Trainer, module: LightningModule,
                 precision: Precision, device: torch.device, global_rank: int,
                 optimizers: Callable[[], list[torch.optim.Optimizer]], switched: Divergence | None = None,
                 timeout: timedelta | None = None) -> None:
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
        # Lightning's SIGTERM broadcasts replaced by point-to-point flags (none in a single process).
        self.stop = install_stop_requests(trainer, pipeline, device, pipeline.placement.stage_index, timeout)
        if options.trace_dir is not None and global_rank == 0:
            check_trace_dir(options.trace_dir)
        self.figures = stage_figures(options, pipeline, trainer, device, global_rank, optimizers())
        pipeline.engine.transport.clock_offset = self.figures.offset  # messages carry their send's start on one clock
        self._steps_run = 0  # training steps of this fit (the trace window counts them)
        self._samples = 0  # samples of those steps' batches (the explanation's minibatches of the plan per step)
        # Each layer's forward, timed in the traced steps only (plan --from-trace finds a slow layer); not on CUDA,
        # where the host clock reads launches.
        self.layer_clock = LayerClock(pipeline.stage) if options.trace_dir is not None and device.type != "cuda" \
            and isinstance(pipeline.call, SequentialCall) else None
        self._timed_steps = 0
        # The stage's live tensor bytes over the traced window, beside the memory model's prediction.
        self.memory = window_memory(options, pipeline, device, optimizers)
        if self.memory is not None:
            self.figures.live_peak = lambda: self.memory.peak if self.memory is not None else math.nan
        self.measured: list[dict[str, Any]] = []  # rank 0, at the fit's end: every rank's mean step, by part
        pipeline.engine.executor.record = False  # only the window's training steps (never evaluation)
        pipeline.engine.executor.records, pipeline.engine.executor.sent_at = [], []  # a fit's own (kept after it)
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
        traced = self._traced(self._steps_run)
        self.pipeline.engine.executor.record = traced
        if traced and self.layer_clock is not None:
            self.layer_clock.start()
        self.figures.begin_step()
        if self.memory is not None:
            self.memory.begin_step(self._steps_run)
        try:
            with inside_step("training_step"):  # a collective of Lightning's in the user's step is refused in words
                result = step.run(self._observe if self.guard is not None else None)
        finally:
            if self.memory is not None:
                self.memory.end_step()
        self.pipeline.engine.executor.record = False
        if traced and self.layer_clock is not None:
            self.layer_clock.stop()
            self._timed_steps += 1
        self.figures.end_step(self.module.trainer.global_step)
        self._steps_run += 1
        self._samples += step.shares.total
        self._staleness.add(self.pipeline.engine.take_staleness())
        if self._divergence is not None:
            self._go_over_to_1f1b(self._divergence)
        elif step.drained:
            self._log_staleness()
            if self.guard is not None and self.guard.healthy:  # else the last healthy drain's stay
                self._drained_weights.take(self.pipeline.stage, self._optimizers())
        if self.stop is not None and self.stop.after_step():
            self._stop_for_sigterm()
        return result

    def _stop_for_sigterm(self) -> None:
        """Rank 0 was asked to end: every rank is at the end of this same step. Drain, log what is pending, and raise
        Lightning's ``SIGTERMException`` here, on every rank alike (Lightning's own handling of it follows)."""
        self.drain()
        if self.pipeline.lagged is not None:
            for each in self.pipeline.lagged.take_all():
                LogRecorder.replay(self.module, each.logs)
        trainer = self.module.trainer
        trainer._signal_connector.received_sigterm = True
        if self.global_rank == 0:
            log.warning("PipeDreamStrategy: SIGTERM received; training stops on every rank at training step %d "
                        "(batch %d of epoch %d), after draining the pipeline.", trainer.global_step,
                        trainer.fit_loop.epoch_loop.batch_idx, trainer.current_epoch)
        raise SIGTERMException()

    def drain(self) -> None:
        """Finish every minibatch in flight (``pipedream``): afterwards all stages hold final weights. Every rank
        calls it at the same point (they run the same steps and hooks)."""
        if self.options.spec.asynchronous:
            with self.updates.pipeline_grads():
                self.pipeline.engine.drain(self.updates.apply)

    def finish(self) -> None:
        """Where every rank ends the fit normally (``on_train_end``, drained): the summaries still pending (training
        stopped between drains, should_stop: delivered, too late to log), the SIGTERM flags still in flight, the last
        steps' figures (they reach rank 0, which logs them) and, with ``trace``, every rank's recorded actions, which
        rank 0 writes as one trace."""
        if self.pipeline.lagged is not None:
            self.pipeline.lagged.take_all()
        if self.stop is not None:
            self.stop.settle()
        self.figures.finish(self.module.trainer.global_step)
        if self.memory is not None:
            log.info("PipeDreamStrategy: stage %d's live tensor peak over the traced steps: %s",
                     self.pipeline.placement.stage_index, self.memory.where())
        if self.global_rank == 0:  # the plan's prediction against the measured steps (strategy.explanation)
            placement = self.pipeline.placement
            per_step = fit_minibatches(self._plan(), placement.num_stages, self._samples / max(1, self._steps_run),
                                       self.options.minibatches_per_batch,
                                       placement.layout.replicas if placement.layout is not None else None)
            self.measured = measured_ranks(self.figures.totals, per_step, self.figures.predicted_bytes)
            self.module.trainer.strategy.explanation = explain_fit(self._plan(), self.measured)
        if self.options.trace_dir is not None:
            self._write_trace()

    def _plan(self) -> Any:
        return getattr(self.module.trainer.strategy, "plan", None)

    def _traced(self, step: int) -> bool:
        if self.options.trace_dir is None:
            return False
        window = self.options.trace_steps
        return window is None or window[0] <= step < window[0] + window[1]

    def _write_trace(self) -> None:
        pipeline, figures, options = self.pipeline, self.figures, self.options
        executor = pipeline.engine.executor
        placement = pipeline.placement
        layers = self.layer_clock.per_step(self._timed_steps) if self.layer_clock is not None else None
        mine = rank_trace(executor.records, executor.sent_at, self.global_rank, placement.stage_index,
                          placement.replica_index, figures.offset, pipeline.engine.transport.global_rank, layers)
        traces = figures.gather_traces(mine)
        if traces is None:
            return
        timed = {t.rank: t.layers for t in traces if t.layers}  # plan --from-trace scales the slow layers alone
        measured = [m | {"layer_forward": timed[m["rank"]]} if m["rank"] in timed else m for m in self.measured]
        window = options.trace_steps
        steps = self._steps_run if window is None else max(0, min(window[1], self._steps_run - window[0]))
        notes = []
        if window is not None and window[0] + window[1] > self._steps_run:
            notes.append(f"trace_steps={window} asked for steps {window[0]} to {window[0] + window[1] - 1}, but the "
                         f"fit ran {self._steps_run} training steps: the trace holds {steps} of them.")
        predicted, source = [], ""
        if steps and placement.layout is None:
            try:
                held = [float(m.get("minibatches_per_step", 1.0)) for m in self.measured]
                predicted, source = predicted_events(options.schedule, placement.num_stages, options.chunks,
                                                     options.virtual_stages, steps, traces, self._plan(),
                                                     sum(held) / len(held) if held else 1.0)
            except Exception as err:  # the ghost track is a help, never a reason to lose the measured trace
                notes.append(f"no predicted timeline: {err}")
        plan = self._plan()
        trace = merged_chrome_trace(traces, predicted, {"schedule": options.schedule, "steps": steps,
                                                        "predicted_from": source, "notes": notes,
                                                        # the whole fit's means, and the plan: `show --trace` explains
                                                        # the run, `plan --from-trace` plans again from them
                                                        "measured": measured,
                                                        "plan": None if plan is None else plan.to_json()})
        path = os.path.join(options.trace_dir, TRACE_FILE)
        with open(path, "w") as f:
            json.dump(trace, f)
        check = trace["metadata"]["clock_check"]
        if check["receives_before_their_send"]:
            log.warning("PipeDreamStrategy trace: %d of %d receives end before their send began (by up to %.3f ms): "
                        "the ranks' clocks are not aligned that well.", check["receives_before_their_send"],
                        check["messages"], -check["worst_s"] * 1e3)
        for note in notes:
            log.warning("PipeDreamStrategy trace: %s", note)
        log.info("PipeDreamStrategy: the merged trace of %d ranks is in %s", len(traces), path)

    def failed(self) -> None:
        """A step raised (here or on a peer): the stages stopped at different places; drain nothing more."""
        self.figures.forget()
        self.updates.forget()
        if self.pipeline.lagged is not None:
            self.pipeline.lagged.forget()
        if self.stop is not None:
            self.stop.forget()

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
        pipeline.engine.executor.accounts = self.figures.accounts  # the figures go on over the new engine
        self.switched, self._divergence, self.guard = divergence, None, None
        step = module.trainer.global_step
        if self.global_rank == 0:
            log.warning(
                "PipeDreamStrategy(on_divergence='flush'): %s, at training step %d. Every stage went back to the "
                "weights and optimizer state of the last drain and trains on under schedule='1f1b' (chunks=%d) "
                "instead of %r.", divergence.words(), step, chunks, before)
        module.log("pipeline/switched_to_1f1b", 1.0, on_step=True, on_epoch=False)


def stage_figures(options: PipelineOptions, pipeline: StagePipeline, trainer: Trainer, device: torch.device,
                  global_rank: int, optimizers: list[torch.optim.Optimizer] | None = None) -> StageFigures:
    """This rank's :class:`StageFigures` over the engine's accounts; rank 0 logs through the Trainer's loggers, with
    each stage's predicted peak memory where the memory model gives one (the graph path's, or on rank 0 for one
    nn.Sequential from its profile: ``setup/sequential_memory.py``; ``optimizers``: the kind of state it counts)."""
    placement = pipeline.placement
    graph = pipeline.graph
    plan = getattr(trainer.strategy, "plan", None)
    memory = graph.predicted_memory if graph is not None else None
    if graph is None and global_rank == 0:  # one nn.Sequential: the memory model on its profile (rank 0 logs)
        memory = sequential_predicted_memory(options, placement, plan, getattr(trainer.strategy, "balance", None),
                                             optimizers or [], device, trainer.accumulate_grad_batches > 1)
    predicted = [float(m["predicted_peak_bytes"]) for m in memory] if memory is not None else None
    simulated = None
    if placement.layout is None:
        simulated = simulated_bubble(options.schedule, placement.num_stages, options.chunks, options.virtual_stages,
                                     plan)
    replicas = placement.num_pipelines > 1 or placement.layout is not None
    figures = StageFigures(pipeline.engine.accounts, rank=global_rank, world_size=placement.world_size,
                           stage=placement.stage_index, replica=placement.replica_index,
                           every=trainer.log_every_n_steps, device=device, replicas=replicas,
                           enabled=options.log_figures, predicted_bytes=predicted, simulated=simulated,
                           timeout=getattr(trainer.strategy, "_timeout", None))
    if global_rank == 0:
        figures.loggers = list(trainer.loggers)
        figures.progress_bar = _progress_bar_of(trainer)
    return figures


def _progress_bar_of(trainer: Any) -> Callable[[str, float], None] | None:
    """What puts a figure beside the loss in ``trainer``'s progress bar. Lightning gives a strategy no public way:
    this writes into the dict its progress bar reads (``trainer.progress_bar_metrics``; a fit starts it empty, and a
    module's own ``self.log(..., prog_bar=True)`` values are merged into it). None where that dict is not there (a
    Lightning that keeps it elsewhere): the bar then goes without, the loggers still get every figure."""
    connector = getattr(trainer, "_logger_connector", None)
    if not isinstance(getattr(connector, "_progress_bar_metrics", None), dict):
        return None

    def show(name: str, value: float) -> None:
        connector._progress_bar_metrics[name] = value

    return show


def window_memory(options: PipelineOptions, pipeline: StagePipeline, device: torch.device,
                  optimizers: Callable[[], list[torch.optim.Optimizer]]) -> WindowMemory | None:
    """With ``trace=`` and ``trace_memory=True``, the meter of the stage's live tensor bytes over the traced window
    (``live_memory.py``); an asynchronous schedule's meter starts ``stages - 1`` steps early, so that the activations
    in flight at the window's start were made under it."""
    if options.trace_dir is None or not options.trace_memory:
        return None
    window = options.trace_steps
    first, count = (0, None) if window is None else window
    lead = pipeline.placement.num_stages - 1 if options.spec.asynchronous else 0
    weights = getattr(pipeline.engine, "weights", None)
    return WindowMemory(stage_tensors([pipeline.stage], optimizers, weights), first, count, lead, device.type,
                        stages=pipeline.engine.stages.values(), optimizers=optimizers)


def drain_before_callbacks(trainer: Trainer, drain: Callable[[], None],
                           failed: Callable[[BaseException], None]) -> None:
    """The callback that drains the pipeline before any other callback looks at the model (it goes first)."""
    if not any(isinstance(c, PipelineDrain) for c in trainer.callbacks):
        trainer.callbacks.insert(0, PipelineDrain(drain, failed))


def _gradients_ready() -> None:
    """The closure of the pipeline's optimizer steps: the gradients are already in ``.grad``."""
    return None
