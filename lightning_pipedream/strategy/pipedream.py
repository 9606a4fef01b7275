"""PipeDreamStrategy: the Lightning strategy that trains a LightningModule as a pipeline, one stage per process.

Its hooks delegate: the user's options are a :class:`PipelineOptions`; setup's :class:`StagePipelineBuilder` decides
where the stages live (a :class:`Placement`) and builds this rank's :class:`StagePipeline`; a fit's batches, updates
and drains are a :class:`Training`, each batch a :class:`TrainingStep`; evaluation and checkpoints have their own
modules.
"""

from __future__ import annotations

import logging
import os
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
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from typing_extensions import override

from lightning_pipedream.runtime.execution import allocator
from lightning_pipedream.runtime.faults import flight
from lightning_pipedream.runtime.faults.failures import report_failure, setup_failures
from lightning_pipedream.runtime.faults.launch import rendezvous_store
from lightning_pipedream.runtime.faults.watchdog import watchdog
from lightning_pipedream.runtime.stages.materialize import has_meta_tensors
from lightning_pipedream.schedule.specs import SCHEDULES
from lightning_pipedream.strategy.checkpoints.checkpoint import AtomicCheckpointIO, writes_itself
from lightning_pipedream.strategy.checkpoints.sharded_checkpoint import PipelineCheckpoints, refuse_after_failure
from lightning_pipedream.strategy.checkpoints.single_file import stream_saves
from lightning_pipedream.strategy.inference.evaluation import evaluate
from lightning_pipedream.strategy.reporting import collectives, hook_failures, model_summary
from lightning_pipedream.strategy.setup.batches import batch_args, loop_loader
from lightning_pipedream.strategy.setup.checks import (
    check_last_batch_fits,
    check_optimizers,
    check_training_supported,
    refuse_guard_with_unequal_replicas,
    refuse_minibatches_with_accumulation,
    refuse_minibatches_with_replicas,
)
from lightning_pipedream.strategy.setup.options import DEFAULT_FACTOR, PipelineOptions
from lightning_pipedream.strategy.setup.placement import Placement, ProcessGroups
from lightning_pipedream.strategy.setup.stage_pipeline import (
    Ranks,
    StagePipeline,
    StagePipelineBuilder,
    check_shard_layout,
    choose_automatically,
    decide_placement,
)
from lightning_pipedream.strategy.training.divergence import Divergence
from lightning_pipedream.strategy.training.resume import prepare_training_loader
from lightning_pipedream.strategy.training.training import Training, drain_before_callbacks

log = logging.getLogger(__name__)

