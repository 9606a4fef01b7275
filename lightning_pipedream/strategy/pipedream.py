"""PipeDreamStrategy: the Lightning strategy that trains a LightningModule as a pipeline, one stage per process.

Its hooks delegate: the user's options are a :class:`PipelineOptions`, where the stages live a :class:`Placement`,
the layers per stage come from a :class:`LayerPlanner` (or a :class:`GraphPath` for any other module), the
pipeline's updates from :class:`PipelineUpdates`, and each batch's micro-batches and loss weights from
:class:`BatchShares`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper, _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from typing_extensions import override

from lightning_pipedream.graph.split import get_path
from lightning_pipedream.plan.balance import stage_slice
from lightning_pipedream.runtime.communication.transport import Transport
from lightning_pipedream.runtime.execution import allocator
from lightning_pipedream.runtime.execution.engine import PipelineEngine
from lightning_pipedream.runtime.execution.shares import BatchShares
from lightning_pipedream.runtime.faults import flight
from lightning_pipedream.runtime.faults.failures import (
    from_rank_zero,
    pipeline_failures,
    report_failure,
    setup_failures,
)
from lightning_pipedream.runtime.faults.launch import rendezvous_store
from lightning_pipedream.runtime.faults.watchdog import watchdog
from lightning_pipedream.runtime.stages.materialize import has_meta_tensors, materialize
from lightning_pipedream.runtime.stages.replicas import GradientReducer
from lightning_pipedream.runtime.stages.sharding import (
    WholeOptimizerState,
    set_gradient_sync,
    sharded_model_state,
    sharded_optimizer_state,
    whole_state,
)
from lightning_pipedream.runtime.stages.ties import TiedParameters
from lightning_pipedream.schedule.specs import SCHEDULES
from lightning_pipedream.strategy.batches import batch_args, loop_loader
from lightning_pipedream.strategy.calls import (
    Elsewhere,
    ForwardCall,
    SequentialCall,
    find_layers,
    loss_of,
    shared_parameters,
)
from lightning_pipedream.strategy.checkpoint import (
    AtomicCheckpointIO,
    CheckpointGather,
    OptimizerLayout,
    load_own_share,
)
from lightning_pipedream.strategy.checks import (
    FiniteChecks,
    NonFiniteError,
    check_last_batch_fits,
    check_optimizers,
    check_stage_trains,
    check_training_supported,
    optimizers_unvalidated,
)
from lightning_pipedream.strategy.consistency import (
    CHECK_EVERY,
    CHECK_EVERY_ASYNC,
    batch_record,
    check_epoch_start,
    is_due,
)
from lightning_pipedream.strategy.divergence import (
    DEFAULT_FACTOR,
    Divergence,
    DivergenceGuard,
    DrainedWeights,
    Staleness,
)
from lightning_pipedream.strategy.evaluation import evaluate, to_cpu
from lightning_pipedream.strategy.graph_path import GraphPath
from lightning_pipedream.strategy.logs import LogRecorder
from lightning_pipedream.strategy.loss_scale import agreed_step, scaled, scaler_of
from lightning_pipedream.strategy.options import PipelineOptions, tuple_or_none
from lightning_pipedream.strategy.placement import Placement, ProcessGroups
from lightning_pipedream.strategy.planning import LayerPlanner
from lightning_pipedream.strategy.stage_pipeline import (
    StagePipeline,
    check_shard_layout,
    clip_grad_by_norm,
    lagged_summaries,
    shard_own_stage,
    summary_channel,
)
from lightning_pipedream.strategy.summaries import StepSummary
from lightning_pipedream.strategy.updates import PipelineDrain, PipelineUpdates
from lightning_pipedream.tree import map_tensors

log = logging.getLogger(__name__)

TBroadcast = TypeVar("TBroadcast")
_DEFAULT_TIMEOUT = timedelta(minutes=30)
# Under pipedream, Lightning's per-batch SIGTERM broadcast (a collective over all ranks) runs every this many batches.
SIGTERM_CHECK_EVERY = 32


class PipeDreamStrategy(DDPStrategy):
    """Train a LightningModule as a pipeline, one stage per process.

    A module whose layers are one ``nn.Sequential`` is split between those layers; any other module
    is split from its forward call (``self(...)`` in a step) captured as a graph with torch.export,
    at the ``split_points`` given or where PipeDream's partitioner puts them after profiling.

    Args:
        schedule: ``"pipedream"`` (asynchronous 1F1B with weight stashing, each batch one minibatch),
            ``"auto"`` (the planner chooses, see ``memory_limit``), ``"1f1b"`` (one-forward-one-backward with a
            flush), ``"gpipe"``, ``"zb-h1"``
            (1F1B with each backward split, its weight half deferred into the bubbles), ``"interleaved"``
            (Megatron's 1F1B over ``virtual_stages`` model chunks per process) or ``"2bw"``
            (PipeDream-2BW: micro-batches, two weight versions, the update one step late, no flush).
        chunks: micro-batches per batch (``pipedream`` takes 1).
        virtual_stages: ``interleaved`` only: model chunks per process; the layers are cut into
            processes x ``virtual_stages`` stages (evenly, or by ``balance``) and process r holds stages
            r, r + processes, ... Needs a module whose layers are one ``nn.Sequential``.
        recompute: keep only each stage's inputs between forward and backward and replay the forward
            in the backward (RNG restored: the same dropout masks); less memory, one more forward. One flag per model
            stage (e.g. ``[True, False]``) recomputes on those stages only, as ``schedule="auto"`` may choose.
        balance: layers per stage, e.g. ``[3, 2]``; by default the model is profiled on a
            training batch and partitioned with PipeDream's optimizer.
        plan: path of a ``plan.json`` (``python -m lightning_pipedream plan --json``); skips profiling.
        layers: the name of the module's ``nn.Sequential`` attribute, when it has several.
        split_points: module names where stages 1, 2, ... begin (e.g. ``["model.blocks.2"]``): split
            the captured graph there without profiling. Implies the graph path.
        weight_stashing: ``pipedream`` only; ``False`` is the paper's ablation.
        vertical_sync: ``pipedream`` only; every stage uses the weight version stage 0 used.
        bandwidth: bytes/s between processes, for the partitioner's cost model; or ``[within a node,
            between nodes]`` (the topology is the Trainer's: devices per node x num_nodes).
        straight: ``True`` (default): one process per stage. ``False``: the automatic path (profile on
            the first batch) lets PipeDream's optimizer replicate stages, e.g. a 2-1 plan on 3
            processes or pure data parallelism, when its cost model predicts that faster.
        check_finite: check every stage's layer outputs and gradients for NaN/inf and stop, naming the
            stage, layer and training step (off by default: it costs a reduction per layer and step).
        replicas: replicas per stage, e.g. ``[2, 1]`` on 3 processes (PipeDream's 1F1B-RR, under ``gpipe``,
            ``1f1b`` and ``pipedream``): a replicated stage's replicas take micro-batches (minibatches) round
            robin and combine their gradients. A plan with replicated stages sets it. Equal counts are the
            same as ``stages=``.
        stages: pipeline stages; on ``stages * d`` processes the strategy runs ``d`` data-parallel
            pipelines (each stage's replicas all-reduce their gradients). Default: one stage per process.
        trace: a directory; each rank writes a Chrome/Perfetto trace of its actions there at the end.
        keep_freed_memory: on CPU, tell each rank's C allocator (glibc) to keep freed blocks for reuse
            rather than return them to the OS (:func:`~.allocator.keep_freed_memory`):
            a stage allocates its gradients and activations anew every minibatch, and faulting their
            pages back in cost ``pipedream`` ~10 % of its step time in ``benchmarks/lightning.py``. The
            ranks' resident memory then stays at its peak until ``teardown`` gives the freed memory back.
            No effect on GPU devices.
        mean_over: for a loss that is a mean over something other than the batch's samples, a function
            counting it in a batch or micro-batch, e.g. ``lambda batch: (batch["labels"] != -100).sum()`` for a
            token-mean language-model loss with padding: each micro-batch's loss then counts by its count over
            the whole batch's, and the result equals one device exactly (docs/strategy.md, "Losses").
        memory_limit: with ``schedule="auto"``: bytes per process. The planner (``plan/auto.py``) profiles the
            layers on the first training batch and chooses the split, replicas, schedule, micro-batches and
            recompute that it predicts fastest within the limit (``python -m lightning_pipedream plan --schedule
            auto`` shows the same choice offline), or refuses naming the smallest limit that fits.
        exact: with ``schedule="auto"``: only schedules equal to one device (gpipe, 1f1b, zb-h1, interleaved).
        on_divergence: ``pipedream`` and ``2bw``: ``"flush"`` watches the training loss; when it is not finite, or
            its moving average rises above ``divergence_factor`` times its lowest, every stage drains, goes back to
            the weights and optimizer state of the last drain (the start of training or of the epoch) and trains
            on under ``1f1b`` (``chunks`` = max(chunks, stages)), saying so in a warning and logging
            ``pipeline/switched_to_1f1b``. Costs a copy of each stage's weights and optimizer state. Off by default.
        divergence_factor: how many times its lowest value the smoothed loss may reach (default 2).
        minibatches_per_batch: ``pipedream`` on a straight pipeline: cut each batch into this many minibatches,
            each a PipeDream minibatch with its own update, all run in one training step (default 1: the batch is
            the minibatch). The updates are those of a DataLoader giving the minibatches one per step, but
            Lightning's per-step work (fetching the batch, its hooks, ``self.log``) and the strategy's (the step
            summary) are paid once per batch: on a small model that work is a tenth of a pipeline step
            (docs/strategy.md, "Several minibatches per batch"). A step then counts ``minibatches_per_batch``
            updates for ``max_steps``, step-wise LR schedulers (every minibatch of a batch gets the rate of its
            step) and checkpoints every n steps; its logged values and loss are the mean over its minibatches.
        transport: how the stages talk: ``"auto"`` (shared memory between CPU ranks on one machine over gloo,
            torch.distributed otherwise), ``"gloo"``, ``"shm"``, or ``"directional"`` (each direction of a link on a
            process group of its own: the path NCCL takes, which GPU runs always use; docs/strategy.md, "On GPUs").
            None (default): the environment's ``LIGHTNING_PIPEDREAM_TRANSPORT``, else ``"auto"``.
        shard: with data-parallel pipelines (``stages=S`` on ``S x d`` devices) and ``gpipe`` or ``1f1b``: each stage's
            ``d`` replicas shard its weights, gradients and optimizer state with torch's FSDP2 (``"full"``: weights
            gathered for each forward and backward; ``"grad_op"``: kept whole from a forward to its backward) instead
            of keeping whole copies; the step's last backward reduce-scatters the gradients once. Checkpoints stay
            consolidated (single-device form). None (default): whole copies, gradients all-reduced.
    """

    strategy_name = "pipedream"

    def __init__(
        self,
        schedule: str = "pipedream",
        chunks: int = 1,
        balance: list[int] | None = None,
        plan: str | os.PathLike | None = None,
        layers: str | None = None,
        split_points: list[str] | None = None,
        weight_stashing: bool = True,
        vertical_sync: bool = False,
        bandwidth: float | list[float] = 1e9,
        trace: str | os.PathLike | None = None,
        stages: int | None = None,
        replicas: list[int] | None = None,
        check_finite: bool = False,
        straight: bool = True,
        virtual_stages: int = 1,
        recompute: bool | list[bool] = False,
        keep_freed_memory: bool = True,
        mean_over: Callable[[Any], Any] | None = None,
        memory_limit: float | None = None,
        exact: bool = False,
        on_divergence: str | None = None,
        divergence_factor: float = DEFAULT_FACTOR,
        minibatches_per_batch: int = 1,
        transport: str | None = None,
        shard: str | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = _DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.options = PipelineOptions(
            schedule, chunks, tuple_or_none(balance), plan, layers, tuple_or_none(split_points), weight_stashing,
            vertical_sync, tuple(bandwidth) if isinstance(bandwidth, (list, tuple)) else bandwidth, trace, stages,
            tuple_or_none(replicas), check_finite, straight, virtual_stages,
            tuple(recompute) if isinstance(recompute, (list, tuple)) else recompute, keep_freed_memory, mean_over,
            memory_limit, exact, on_divergence, divergence_factor, minibatches_per_batch, transport, shard,
        )
        if start_method != "popen":
            # spawn/fork launchers copy only rank 0's weights back to the main process: wrong for a pipeline.
            raise ValueError(
                f"PipeDreamStrategy(start_method={start_method!r}) is not supported: those launchers return only "
                "rank 0's weights, which hold one stage. Use the default start_method='popen' (or torchrun)."
            )
        # DDPStrategy gives the launcher, the process group and the collectives; its DDP wrapper is not used.
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            # A checkpoint is written beside its path and renamed into place: a kill while saving keeps the old one.
            checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method="popen",
        )
        self.plan: Any = self.options.load_plan()  # the Plan used: plan= (read now), the partitioner's, or None
        self.balance: list[int] | None = None  # the layers per stage used (a module whose layers are one Sequential)
        self._pipeline: StagePipeline | None = None
        self._updates: PipelineUpdates | None = None
        self._failure: BaseException | None = None
        self._step_context = "setup"  # what the pipeline runs now, for error messages
        self._keeping_freed_memory = False  # set while this process keeps freed memory (from setup to teardown)
        self._warned_token_mean = False  # the warning that micro-batches' token means weigh tokens unequally, once
        self.switched: Divergence | None = None  # on_divergence: why the run went over to 1f1b, once it has
        self._guard: DivergenceGuard | None = None
        self._drained_weights = DrainedWeights()
        self._divergence: Divergence | None = None  # seen in this step's summaries, acted on at the step's end
        self._staleness = Staleness()

    # -------------------------------------------------------------------------------- options
    @property
    def schedule(self) -> str:
        return self.options.schedule

    @property
    def chunks(self) -> int:
        """Micro-batches per batch."""
        return self.options.chunks

    @property
    def asynchronous(self) -> bool:
        """pipedream and 2bw keep the pipeline full across training steps (a drain empties it)."""
        return self.options.spec.asynchronous

    # ---------------------------------------------------------------------------------- ranks
    @property
    def placement(self) -> Placement:
        """Where the stages live. Before ``setup`` decides it (the planner may replicate stages), the placement
        the options give."""
        if self._pipeline is not None:
            return self._pipeline.placement
        if self.options.auto:
            raise RuntimeError("PipeDreamStrategy(schedule='auto') decides where the stages live in setup.")
        return self._decide_placement(self.plan)

    @property
    def num_stages(self) -> int:
        """Stages of one pipeline (``stages=``, ``replicas=``, or one per process)."""
        return self.placement.num_stages

    @property
    def num_pipelines(self) -> int:
        """Data-parallel copies of the pipeline: processes / stages (1 with unequal replicas)."""
        return self.placement.num_pipelines

    @property
    def stage_index(self) -> int:
        return self.placement.stage_index

    @property
    def pipeline_index(self) -> int:
        return self.placement.pipeline_index

    @property
    def is_last_stage(self) -> bool:
        return self.placement.is_last_stage

    @property
    def process_groups(self) -> ProcessGroups:
        """This rank's process groups (its pipeline's, its summaries', its replicas'), once ``setup`` made them."""
        return self._pipeline.groups if self._pipeline is not None else ProcessGroups()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.placement.sampler_kwargs

    def _decide_placement(self, plan: Any, accumulate_grad_batches: int = 1) -> Placement:
        """Replicas per stage from ``replicas=`` or the plan: equal counts are data-parallel pipelines, unequal ones
        PipeDream's 1F1B-RR."""
        options = self.options
        return Placement.decide(options.schedule, self.world_size, self.global_rank, stages=options.stages,
                                replicas=self._replicas(plan), accumulate_grad_batches=accumulate_grad_batches)

    def _replicas(self, plan: Any) -> tuple[int, ...] | None:
        """Replicas per stage: ``replicas=``, else those of a plan file or of the replicating planner's plan."""
        options = self.options
        if options.replicas is None and plan is not None and (options.plan_path is not None or not options.straight):
            return tuple(stage.replicas for stage in plan.stages)
        return options.replicas

    @override
    def _configure_launcher(self) -> None:
        # The Trainer knows its devices and nodes now, before any process starts: refuse what cannot run here.
        if self.options.auto:  # the planner decides the stages in setup
            super()._configure_launcher()
            return
        world_size = self.num_nodes * self.num_processes
        placement = Placement.decide(self.options.schedule, world_size, stages=self.options.stages,
                                     replicas=self._replicas(self.plan))
        if self.options.on_divergence is not None:
            _refuse_guard_with_unequal_replicas(placement)
        _refuse_minibatches_with_replicas(placement, self.options.minibatches_per_batch)
        if self.options.shard is not None:
            check_shard_layout(placement, self.options.shard)
        if self.plan is not None and len(self.plan.stages) != placement.num_stages:
            raise ValueError(
                f"The plan {self.options.plan_path} has {len(self.plan.stages)} stages but the Trainer runs "
                f"{placement.num_stages} processes. Make a plan for {placement.num_stages} workers, or set "
                f"devices/num_nodes to give {len(self.plan.stages)} processes."
            )
        super()._configure_launcher()

    # ---------------------------------------------------------------------------------- setup
    @override
    def setup_distributed(self) -> None:
        """DDPStrategy's, but the rendezvous waits up to 30 minutes for a rank that starts late, while ``timeout``
        bounds the process group's waits (:func:`rendezvous_store`); then every rank's mailbox opens, so that a
        failure anywhere in setup reaches the others."""
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        environment = self.cluster_environment
        assert environment is not None
        store = None if dist.is_initialized() else rendezvous_store(
            environment.main_address, environment.main_port, self.global_rank, self.world_size, self._timeout)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(environment, self._process_group_backend, timeout=self._timeout, store=store,
                              device_id=device_id)
        watchdog().start()

    @override
    def setup(self, trainer: Trainer) -> None:
        with setup_failures():  # a rank's failure in setup reaches every rank, with its reason
            self._setup(trainer)

    @override
    def barrier(self, name: str | None = None) -> None:
        # Lightning's barriers (after restoring a checkpoint, at the end of a fit): a peer's failure reaches this rank.
        with pipeline_failures(None, waiting=f"Lightning's barrier{f' {name!r}' if name else ''}"):
            super().barrier(name)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        with pipeline_failures(None, waiting=f"Lightning's broadcast from rank {src}"):
            return super().broadcast(obj, src)

    def _setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self.options.keep_freed_memory and self.root_device.type == "cpu" and not self._keeping_freed_memory:
            self._keeping_freed_memory = allocator.keep_freed_memory()
        # A failing rank writes its flight recorder under the Trainer's root directory (unless the variable says where).
        os.environ.setdefault(flight.DIRECTORY_ENV, os.path.join(trainer.default_root_dir, flight.DEFAULT_DIRECTORY))
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.options.auto:
            self._choose_automatically(trainer, module, fitting)
        if fitting:
            check_training_supported(module, self.precision_plugin, self.options.schedule, self.asynchronous)
            k = self.options.minibatches_per_batch
            if k > 1 and trainer.accumulate_grad_batches > 1:
                raise ValueError(
                    f"PipeDreamStrategy(minibatches_per_batch={k}) makes an update per minibatch; "
                    f"accumulate_grad_batches={trainer.accumulate_grad_batches} would add up several. Use a larger "
                    "batch with fewer minibatches_per_batch, or drop accumulate_grad_batches."
                )
            if self.asynchronous and self.options.chunks > 1:  # 2bw: every step admits chunks micro-batches
                check_last_batch_fits(loop_loader(trainer.fit_loop), self.options.chunks, self.placement.num_pipelines,
                                      self.options.schedule)
        if self._pipeline is None or self._pipeline.module is not module:
            self._pipeline = self._build_pipeline(trainer, module, fitting)
        else:  # a later fit/validate/test/predict with the same model: keep its stages
            self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            check_optimizers(self.optimizers)
            if self._pipeline.graph is not None:  # every rank holds the whole module; its optimizer trains its stage
                _keep_parameters(self.optimizers, {id(p) for p in self._pipeline.stage.parameters()})
        self.setup_precision_plugin()
        if fitting:
            self._setup_training(trainer)
        self._failure = None

    def _choose_automatically(self, trainer: Trainer, module: LightningModule, fitting: bool) -> None:
        """``schedule='auto'``: the planner chooses the schedule, the split, replicas, micro-batches and recompute on
        a profile of the first training batch; from here on the options are those of its choice."""
        found = self._sequential_layers(module)
        if found is None:
            raise ValueError(
                f"PipeDreamStrategy(schedule='auto') plans a module whose layers are one nn.Sequential; "
                f"{type(module).__name__}'s are not. Name a schedule (the graph path profiles and splits any module), "
                "or put the layers in one nn.Sequential."
            )
        if not fitting:  # nothing to profile a training step with: an even split, flushed
            self.options = dataclasses.replace(self.options, schedule="1f1b", memory_limit=None, exact=False)
            return
        optimizers, _ = optimizers_unvalidated(module)
        from lightning_pipedream.plan.memory import optimizer_kind

        planner = LayerPlanner(self.options, trainer, module, SequentialCall(found[0]), self.is_global_zero,
                               self.batch_to_device)
        arguments, self.plan = planner.auto_plan(found[1], len(self.parallel_devices or [None]), self.num_nodes,
                                                 optimizer_kind(optimizers[0]) if optimizers else "adam",
                                                 device=self.root_device)
        arguments = {k: tuple(v) if isinstance(v, list) else v for k, v in arguments.items()}
        self.options = dataclasses.replace(self.options, memory_limit=None, exact=False, **arguments)

    def _build_pipeline(self, trainer: Trainer, module: LightningModule, fitting: bool) -> StagePipeline:
        """Decide the placement and this rank's stage, and build the engine and channels around it."""
        options = self.options
        found = self._sequential_layers(module)
        call: SequentialCall | ForwardCall = SequentialCall(found[0]) if found is not None else ForwardCall()
        planner = LayerPlanner(options, trainer, module, call, self.is_global_zero,
                               self.batch_to_device) if isinstance(call, SequentialCall) else None
        if fitting and not options.straight and self.world_size > 1:
            if found is None or planner is None:
                raise ValueError(
                    f"PipeDreamStrategy(straight=False) plans replicated stages for a module whose layers are one "
                    f"nn.Sequential; {type(module).__name__}'s are not. Use straight=True (the default) for the graph "
                    "path, or put the layers in one nn.Sequential."
                )
            self.plan = planner.replicated_plan(found[1], self.world_size, len(self.parallel_devices or [None]),
                                                self.num_nodes)
        placement = self._decide_placement(self.plan, trainer.accumulate_grad_batches if fitting else 1)
        _refuse_minibatches_with_replicas(placement, options.minibatches_per_batch)
        groups = ProcessGroups.make(placement, self._process_group_backend, self._timeout)
        full_keys = list(module.state_dict())
        # The full model's optimizer layout maps checkpoints (single-device form) to this rank's stage.
        optimizer_layouts = OptimizerLayout.of_module(module, optimizers_unvalidated)
        if fitting and len(optimizer_layouts) > 1:
            raise ValueError(
                f"{type(module).__name__}.configure_optimizers returns {len(optimizer_layouts)} optimizers; "
                "PipeDreamStrategy trains with one (automatic optimization, which takes one). Use one optimizer "
                "with a parameter group per part of the model for different learning rates or settings."
            )
        graph, tied = None, None
        if found is not None and planner is not None:
            name, layers = found
            shared = shared_parameters(layers)  # before the other stages' layers make way for placeholders
            self.balance, self.plan = planner.balance(layers, placement.num_stages, self.plan)
            layer_ties = self._layer_ties(module, shared, layers, placement)
            stage, model_chunks = self._keep_own_stage(module, name, layers, placement)
            local_names = {id(p): f"{name}.{n}" for n, p in stage.named_parameters()}
            if layer_ties:
                # Each holder's copy lives under its own layer's name; checkpoints and optimizer states use the first.
                here = {key: next(n for n in shared[key] if n.split(".", 1)[0] in stage._modules)
                        for key, stages in layer_ties.items() if placement.stage_index in stages}
                tied = TiedParameters(stage, layer_ties, placement.stage_index, names=here)
                for key, path in here.items():
                    local_names[id(get_path(stage, path))] = f"{name}.{key}"
        else:
            self._check_graph_path_supported(module)
            graph = GraphPath(options, placement, self.is_global_zero, self.batch_to_device)
            graph.split(trainer, module)
            call, stage, local_names = graph.call, graph.stage, graph.local_names()
            model_chunks = [stage]
            self.plan = graph.plan if graph.plan is not None else self.plan
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        stage.to(self.root_device)  # a graph stage is not a child of the module
        if options.shard is not None:  # before the optimizers: they keep state for this rank's shards only
            before = {n: id(p) for n, p in stage.named_parameters()}
            stage = shard_own_stage(stage, placement, groups, options.shard, graph is not None or tied is not None,
                                    self.root_device)
            local_names = {id(p): local_names[before[n]] for n, p in stage.named_parameters()}  # new parameters
        pipeline = StagePipeline(
            module, placement, groups, call, stage,
            engine=self._make_engine(stage, model_chunks, placement, groups),
            summary=summary_channel(placement, groups, self.root_device),
            checkpoint=CheckpointGather(self.global_rank, self.world_size, full_keys),
            optimizer_layouts=optimizer_layouts, local_names=local_names, graph=graph,
        )
        pipeline.lagged = lagged_summaries(placement, groups, pipeline.summary, options.minibatches_per_batch)
        pipeline.ties = tied
        pipeline.shard = options.shard
        if groups.replicas is not None and options.shard is None:  # sharded replicas reduce-scatter in the backward
            pipeline.reducer = GradientReducer(stage.parameters(), groups.replicas)
        if options.check_finite:
            pipeline.finite = FiniteChecks(stage, placement.stage_index, lambda: self._step_context,
                                           per_layer=graph is None)
        return pipeline

    def _layer_ties(self, module: LightningModule, shared: dict[str, list[str]], layers: nn.Sequential,
                    placement: Placement) -> dict[str, list[int]]:
        """The Sequential's parameters used by layers on different stages: first name -> the stages holding it."""
        assert self.balance is not None
        stage_of = dict(zip(layers._modules, (s for s, count in enumerate(self.balance) for _ in range(count))))
        ties = {key: sorted({stage_of[n.split(".", 1)[0]] for n in names}) for key, names in shared.items()}
        ties = {key: stages for key, stages in ties.items() if len(stages) > 1}
        if ties and (self.options.virtual_stages > 1 or placement.num_pipelines > 1 or placement.layout is not None
                     or has_meta_tensors(module)):
            users = {key: [n.split(".", 1)[0] for n in shared[key]] for key in ties}
            raise ValueError(
                f"Layers {users} of {type(module).__name__} share parameters across stages (tied weights), which "
                "PipeDreamStrategy runs with one straight pipeline of real weights; not with interleaved model "
                "chunks, replicated stages, data-parallel pipelines or a model built on the meta device. Use one of "
                "those without ties, or balance= that keeps each tied parameter's layers in one stage."
            )
        return ties

    def _check_graph_path_supported(self, module: LightningModule) -> None:
        if has_meta_tensors(module):
            raise ValueError(
                f"{type(module).__name__} was built on the meta device (configure_model under "
                "PipeDreamStrategy, or torch.device('meta')), which PipeDreamStrategy materializes per stage "
                "only for a module whose layers are one nn.Sequential; this one's forward graph must be "
                "traced with real weights. Put the layers in one nn.Sequential, or build the model on a "
                "real device (in __init__)."
            )
        if self.options.virtual_stages > 1:
            raise ValueError(
                f"schedule='interleaved' with virtual_stages={self.options.virtual_stages} splits the layers of one "
                f"nn.Sequential into model chunks, but {type(module).__name__}'s are not one nn.Sequential. "
                "Put the layers in one nn.Sequential (layers= names it), or use virtual_stages=1."
            )

    def _setup_training(self, trainer: Trainer) -> None:
        """The pipeline's updates, clipping over the whole model, and the callback that drains before others look."""
        pipeline = self._pipeline
        assert pipeline is not None
        _optimizers_to_device(self.optimizers, self.root_device)
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        self._updates = PipelineUpdates(
            list(pipeline.stage.parameters()), lambda: self.optimizers, self._optimizer_step_now,
            before_step=self._before_update,
        )
        if pipeline.lagged is not None:
            self._check_sigterm_every_few_batches(trainer)
        if self.options.on_divergence is not None and self.switched is None:
            _refuse_guard_with_unequal_replicas(pipeline.placement)  # a plan's replicas are known only now
            self._guard = DivergenceGuard(self.options.divergence_factor)
            self._drained_weights.take(pipeline.stage, self.optimizers)
        if not any(isinstance(c, PipelineDrain) for c in trainer.callbacks):
            # First, so that no other callback sees a model with minibatches in flight.
            trainer.callbacks.insert(0, PipelineDrain(self.drain, self._pipeline_failed))

    def _check_sigterm_every_few_batches(self, trainer: Trainer) -> None:
        """Lightning broadcasts rank 0's SIGTERM flag before every training batch: a collective over all ranks,
        which would re-synchronize the asynchronous pipeline at each step. Under ``pipedream`` it runs before
        every ``SIGTERM_CHECK_EVERY``-th batch instead (the same batches on every rank), so a SIGTERM (e.g.
        a cluster's preemption notice) stops training within that many steps."""
        epoch_loop = trainer.fit_loop.epoch_loop
        check = getattr(type(epoch_loop), "_broadcast_sigterm_tensor", None)
        if check is None:  # a Lightning version without the per-batch broadcast
            return
        batches = itertools.count()

        def every_few_batches() -> None:
            if next(batches) % SIGTERM_CHECK_EVERY == 0:
                check(epoch_loop)

        epoch_loop._broadcast_sigterm_tensor = every_few_batches  # type: ignore[method-assign]

    def _sequential_layers(self, module: LightningModule) -> tuple[str, nn.Sequential] | None:
        """The module's Sequential to split between layers (its attribute name too), or None to split its traced
        forward graph."""
        if self.options.split_points is not None:
            return None
        if self.options.layers is not None:  # asked for by name: its errors are the user's to see
            return find_layers(module, self.options.layers, allow_ties=True)
        try:
            return find_layers(module, None, allow_ties=True)
        except ValueError as not_sequential:
            if self.is_global_zero:
                log.info("PipeDreamStrategy: %s is not one nn.Sequential (%s); it splits the graph of its forward "
                         "call instead.", type(module).__name__, str(not_sequential).split(";")[0])
            return None

    def _keep_own_stage(self, module: LightningModule, name: str, layers: nn.Sequential,
                        placement: Placement) -> tuple[nn.Module, list[nn.Module]]:
        """Replace the other stages' layers by placeholders so this rank holds only its own; returns the stage and
        its model chunks (interleaved: stages r, r + p, ...; one otherwise)."""
        assert self.balance is not None
        mine = [c * placement.num_stages + placement.stage_index for c in range(self.options.virtual_stages)]
        model_chunks = [stage_slice(layers, self.balance, s) for s in mine]
        own = model_chunks[0] if len(mine) == 1 else nn.Sequential(
            OrderedDict((layer_name, layer) for chunk in model_chunks for layer_name, layer in chunk.named_children())
        )
        check_stage_trains(own, placement.stage_index, self.balance)
        stage_of = [s for s, count in enumerate(self.balance) for _ in range(count)]
        for i, layer_name in enumerate(list(layers._modules)):
            if layer_name not in own._modules:
                layers._modules[layer_name] = Elsewhere(layer_name, stage_of[i])
        if has_meta_tensors(module):  # built on the meta device: real weights for this stage only
            materialize(module, self.root_device, self._shared_seed())
        return own, model_chunks

    def _make_engine(self, stage: nn.Module, model_chunks: list[nn.Module], placement: Placement,
                     groups: ProcessGroups) -> PipelineEngine:
        options = self.options
        return PipelineEngine(
            model_chunks if options.virtual_stages > 1 else stage,
            placement.stage_index,
            placement.num_stages,
            Transport(group=groups.pipeline, device=self.root_device, kind=options.transport,
                      reverse_group=groups.pipeline_reverse),
            schedule=options.schedule,
            chunks=options.chunks,
            weight_stashing=options.weight_stashing,
            vertical_sync=options.vertical_sync,
            record=options.trace_dir is not None,
            # 1F1B-RR: the engine runs the replicated schedule; the replicas' all-reduce happens in our updates.
            replicas=placement.layout.replicas if placement.layout is not None else None,
            rank=placement.rank if placement.layout is not None else None,
            allreduce=_reduced_in_updates if placement.layout is not None else None,
            recompute=options.recompute,
            virtual_stages=options.virtual_stages,
            # sharded replicas: only the step's last backward on the stage reduce-scatters the gradients
            gradient_sync=(lambda _, sync: set_gradient_sync([stage], sync)) if options.shard is not None else None,
        )

    def _shared_seed(self) -> int:
        """Rank 0's initial seed, from which every layer built on the meta device is initialized (see
        :func:`materialize`): the weights do not depend on which rank holds a layer."""
        return int(from_rank_zero("share its random seed", torch.initial_seed))

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Lightning runs ``configure_model`` in here: its layers are built on the meta device (shapes, no
        storage), and :meth:`setup` gives real weights only to this rank's stage (per-stage construction)."""
        with torch.device("meta"):
            yield

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Keep the order of a custom sampler: Lightning wraps it for distributed training with ``shuffle=True``,
        which permutes the order it gives (a language model's contiguous streams, for instance), although the
        wrapper's own documentation leaves the order to the wrapped sampler. The wrapper then only shards it
        between data-parallel pipelines; every stage of a pipeline still reads the same batches."""
        sampler = getattr(dataloader, "sampler", None)
        if isinstance(sampler, DistributedSamplerWrapper) and sampler.shuffle:
            sampler.shuffle = False
        return dataloader

    @override
    def configure_ddp(self) -> None:  # no DistributedDataParallel wrapper: stages don't share weights
        pass

    # -------------------------------------------------------------------------- training step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Admit the batch into the pipeline and run this rank's actions of the step.

        The pipeline's forwards, backwards and updates all happen here; Lightning's own backward and
        optimizer step that follow only run their hooks (see :class:`PipelineUpdates`).
        """
        pipeline, updates = self._pipeline, self._updates
        assert pipeline is not None and updates is not None
        module = self.lightning_module
        trainer = module.trainer
        batch, batch_idx = batch_args(args, kwargs)
        epoch_loop = trainer.fit_loop.epoch_loop
        closes_group = not epoch_loop._should_accumulate()  # Lightning steps the optimizer after this batch
        end_of_data = epoch_loop._num_ready_batches_reached()
        record = self._data_record(batch, batch_idx, end_of_data)
        last_step = closes_group and 0 < trainer.max_steps <= trainer.global_step + 1

        shares = self._shares(batch)
        # As Lightning divides the loss of each accumulated batch; and each pipeline's loss counts 1/pipelines in the
        # replicas' summed gradient.
        scale = 1.0 / (trainer.accumulate_grad_batches * pipeline.placement.num_pipelines)
        recorder = LogRecorder()
        step_outputs: list[Any] = []
        batch_loss = [0.0]

        # minibatches_per_batch: the batch's minibatches, numbered from ``first`` by the engine, from 0 by the shares.
        minibatches = len(shares.parts) if self.options.minibatches_per_batch > 1 else 1
        first = pipeline.engine.next_minibatch if self.options.minibatches_per_batch > 1 else 0

        def inputs(mb: int) -> Any:
            return pipeline.call.input_of(module, "training_step", shares.part(mb - first), batch_idx)

        def loss(mb: int, output: Any) -> Tensor:
            mb -= first
            logged = recorder.capture(module, shares.log_weight(mb), shares.size(mb))
            with pipeline.call.replaying(module, output), logged:
                step_output = module.training_step(shares.part(mb), batch_idx)
            value = loss_of(step_output)
            step_outputs.append(step_output)
            batch_loss[0] += float(value.detach()) * shares.share(mb)
            weight = shares.weight(mb) * scale
            return scaled(value * weight if weight != 1.0 else value, self.precision_plugin)  # 16-mixed

        if pipeline.graph is not None:
            pipeline.graph.ensure_captured(module, "training_step", shares.parts, batch_idx)
        self._step_context = f"training step {batch_idx} of epoch {trainer.current_epoch}"
        for minibatch in self._admitted_here(pipeline.engine.next_minibatch, minibatches):
            updates.admit(minibatch, batch_idx, closes_group)
        # A batch with fewer samples than chunks (an epoch's last) runs one micro-batch per sample.
        micro_batches = len(shares.parts) if shares.shards == 1 and minibatches == 1 else None
        drained = self.asynchronous and (end_of_data or last_step)
        with self.precision_plugin.train_step_context(), updates.pipeline_grads():
            pipeline.engine.train_step(inputs, loss, updates.apply, micro_batches, minibatches)
            if drained:
                # Every stage finishes its minibatches before the epoch's end hooks, validation and checkpoints.
                pipeline.engine.drain(updates.apply)
        self._staleness.add(pipeline.engine.take_staleness())
        result = self._step_result(step_outputs, batch_loss[0], recorder, end_of_data or last_step, record)
        if self._divergence is not None:
            self._go_over_to_1f1b(self._divergence)
        elif drained:
            self._log_staleness()
            if self._guard is not None and self._guard.healthy:  # else the last healthy drain's stay
                self._drained_weights.take(pipeline.stage, self.optimizers)
        return result

    def _log_staleness(self) -> None:
        """At a drain: every stage's mean and largest weight staleness since the last one, logged on every rank."""
        pipeline = self._pipeline
        assert pipeline is not None
        mean, largest = self._staleness.take()
        placement = pipeline.placement
        mine = torch.tensor([placement.stage_index, mean, largest], dtype=torch.float64, device=self.root_device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(pipeline.groups.pipeline))]
        dist.all_gather(every, mine, group=pipeline.groups.pipeline)
        module = self.lightning_module
        for stage, stage_mean, stage_largest in sorted(tuple(t.tolist()) for t in every):
            module.log(f"pipeline/staleness_stage{int(stage)}", stage_mean, on_step=True, on_epoch=False)
            module.log(f"pipeline/staleness_max_stage{int(stage)}", stage_largest, on_step=True, on_epoch=False)

    def _go_over_to_1f1b(self, divergence: Divergence) -> None:
        """on_divergence='flush': drain, go back to the last drained weights and optimizer state, train on under
        1f1b. Every rank gets here at the same step: they all saw the same losses (the step summaries)."""
        pipeline, updates = self._pipeline, self._updates
        assert pipeline is not None and updates is not None
        module = self.lightning_module
        self.drain()
        updates.forget()
        if pipeline.lagged is not None:
            for each in pipeline.lagged.take_all():  # the minibatches that were in flight: logged, not guarded
                LogRecorder.replay(module, each.logs)
        self._drained_weights.restore(pipeline.stage, self.optimizers)
        before = self.options.schedule
        chunks = max(self.options.chunks, self.options.minibatches_per_batch, pipeline.placement.num_stages)
        self.options = dataclasses.replace(self.options, schedule="1f1b", chunks=chunks, vertical_sync=False,
                                           on_divergence=None, minibatches_per_batch=1)
        pipeline.placement = dataclasses.replace(pipeline.placement, asynchronous=False)
        pipeline.lagged = None
        pipeline.engine = self._make_engine(pipeline.stage, [pipeline.stage], pipeline.placement, pipeline.groups)
        self.switched, self._divergence, self._guard = divergence, None, None
        step = module.trainer.global_step
        if self.is_global_zero:
            log.warning(
                "PipeDreamStrategy(on_divergence='flush'): %s, at training step %d. Every stage went back to the "
                "weights and optimizer state of the last drain and trains on under schedule='1f1b' (chunks=%d) "
                "instead of %r.", divergence.words(), step, chunks, before)
        module.log("pipeline/switched_to_1f1b", 1.0, on_step=True, on_epoch=False)

    def _shares(self, batch: Any) -> BatchShares:
        """A training batch's micro-batches and their loss weights (see :class:`BatchShares`)."""
        placement = self.placement
        k = self.options.minibatches_per_batch
        if k > 1:  # each piece a minibatch of its own: its loss counts fully in its own update
            return BatchShares.of(batch, k, minibatch_updates=True, fewer_if_small=True,
                                  mean_over=self.options.mean_over)
        shares = BatchShares.of(batch, self.options.chunks, placement.input_shards,
                                minibatch_updates=placement.round_robin and self.options.spec.minibatch_updates,
                                fewer_if_small=True, mean_over=self.options.mean_over)
        if not self._warned_token_mean and self.is_global_zero:
            counts = shares.unequal_labelled_tokens()
            if counts is not None:
                self._warned_token_mean = True
                rank_zero_warn(
                    f"PipeDreamStrategy: this batch's labels leave out padding (-100) unevenly: its micro-batches "
                    f"hold {list(counts)} labelled tokens for {list(shares.sizes)} samples. A loss that is a mean "
                    "over each micro-batch's tokens (cross_entropy with ignore_index=-100, Hugging Face models) "
                    "then weighs tokens unequally and differs from one device. Pass PipeDreamStrategy(mean_over=...) "
                    "a function counting a batch's labelled tokens, e.g. mean_over=lambda batch: "
                    "(batch['labels'] != -100).sum(), to weigh each micro-batch by its tokens (exact). A loss that "
                    "is a mean over samples needs nothing."
                )
        return shares

    def _step_result(self, step_outputs: list[Any], batch_loss: float, recorder: LogRecorder,
                     last_of_run: bool, record: Tensor | None = None) -> STEP_OUTPUT:
        """Share the step's loss, extra outputs and logs from the last stage with every rank (pipedream: the
        summary of the minibatch that finished), log them, and return what Lightning expects of a step."""
        pipeline = self._pipeline
        assert pipeline is not None
        module = self.lightning_module
        summary = None
        if pipeline.placement.is_last_stage:  # a replica of a replicated last stage may own none of the step's
            last = step_outputs[-1] if step_outputs else None
            extra = {}
            if isinstance(last, Mapping):
                extra = {k: map_tensors(to_cpu, v) for k, v in last.items() if k != "loss"}
            summary = StepSummary(batch_loss, extra, recorder.aggregate())
        if pipeline.lagged is not None:  # pipedream: minibatch t's summary is used at step t + stages - 1
            summaries = pipeline.lagged.step(summary, record)
            if last_of_run:
                summaries += pipeline.lagged.take_all()
        else:
            summaries = [pipeline.summary.exchange(summary, record)]
        for each in summaries:
            LogRecorder.replay(module, each.logs)
            if self._guard is not None and self._divergence is None:
                self._divergence = self._guard.observe(each.loss)
        if not summaries:  # the pipeline is filling: no minibatch has finished since the last drain
            return torch.tensor(float("nan"), device=self.root_device, requires_grad=True)
        newest = summaries[-1]
        loss_tensor = torch.tensor(newest.loss, device=self.root_device, requires_grad=True)
        return {"loss": loss_tensor, **newest.extra} if newest.extra else loss_tensor

    def _admitted_here(self, first: int, minibatches: int = 1) -> list[int]:
        """The minibatches of this step whose updates this rank will make: the step's one (its ``minibatches``
        under ``minibatches_per_batch``), or under 1F1B-RR pipedream those of the step's ``d`` minibatches that
        this rank's replica owns (m % replicas)."""
        placement = self.placement
        layout = placement.layout
        if layout is None or not self.options.spec.minibatch_updates:
            return list(range(first, first + minibatches))
        r = layout.replicas[placement.stage_index]
        return [m for m in range(first, first + layout.input_replicas) if m % r == placement.replica_index]

    def _data_record(self, batch: Any, batch_idx: int, end_of_data: bool) -> Tensor | None:
        """The batch's fingerprint for the data check (strategy/consistency.py), sent with the step's summary; None
        on the steps that skip it. At an epoch's first batch every rank of the pipeline compares them at once."""
        placement = self.placement
        if placement.num_stages == 1:
            return None
        pipeline = self._pipeline
        assert pipeline is not None
        trainer = self.lightning_module.trainer
        batches = float(trainer.num_training_batches)
        due = is_due(batch_idx, batches, CHECK_EVERY_ASYNC if pipeline.lagged is not None else CHECK_EVERY)
        if not due and batch_idx != 0:
            return None
        record = batch_record(batch, self.global_rank, placement.stage_index, trainer.current_epoch, batch_idx,
                              batches, end_of_data)
        if batch_idx == 0:
            check_epoch_start(record, pipeline.groups.pipeline, self.root_device, placement.stage_index)
        return record if due else None

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: torch.optim.Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """The pipeline back-propagated inside ``training_step``: only Lightning's backward hooks run here."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Lightning's optimizer step: runs the closure (the training step, where the pipeline makes its own
        updates, each through :meth:`_optimizer_step_now`) and nothing else."""
        return closure()

    def _optimizer_step_now(self, optimizer: torch.optim.Optimizer) -> None:
        """One of the pipeline's updates, through the precision plugin: Lightning's hooks, clipping, the step."""
        if scaler_of(self.precision_plugin) is not None:  # 16-mixed: every stage skips an overflowing step
            assert self._pipeline is not None
            agreed_step(self.precision_plugin, optimizer, self.lightning_module, self._pipeline.groups.pipeline)
            return
        self.precision_plugin.optimizer_step(optimizer, model=self.lightning_module, closure=_gradients_ready)

    def _before_update(self, batch_idx: int) -> None:
        """Right before each of the pipeline's updates: sum tied copies, then the stage's replicas' gradients."""
        pipeline = self._pipeline
        assert pipeline is not None
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
        assert self._pipeline is not None
        clip_grad_by_norm(self._pipeline, optimizer, clip_val, asynchronous=self.asynchronous, device=self.root_device)

    # ---------------------------------------------------------------------------------- drain
    def drain(self) -> None:
        """Finish every minibatch in flight (``pipedream``): afterwards all stages hold final weights.

        Every rank must call it at the same point (they do: they run the same steps and hooks).
        """
        pipeline, updates = self._pipeline, self._updates
        if pipeline is None or updates is None or not self.asynchronous or self._failure is not None:
            return
        with updates.pipeline_grads():
            pipeline.engine.drain(updates.apply)

    def _pipeline_failed(self, exception: BaseException) -> None:
        """A step raised (on this rank or a peer): the stages stopped at different places; drain nothing more."""
        self._failure = exception
        if self._updates is not None:
            self._updates.forget()
        if self._pipeline is not None and self._pipeline.lagged is not None:
            self._pipeline.lagged.forget()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # An error outside the pipeline's work (a callback, a checkpoint's write): every peer learns why.
        report_failure(exception, self._pipeline.placement.stage_index if self._pipeline is not None else None)
        self._pipeline_failed(exception)
        super().on_exception(exception)

    # ----------------------------------------------------------------------------- evaluation
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.val_step_context():
            return self._evaluate("validation_step", args, kwargs, send_output=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.test_step_context():
            return self._evaluate("test_step", args, kwargs, send_output=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._evaluate("predict_step", args, kwargs, send_output=True)

    def _evaluate(self, hook: str, args: tuple, kwargs: dict, send_output: bool) -> Any:
        assert self._pipeline is not None
        return evaluate(self._pipeline, self.lightning_module, hook, args, kwargs, options=self.options,
                        device=self.root_device, send_output=send_output)

    # ---------------------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's state dict, keyed by the module's own names, gathered on rank 0."""
        self._refuse_after_failure()
        self.drain()
        assert self._pipeline is not None
        return self._pipeline.checkpoint.state_dict(self._checkpoint_share())

    def _checkpoint_share(self) -> dict[str, Tensor]:
        """This rank's part of the model's state dict, under the module's own names."""
        module = self.lightning_module
        graph = self._pipeline.graph if self._pipeline is not None else None
        if graph is None or graph.graph is None:
            state = module.state_dict()
            return whole_state(state) if self.options.shard is not None else state  # every replica gathers at once
        share = graph.stage.state_dict()
        if self.is_global_zero:  # state the graph never reads (metrics, unused layers) is the same on every rank
            share.update({k: v for k, v in module.state_dict().items() if k not in graph.graph.graph_state_names})
        return share

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
        """The optimizer's state in single-device form (indices over the whole model), on rank 0."""
        self._refuse_after_failure()
        pipeline = self._pipeline
        assert pipeline is not None
        index = self.optimizers.index(optimizer) if optimizer in self.optimizers else 0
        raw = getattr(optimizer, "_optimizer", optimizer)
        if self.options.shard is not None:  # gathered whole on every replica at once, then as without sharding
            raw = WholeOptimizerState(raw)
        return pipeline.checkpoint.optimizer_state(raw, pipeline.optimizer_layouts[index], pipeline.local_names)

    def _refuse_after_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError(
                f"PipeDreamStrategy does not save a checkpoint after a pipeline step failed or was interrupted "
                f"({type(self._failure).__name__}: {self._failure}): its stages stopped in different places, "
                "holding weights of different minibatches, and some may be gone. Resume from the last checkpoint "
                "saved before the failure; it was left as it was."
            )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        state = checkpoint["state_dict"]
        if self.options.shard is not None:  # each replica takes its shards of the consolidated tensors
            state = sharded_model_state(self.lightning_module, dict(state))
        load_own_share(self.lightning_module, state, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pipeline = self._pipeline
        assert pipeline is not None
        states = checkpoint["optimizer_states"]
        for i, optimizer in enumerate(self.optimizers):
            raw = getattr(optimizer, "_optimizer", optimizer)
            local = pipeline.optimizer_layouts[i].to_local(raw, states[i], pipeline.local_names)
            raw.load_state_dict(sharded_optimizer_state(raw, local) if self.options.shard is not None else local)

    # ------------------------------------------------------------------------------------ end
    @override
    def on_train_end(self) -> None:
        self.drain()
        pipeline = self._pipeline
        if pipeline is not None and pipeline.lagged is not None and self._failure is None:
            pipeline.lagged.take_all()  # training stopped between drains (should_stop): deliver, too late to log
        self._write_trace()
        super().on_train_end()

    def _write_trace(self) -> None:
        trace_dir = self.options.trace_dir
        if trace_dir is None or self._pipeline is None:
            return
        from lightning_pipedream.schedule.timeline import to_chrome_trace

        os.makedirs(trace_dir, exist_ok=True)
        events = self._pipeline.engine.executor.events(self.global_rank)
        path = os.path.join(trace_dir, f"trace_rank{self.global_rank}.json")
        with open(path, "w") as f:
            json.dump(to_chrome_trace(events), f)

    @override
    def teardown(self) -> None:
        try:
            self._teardown_module()
        finally:
            if self._keeping_freed_memory:  # training is over: the process gives its freed memory back
                allocator.return_freed_memory()
                self._keeping_freed_memory = False
            # The run is over in this process: its watchdog stops, so that a stop request a failure left in its
            # mailbox does not end the process later (a notebook, or a script that goes on after fit raised).
            watchdog().stop()

    def _teardown_module(self) -> None:
        module = self.lightning_module
        if module is None or not has_meta_tensors(module):
            super().teardown()
            return
        # Setup stopped before materializing (an error): Lightning's module.cpu() cannot copy meta tensors.
        module.cpu = lambda: module._apply(lambda t: t if t.is_meta else t.cpu())  # type: ignore[method-assign]
        try:
            super().teardown()
        finally:
            del module.cpu

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "pipedream", cls, description="Pipeline parallelism, PipeDream's asynchronous 1F1B", schedule="pipedream"
        )
        strategy_registry.register(
            "pipedream_1f1b", cls, description="Pipeline parallelism, 1F1B with flush", schedule="1f1b", chunks=4
        )
        strategy_registry.register(
            "pipedream_gpipe", cls, description="Pipeline parallelism, GPipe", schedule="gpipe", chunks=4
        )


_StrategyRegistry = type(StrategyRegistry)


def _refuse_guard_with_unequal_replicas(placement: Placement) -> None:
    if placement.layout is not None:
        raise ValueError(
            "on_divergence='flush' goes over to 1f1b, which does not run unequal stage replicas (1F1B-RR, "
            f"replicas={list(placement.layout.replicas)}). Drop on_divergence, or replicate whole pipelines (stages=)."
        )


def _refuse_minibatches_with_replicas(placement: Placement, minibatches_per_batch: int) -> None:
    if minibatches_per_batch > 1 and placement.layout is not None:
        raise ValueError(
            f"PipeDreamStrategy(minibatches_per_batch={minibatches_per_batch}) runs on a straight pipeline (or "
            f"data-parallel copies of one); stages with unequal replicas {list(placement.layout.replicas)} (1F1B-RR) "
            "already cut each batch into one minibatch per input replica. Drop minibatches_per_batch, or use equal "
            "replicas."
        )


def _keep_parameters(optimizers: list[torch.optim.Optimizer], keep: set[int]) -> None:
    """Drop from the optimizers' groups the parameters another stage trains."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in keep]


def _reduced_in_updates(average: bool = False) -> int:
    """The replicated schedule's ALLREDUCE_GRAD: a no-op, the strategy all-reduces right before each update
    (so that accumulated gradients are summed once per update, not once per step)."""
    return 0


def _gradients_ready() -> None:
    """The closure of the pipeline's optimizer steps: the gradients are already in ``.grad``."""
    return None



_package_log = logging.getLogger("lightning_pipedream")
if not _package_log.handlers and not logging.getLogger().handlers:
    # As Lightning does for its own logger: the plan reaches the console unless the user configured logging.
    _package_log.addHandler(logging.StreamHandler())
    _package_log.setLevel(logging.INFO)

PipeDreamStrategy.register_strategies(StrategyRegistry)

__all__ = ["NonFiniteError", "PipeDreamStrategy", "SCHEDULES"]