TBroadcast = TypeVar("TBroadcast")
_DEFAULT_TIMEOUT = timedelta(minutes=30)


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
        trace, trace_steps, trace_memory, log_figures: traced windows, stage figures (docs/reading_a_run.md).
        keep_freed_memory: on CPU, tell each rank's C allocator (glibc) to keep freed blocks for reuse rather than
            return them to the OS (:func:`~.allocator.keep_freed_memory`): faulting a stage's gradients and activations
            back in every minibatch cost ``pipedream`` ~10 % of its step in ``benchmarks/speed/lightning.py``.
            Resident memory then stays at its peak until ``teardown`` gives it back. No effect on GPU devices.
        mean_over: for a loss that is a mean over something other than the batch's samples, a function counting
            it in a piece of a batch (``lambda batch: (batch[1] != -100).sum()``): each micro-batch's loss counts by
            its count over the batch's, exactly one device (docs/strategy.md, "Losses"). Labels passed as ``labels=``
            or a dict batch's ``"labels"`` are counted so by default (strategy/setup/labels.py).
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
            the minibatch). The updates are those of a DataLoader giving the minibatches one per step, but the
            per-step work of Lightning and the strategy is paid once per batch (docs/strategy.md, "Several
            minibatches per batch"). A step then counts ``minibatches_per_batch``
            updates for ``max_steps``, step-wise LR schedulers (every minibatch of a batch gets the rate of its
            step) and checkpoints every n steps; its logged values and loss are the mean over its minibatches.
        transport: how the stages talk: ``"auto"`` (shared memory between CPU ranks on one machine over gloo,
            torch.distributed otherwise), ``"gloo"``, ``"shm"``, or ``"directional"`` (each direction of a link on a
            process group of its own: the path NCCL takes, which GPU runs always use; docs/strategy.md, "On GPUs").
            None (default): the environment's ``LIGHTNING_PIPEDREAM_TRANSPORT``, else ``"auto"``.
        shard: with data-parallel pipelines (``stages=S`` on ``S x d`` devices) and ``gpipe``, ``1f1b``, ``zb-h1``
            (weights kept gathered through the step) or ``interleaved`` (each model chunk sharded on its own): each
            stage's ``d`` replicas shard its weights, gradients and optimizer state with torch's FSDP2 (``"full"``:
            weights gathered for each forward and backward; ``"grad_op"``: kept whole from a forward to its
            backward) instead of keeping whole copies; the step's last backward reduce-scatters the gradients once.
            None (default): whole copies, gradients all-reduced. Under ``schedule="auto"``, ``"auto"`` lets the planner
            weigh whole against sharded replicas under ``memory_limit`` (plan/shards.py).
        pretrained: for a model built on the meta device, a safetensors file, Hugging Face directory, torch state dict
            or torch.distributed.checkpoint directory from which each rank reads only its stage's tensors
            (docs/big_models.md).
        pretrained_prefix: the prefix that turns ``pretrained``'s keys into the module's names (default: found).
        checkpoint: ``"sharded"``: a checkpoint is a directory in which each rank writes its own stage's weights and
            optimizer state by parameter name (torch.distributed.checkpoint and ``meta.pt``; it resumes on any layout;
            ``python -m lightning_pipedream checkpoint consolidate`` makes one file of it); ``"full"``: one file in
            single-device form, gathered on rank 0; ``"auto"`` (default): sharded from 1 GiB of weights, else full;
            ``"sharded-async"``: sharded, a fit's saves written in the background (docs/strategy.md, "Long runs").
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
        transport: str | None = None, trace_memory: bool = False,
        shard: str | None = None, log_figures: bool = True, trace_steps: tuple[int, int] | None = None,
        pretrained: str | os.PathLike | None = None, pretrained_prefix: str | None = None, checkpoint: str = "auto",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = _DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.options = PipelineOptions.from_arguments(locals())  # each field from the argument of its name
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
        self.explanation: Any = None  # rank 0, after a fit with a plan: its prediction explained (plan/explain.py)
        self._pipeline: StagePipeline | None = None
        self._training: Training | None = None  # a fit's batches, updates and drains, from setup on
        self._failure: BaseException | None = None
        self._keeping_freed_memory = False  # set while this process keeps freed memory (from setup to teardown)
        self.checkpoints = PipelineCheckpoints(checkpoint)  # what the checkpoint hooks delegate to

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
        return decide_placement(self.options, self.world_size, self.global_rank, self.plan)

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

    @property
    def switched(self) -> Divergence | None:
        """``on_divergence='flush'``: why the run went over to 1f1b, once it has."""
        return self._training.switched if self._training is not None else None

    @override
    def _configure_launcher(self) -> None:
        # The Trainer knows its devices and nodes now, before any process starts: refuse what cannot run here.
        if self.options.auto:  # the planner decides the stages in setup
            super()._configure_launcher()
            return
        world_size = self.num_nodes * self.num_processes
        placement = decide_placement(self.options, world_size, 0, self.plan)
        if self.options.on_divergence is not None:
            refuse_guard_with_unequal_replicas(placement)
        refuse_minibatches_with_replicas(placement, self.options.minibatches_per_batch)
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

    # Lightning's collectives (strategy/reporting/collectives.py): refused inside a pipelined step, issued after a drain
    # during an asynchronous fit, every wait bounded by the timeout and named (a peer's failure reaches this rank).
    barrier, broadcast, reduce, all_gather = collectives.barrier, collectives.broadcast, collectives.reduce, \
        collectives.all_gather

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
            self.options, self.plan = choose_automatically(self.options, self._ranks(), trainer, module, fitting,
                                                           self.batch_to_device)
        if fitting:
            check_training_supported(module, self.precision_plugin, self.options.schedule, self.asynchronous)
            refuse_minibatches_with_accumulation(self.options.minibatches_per_batch, trainer.accumulate_grad_batches)
            if self.asynchronous and self.options.chunks > 1:  # 2bw: every step admits chunks micro-batches
                check_last_batch_fits(loop_loader(trainer.fit_loop), self.options.chunks, self.placement.num_pipelines,
                                      self.options.schedule)
        if self._pipeline is None or self._pipeline.module is not module:
            self.checkpoints.measure(module)  # still whole (or on meta): checkpoint="auto" goes by its size
            builder = StagePipelineBuilder(self.options, self._ranks(), self.plan, self.batch_to_device)
            self._pipeline = builder.build(trainer, module, fitting, self._prepare_module)
            self.plan, self.balance = builder.plan, builder.balance
        else:  # a later fit/validate/test/predict with the same model: keep its stages
            self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            check_optimizers(self.optimizers)
            self._pipeline.prepare_fit(self.optimizers)  # the optimizers train this stage; their layout for checkpoints
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._training = Training(self.options, self._pipeline, trainer, module, self.precision_plugin,
                                      self.root_device, self.global_rank, lambda: self.optimizers, self.switched,
                                      timeout=self._timeout)
            drain_before_callbacks(trainer, self.drain, self._pipeline_failed)
            model_summary.summary_without_example_input(trainer)  # its forward would need every stage
        self._failure = None
        self.checkpoints.after_setup(self._pipeline)  # a sharded checkpoint's weights, now that the stage exists
        self.checkpoints.open_background(fitting)  # checkpoint="sharded-async": a fit's saves in the background
        stream_saves(trainer)  # trainer.save_checkpoint writes a single file stage by stage

    def _ranks(self) -> Ranks:
        return Ranks(self.global_rank, self.world_size, len(self.parallel_devices or [None]), self.num_nodes,
                     self.root_device, self._process_group_backend, self._timeout)

    def _prepare_module(self) -> None:
        """Once this rank holds only its stage: the precision plugin's conversion, then the device."""
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device; :meth:`setup` gives real weights to this rank's stage only."""
        with torch.device("meta"):
            yield

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds on the meta device too: each stage materializes alone."""
        with torch.device("meta") if empty_init else super().tensor_init_context(empty_init):
            yield

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Keep a custom sampler's order (Lightning's wrapper with ``shuffle=True`` permutes it, a language model's
        contiguous streams say): the wrapper only shards it between pipelines; every stage reads the same batches."""
        sampler = getattr(dataloader, "sampler", None)
        if isinstance(sampler, DistributedSamplerWrapper) and sampler.shuffle:
            sampler.shuffle = False
        prepare_training_loader(dataloader, self.lightning_module)  # a resume reads its epoch in that epoch's order
        return dataloader

    @override
    def configure_ddp(self) -> None:  # no DistributedDataParallel wrapper: stages don't share weights
        pass

    # -------------------------------------------------------------------------- training step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Admit the batch into the pipeline and run this rank's actions of the step (:class:`TrainingStep`).

        The pipeline's forwards, backwards and updates all happen here; Lightning's own backward and
        optimizer step that follow only run their hooks (see :class:`PipelineUpdates`).
        """
        assert self._training is not None
        result = self._training.step(*batch_args(args, kwargs))
        self.options = self._training.options  # on_divergence may have gone over to 1f1b
        return result

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
        updates, each through the precision plugin) and nothing else."""
        return closure()

    # ---------------------------------------------------------------------------------- drain
    def drain(self) -> None:
        """Finish every minibatch in flight (``pipedream``): afterwards all stages hold final weights.

        Every rank must call it at the same point (they do: they run the same steps and hooks).
        """
        if self._training is not None and self._failure is None:
            self._training.drain()

    def _pipeline_failed(self, exception: BaseException) -> None:
        """A step raised (on this rank or a peer): the stages stopped at different places; drain nothing more."""
        self._failure = exception
        if self._training is not None:
            self._training.failed()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # An error outside the pipeline's work (a callback, a checkpoint's write): every peer learns why.
        hook_failures.explain_epoch_end_failure(exception, self._pipeline.placement if self._pipeline else None)
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
        with collectives.inside_step(hook):
            return evaluate(self._pipeline, self.lightning_module, hook, args, kwargs, options=self.options,
                            device=self.root_device, send_output=send_output)

    # ---------------------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """By the module's own names: this rank's share (sharded checkpoints), or the whole model on rank 0."""
        refuse_after_failure(self._failure)
        self.drain()
        assert self._pipeline is not None
        return self.checkpoints.model_state(self._pipeline, self.is_global_zero)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
        """By parameter name, this rank's (sharded); or in single-device form on rank 0."""
        refuse_after_failure(self._failure)
        assert self._pipeline is not None
        index = self.optimizers.index(optimizer) if optimizer in self.optimizers else 0
        return self.checkpoints.optimizer_state(self._pipeline, optimizer, index)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        assert self._pipeline is not None
        self.checkpoints.save(checkpoint, os.fspath(filepath), self._pipeline, self.is_global_zero, self.broadcast,
                              lambda c, path: DDPStrategy.save_checkpoint(self, c, path, storage_options),
                              storage_options, streamable=writes_itself(self.checkpoint_io, filepath, storage_options),
                              device=self.root_device)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:  # ModelCheckpoint's older ones: after the save in flight
        self.checkpoints.remove(os.fspath(filepath), lambda: super(PipeDreamStrategy, self).remove_checkpoint(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self.checkpoints.load(os.fspath(checkpoint_path), weights_only,
                                     lambda path: DDPStrategy.load_checkpoint(self, path, weights_only))

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.checkpoints.load_model(checkpoint, strict, self.lightning_module, self.options.shard is not None)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self._pipeline is not None
        self.checkpoints.load_optimizers(checkpoint, self._pipeline, self.optimizers)

    # ------------------------------------------------------------------------------------ end
    @override
    def on_train_end(self) -> None:
        self.drain()
        if self._training is not None and self._failure is None:
            self._training.finish()  # still on its way: summaries, SIGTERM flags; the last steps' figures, the trace
        self.checkpoints.end_background()  # the last asynchronous save is complete before fit returns
        super().on_train_end()

    @override
    def teardown(self) -> None:
        try:
            self.checkpoints.end_background(failed=self._failure is not None)
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
        for name, description, options in (("pipedream", "PipeDream's asynchronous 1F1B", {"schedule": "pipedream"}),
                                           ("pipedream_1f1b", "1F1B with flush", {"schedule": "1f1b", "chunks": 4}),
                                           ("pipedream_gpipe", "GPipe", {"schedule": "gpipe", "chunks": 4})):
            strategy_registry.register(name, cls, description=f"Pipeline parallelism, {description}", **options)


_StrategyRegistry = type(StrategyRegistry)


_package_log = logging.getLogger("lightning_pipedream")
if not _package_log.handlers and not logging.getLogger().handlers:
    # As Lightning does for its own logger: the plan reaches the console unless the user configured logging.
    _package_log.addHandler(logging.StreamHandler())
    _package_log.setLevel(logging.INFO)

PipeDreamStrategy.register_strategies(StrategyRegistry)

__all__ = ["PipeDreamStrategy", "SCHEDULES"]
