"""PipeDreamStrategy: the Lightning strategy that trains a LightningModule as a pipeline, one stage per process."""

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
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from typing_extensions import override

from lightning_pipedream.plan.balance import stage_slice
from lightning_pipedream.runtime import allocator
from lightning_pipedream.runtime.engine import PipelineEngine
from lightning_pipedream.runtime.graph_stage import CapturedStage
from lightning_pipedream.runtime.materialize import has_meta_tensors, materialize
from lightning_pipedream.runtime.microbatch import batch_size, flatten, split
from lightning_pipedream.runtime.replicas import GradientReducer
from lightning_pipedream.runtime.transport import Transport
from lightning_pipedream.schedule.actions import Action, Layout
from lightning_pipedream.schedule.builders import SCHEDULES, check_schedule_options, inference
from lightning_pipedream.strategy.batches import (
    batch_args,
    fingerprint,
    merge_outputs,
)
from lightning_pipedream.strategy.calls import (
    Elsewhere,
    ForwardCall,
    LogRecorder,
    SequentialCall,
    find_layers,
    loss_of,
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
    check_optimizers,
    check_stage_trains,
    check_training_supported,
    optimizers_unvalidated,
)
from lightning_pipedream.strategy.graph_path import GraphPath
from lightning_pipedream.strategy.placement import StagePlacement
from lightning_pipedream.strategy.summaries import LaggedFromSources, LaggedSummaries, StepSummary, SummaryChannel
from lightning_pipedream.strategy.updates import PipelineDrain, PipelineUpdates
from lightning_pipedream.tree import map_tensors

log = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = timedelta(minutes=30)
# Under pipedream, Lightning's per-batch SIGTERM broadcast (a collective over all ranks) runs every this many batches.
SIGTERM_CHECK_EVERY = 32
_CPU = torch.device("cpu")  # where a step's extra outputs go before they travel pickled


class PipeDreamStrategy(StagePlacement, GraphPath, DDPStrategy):
    """Train a LightningModule as a pipeline, one stage per process.

    A module whose layers are one ``nn.Sequential`` is split between those layers; any other module
    is split from its forward call (``self(...)`` in a step) captured as a graph with torch.export,
    at the ``split_points`` given or where PipeDream's partitioner puts them after profiling.

    Args:
        schedule: ``"pipedream"`` (asynchronous 1F1B with weight stashing, each batch one
            minibatch), ``"1f1b"`` (one-forward-one-backward with a flush), ``"gpipe"``, ``"zb-h1"``
            (1F1B with each backward split, its weight half deferred into the bubbles), ``"interleaved"``
            (Megatron's 1F1B over ``virtual_stages`` model chunks per process) or ``"2bw"``
            (PipeDream-2BW: micro-batches, two weight versions, the update one step late, no flush).
        chunks: micro-batches per batch (``pipedream`` takes 1).
        virtual_stages: ``interleaved`` only: model chunks per process; the layers are cut into
            processes x ``virtual_stages`` stages (evenly, or by ``balance``) and process r holds stages
            r, r + processes, ... Needs a module whose layers are one ``nn.Sequential``.
        recompute: keep only each stage's inputs between forward and backward and replay the forward
            in the backward (RNG restored: the same dropout masks); less memory, one more forward.
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
            rather than return them to the OS (:func:`~lightning_pipedream.runtime.allocator.keep_freed_memory`):
            a stage allocates its gradients and activations anew every minibatch, and faulting their
            pages back in cost ``pipedream`` ~10 % of its step time in ``benchmarks/lightning.py``. The
            ranks' resident memory then stays at its peak until ``teardown`` gives the freed memory back.
            No effect on GPU devices.
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
        recompute: bool = False,
        keep_freed_memory: bool = True,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = _DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        check_schedule_options(schedule, chunks, vertical_sync, virtual_stages=virtual_stages, recompute=recompute)
        if start_method != "popen":
            # spawn/fork launchers copy only rank 0's weights back to the main process: wrong for a pipeline.
            raise ValueError(
                f"PipeDreamStrategy(start_method={start_method!r}) is not supported: those launchers return only "
                "rank 0's weights, which hold one stage. Use the default start_method='popen' (or torchrun)."
            )
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
        self.schedule = schedule
        self.chunks = chunks
        self.virtual_stages = virtual_stages
        self.recompute = recompute
        self.keep_freed_memory = keep_freed_memory
        self._keeping_freed_memory = False  # set while this process keeps freed memory (from setup to teardown)
        # pipedream and 2bw keep the pipeline full across training steps (a drain empties it).
        self.asynchronous = schedule in ("pipedream", "2bw")
        self._balance_arg = list(balance) if balance is not None else None
        self._plan_path = plan
        self._layers_arg = layers
        self._split_points = list(split_points) if split_points is not None else None
        if plan is not None and virtual_stages > 1:
            raise ValueError(
                "PipeDreamStrategy(plan=...) gives one layer range per process; schedule='interleaved' with "
                f"virtual_stages={virtual_stages} needs processes x {virtual_stages} of them. Give balance= with that "
                "many layer counts, or drop plan= for an even split."
            )
        if split_points is not None and layers is not None:
            raise ValueError(
                "PipeDreamStrategy takes layers= (split an nn.Sequential between its layers) or split_points= (split "
                "the traced forward graph at module names), not both."
            )
        self.weight_stashing = weight_stashing
        self.vertical_sync = vertical_sync
        self.bandwidth = bandwidth
        self.straight = straight
        if not straight:
            given = [name for name, value in (("plan", plan), ("balance", balance), ("replicas", replicas),
                                              ("stages", stages), ("split_points", split_points)) if value is not None]
            if given:
                raise ValueError(
                    f"PipeDreamStrategy(straight=False) lets the planner choose stages and replicas, but {given} "
                    "already decide them. Drop those, or keep straight=True."
                )
        self.trace_dir = trace
        if stages is not None and (not isinstance(stages, int) or stages < 1):
            raise ValueError(f"stages must be an integer >= 1 (the pipeline's length), got {stages!r}.")
        self._stages_arg = stages
        self._replicas_arg = list(replicas) if replicas is not None else None
        self._layout: Layout | None = None  # replicated stages with different counts (1F1B-RR); None otherwise
        self.check_finite = check_finite
        self._finite: FiniteChecks | None = None
        self._step_context = "setup"  # what the pipeline runs now, for error messages
        self._pipeline_group: dist.ProcessGroup | None = None  # this rank's pipeline: its ranks are the stages
        self._replica_group: dist.ProcessGroup | None = None  # this rank's stage in every pipeline
        self._reducer: GradientReducer | None = None
        self.plan: Any = None  # the Plan used (from plan.json or the partitioner), if any
        self.balance: list[int] | None = None
        self._layers_name = ""
        self._call: SequentialCall | ForwardCall = ForwardCall()  # SubmoduleCall is a ForwardCall
        self._graph: CapturedStage | None = None  # the graph path's stage, captures and tied copies
        self._graph_inputs_seen: set[tuple] = set()
        self._stage_module: nn.Module | None = None
        self._chunks: list[nn.Module] = []  # interleaved: this rank's model chunks, stages r, r + p, ...
        self._module_set_up: LightningModule | None = None
        self._engine: PipelineEngine | None = None
        self._updates: PipelineUpdates | None = None
        self._summary: SummaryChannel | None = None
        self._summary_group: dist.ProcessGroup | None = None  # pipedream: the summaries' own point-to-point group
        self._lagged: LaggedFromSources | None = None  # pipedream: summaries used ``stages - 1`` steps late
        self._checkpoint: CheckpointGather | None = None
        self._optimizer_layouts: list[OptimizerLayout] = []
        self._local_names: dict[int, str] = {}
        self._failure: BaseException | None = None

    # ----------------------------------------------------------------------------------- ranks
    @property
    def num_stages(self) -> int:
        """Stages of one pipeline (``stages=``, ``replicas=``, or one per process)."""
        if self._layout is not None:
            return self._layout.num_stages
        return self._stages_arg if self._stages_arg is not None else self.world_size

    @property
    def num_pipelines(self) -> int:
        """Data-parallel copies of the pipeline: processes / stages (1 with unequal replicas)."""
        if self._layout is not None:
            return 1
        return max(1, self.world_size // self.num_stages)

    @property
    def stage_index(self) -> int:
        # Stage-major ranks (see ReplicaGroups): stage s of pipeline k is rank s * pipelines + k, so a
        # stage's replicas are neighbours (on one node when they fit) and all-reduce over fast links.
        if self._layout is not None:
            return self._layout.stage_of(self.global_rank)
        return self.global_rank // self.num_pipelines

    @property
    def pipeline_index(self) -> int:
        return 0 if self._layout is not None else self.global_rank % self.num_pipelines

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of a pipeline must see the same batches: the data-parallel degree is the number of
        # pipelines, not the world size; pipeline k reads shard k.
        return {"num_replicas": self.num_pipelines, "rank": self.pipeline_index}

    # ----------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self.keep_freed_memory and self.root_device.type == "cpu" and not self._keeping_freed_memory:
            self._keeping_freed_memory = allocator.keep_freed_memory()
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            check_training_supported(module, self.precision_plugin)

        if self._engine is None or module is not self._module_set_up:
            if fitting and not self.straight and self.world_size > 1:
                self._plan_with_replication(trainer, module)
            self._decide_layout()
            if fitting and self._layout is not None and self.schedule == "pipedream" and (
                    trainer.accumulate_grad_batches > 1):
                raise ValueError(
                    f"PipeDreamStrategy(schedule='pipedream') with replicas {list(self._layout.replicas)} and "
                    f"accumulate_grad_batches={trainer.accumulate_grad_batches}: PipeDream's 1F1B-RR makes each shard "
                    "a minibatch of its own and does not accumulate. Use a larger batch instead, or schedule='1f1b'."
                )
            self._make_groups()
            full_keys = list(module.state_dict())
            # The full model's optimizer layout maps checkpoints (single-device form) to this rank's stage.
            self._optimizer_layouts = OptimizerLayout.of_module(module, optimizers_unvalidated)
            if fitting and len(self._optimizer_layouts) > 1:
                raise ValueError(
                    f"{type(module).__name__}.configure_optimizers returns {len(self._optimizer_layouts)} optimizers; "
                    "PipeDreamStrategy trains with one (automatic optimization, which takes one). Use one optimizer "
                    "with a parameter group per part of the model for different learning rates or settings."
                )
            layers = self._sequential_layers(module)
            if layers is not None:
                self._call = SequentialCall(self._layers_name)
                self.balance = self._decide_balance(trainer, module, layers)
                self._keep_own_stage(module, layers)
            else:
                if has_meta_tensors(module):
                    raise ValueError(
                        f"{type(module).__name__} was built on the meta device (configure_model under "
                        "PipeDreamStrategy, or torch.device('meta')), which PipeDreamStrategy materializes per stage "
                        "only for a module whose layers are one nn.Sequential; this one's forward graph must be "
                        "traced with real weights. Put the layers in one nn.Sequential, or build the model on a "
                        "real device (in __init__)."
                    )
                if self.virtual_stages > 1:
                    raise ValueError(
                        f"schedule='interleaved' with virtual_stages={self.virtual_stages} splits the layers of one "
                        f"nn.Sequential into model chunks, but {type(module).__name__}'s are not one nn.Sequential. "
                        "Put the layers in one nn.Sequential (layers= names it), or use virtual_stages=1."
                    )
                self._call = ForwardCall()
                self._split_captured_graph(trainer, module)
            self._module_set_up = module
            self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            assert self._stage_module is not None
            self._stage_module.to(self.root_device)  # a graph stage is not a child of the module
            self._build_engine()
            if self.check_finite:
                self._finite = FiniteChecks(self._stage_module, self.stage_index, lambda: self._step_context,
                                            per_layer=self._graph is None)
            sources = self._last_stage_ranks()
            self._summary = SummaryChannel(self.stage_index, self.num_stages, self.root_device, self._pipeline_group,
                                           self._replica_group, self.num_pipelines, source=sources[0],
                                           sources=sources)
            if self._summary_group is not None:
                me = dist.get_rank(self._summary_group)
                self._lagged = LaggedFromSources([LaggedSummaries(
                    self._summary, self._summary_group, source=source,
                    receivers=[r for r in range(dist.get_world_size(self._summary_group)) if r != source],
                    lag=self.num_stages - 1, is_source=me == source,
                ) for source in sources])
            self._checkpoint = CheckpointGather(self.global_rank, self.world_size, full_keys)
            if self._replica_group is not None:
                self._reducer = GradientReducer(self._stage_module.parameters(), self._replica_group)
        else:  # a later fit/validate/test/predict with the same model: keep its stages
            self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            check_optimizers(self.optimizers)
            if self._graph is not None:  # every rank holds the whole module; its optimizer takes its stage's share
                _keep_parameters(self.optimizers, {id(p) for p in self._stage_module.parameters()})
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
            assert self._stage_module is not None
            self._updates = PipelineUpdates(
                list(self._stage_module.parameters()), lambda: self.optimizers, self._optimizer_step_now,
                before_step=self._before_update,
            )
            if self._lagged is not None:
                self._check_sigterm_every_few_batches(trainer)
            if not any(isinstance(c, PipelineDrain) for c in trainer.callbacks):
                # First, so that no other callback sees a model with minibatches in flight.
                trainer.callbacks.insert(0, PipelineDrain(self.drain, self._pipeline_failed))
        self._failure = None

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

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Lightning runs ``configure_model`` in here: its layers are built on the meta device (shapes, no
        storage), and :meth:`setup` gives real weights only to this rank's stage (per-stage construction)."""
        with torch.device("meta"):
            yield

    @override
    def teardown(self) -> None:
        try:
            self._teardown_module()
        finally:
            if self._keeping_freed_memory:  # training is over: the process gives its freed memory back
                allocator.return_freed_memory()
                self._keeping_freed_memory = False

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

    def _shared_seed(self) -> int:
        """Rank 0's initial seed, from which every layer built on the meta device is initialized (see
        :func:`materialize`): the weights do not depend on which rank holds a layer."""
        payload = [torch.initial_seed()]
        if self.world_size > 1:
            dist.broadcast_object_list(payload, src=0)
        return int(payload[0])

    def _before_update(self, batch_idx: int) -> None:
        """Right before each of the pipeline's updates: sum tied copies, then the stage's replicas' gradients."""
        if self._finite is not None:
            self._finite.check_gradients(batch_idx)
        if self._graph is not None:
            self._graph.before_update()
        if self._reducer is not None:
            # Shares of one batch's loss are summed (each pipeline's counts 1/pipelines); PipeDream's 1F1B-RR averages
            # its replicas' minibatches (over those that had one, in a drain's last round).
            self._reducer.reduce(average=self._layout is not None and self.schedule == "pipedream")

    def _sequential_layers(self, module: LightningModule) -> nn.Sequential | None:
        """The module's Sequential to split between layers, or None to split its traced forward graph."""
        if self._split_points is not None:
            return None
        if self._layers_arg is not None:  # asked for by name: its errors are the user's to see
            self._layers_name, layers = find_layers(module, self._layers_arg)
            return layers
        try:
            self._layers_name, layers = find_layers(module, None)
        except ValueError as not_sequential:
            if self.is_global_zero:
                log.info("PipeDreamStrategy: %s is not one nn.Sequential (%s); it splits the graph of its forward "
                         "call instead.", type(module).__name__, str(not_sequential).split(";")[0])
            return None
        return layers

    def _keep_own_stage(self, module: LightningModule, layers: nn.Sequential) -> None:
        """Replace the other stages' layers by placeholders so this rank holds only its own."""
        assert self.balance is not None
        # interleaved: this rank's model chunks are stages r, r + p, ... (one stage otherwise)
        mine = [c * self.num_stages + self.stage_index for c in range(self.virtual_stages)]
        self._chunks = [stage_slice(layers, self.balance, s) for s in mine]
        own = self._chunks[0] if len(mine) == 1 else nn.Sequential(
            OrderedDict((name, layer) for chunk in self._chunks for name, layer in chunk.named_children())
        )
        check_stage_trains(own, self.stage_index, self.balance)
        stage_of = [s for s, count in enumerate(self.balance) for _ in range(count)]
        for i, name in enumerate(list(layers._modules)):
            if name not in own._modules:
                layers._modules[name] = Elsewhere(name, stage_of[i])
        if has_meta_tensors(module):  # built on the meta device: real weights for this stage only
            materialize(module, self.root_device, self._shared_seed())
        self._stage_module = own
        prefix = f"{self._layers_name}."
        self._local_names = {id(p): prefix + n for n, p in own.named_parameters()}

    def _build_engine(self) -> None:
        assert self._stage_module is not None
        self._engine = PipelineEngine(
            self._chunks if self.virtual_stages > 1 else self._stage_module,
            self.stage_index,
            self.num_stages,
            Transport(group=self._pipeline_group, device=self.root_device),
            schedule=self.schedule,
            chunks=self.chunks,
            weight_stashing=self.weight_stashing,
            vertical_sync=self.vertical_sync,
            record=self.trace_dir is not None,
            # 1F1B-RR: the engine runs the replicated schedule; the replicas' all-reduce happens in our updates.
            replicas=self._layout.replicas if self._layout is not None else None,
            rank=self.global_rank if self._layout is not None else None,
            allreduce=_reduced_in_updates if self._layout is not None else None,
            recompute=self.recompute,
            virtual_stages=self.virtual_stages,
        )

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

    # ---------------------------------------------------------------------------- training step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Admit the batch into the pipeline and run this rank's actions of the step.

        The pipeline's forwards, backwards and updates all happen here; Lightning's own backward and
        optimizer step that follow only run their hooks (see :class:`PipelineUpdates`).
        """
        engine, updates = self._engine, self._updates
        assert engine is not None and updates is not None
        module = self.lightning_module
        trainer = module.trainer
        batch, batch_idx = batch_args(args, kwargs)
        if batch_idx == 0:
            self._check_same_batch(batch)
        epoch_loop = trainer.fit_loop.epoch_loop
        closes_group = not epoch_loop._should_accumulate()  # Lightning steps the optimizer after this batch
        end_of_data = epoch_loop._num_ready_batches_reached()
        last_step = closes_group and 0 < trainer.max_steps <= trainer.global_step + 1

        parts, piece = self._pieces(batch)
        sizes = [batch_size(p) for p in parts]
        total = sum(sizes)
        # As Lightning divides the loss of each accumulated batch; and each pipeline's loss counts 1/pipelines in the
        # replicas' summed gradient.
        scale = 1.0 / (trainer.accumulate_grad_batches * self.num_pipelines)
        flushed = not self.asynchronous
        # PipeDream's 1F1B-RR: each of the batch's d shards is a minibatch of its own, and a replicated stage
        # averages its replicas' gradients (rather than summing shares of one batch's loss).
        round_robin = self._layout is not None and self.schedule == "pipedream"
        recorder = LogRecorder()
        step_outputs: list[Any] = []
        batch_loss = [0.0]

        def part(mb: int) -> Any:  # pipedream and 2bw number micro-batches on across steps
            return parts[piece(mb % len(parts))]

        def inputs(mb: int) -> Any:
            return self._call.input_of(module, "training_step", part(mb), batch_idx)

        def loss(mb: int, output: Any) -> Tensor:
            size = sizes[piece(mb % len(parts))]
            with self._call.replaying(module, output), recorder.capture(module, size):
                step_output = module.training_step(part(mb), batch_idx)
            value = loss_of(step_output)
            step_outputs.append(step_output)
            share = size / total
            batch_loss[0] += float(value.detach()) * share
            weight = scale if round_robin else share * scale
            return value * weight if weight != 1.0 else value

        self._ensure_captured(module, "training_step", parts, batch_idx)
        self._step_context = f"training step {batch_idx} of epoch {trainer.current_epoch}"
        for minibatch in self._admitted_here(engine.next_minibatch):
            updates.admit(minibatch, batch_idx, closes_group)
        with self.precision_plugin.train_step_context(), updates.pipeline_grads():
            engine.train_step(inputs, loss, updates.apply)
            if not flushed and (end_of_data or last_step):
                # Every stage finishes its minibatches before the epoch's end hooks, validation and checkpoints.
                engine.drain(updates.apply)

        summary = None
        if self.is_last_stage:  # a replica of a replicated last stage may own none of the step's micro-batches
            last = step_outputs[-1] if step_outputs else None
            extra = {}
            if isinstance(last, Mapping):
                extra = {k: map_tensors(_to_cpu, v) for k, v in last.items() if k != "loss"}
            summary = StepSummary(batch_loss[0], extra, recorder.aggregate())
        assert self._summary is not None
        if self._lagged is not None:  # pipedream: minibatch t's summary is used at step t + stages - 1
            summaries = self._lagged.step(summary)
            if end_of_data or last_step:
                summaries += self._lagged.take_all()
        else:
            summaries = [self._summary.exchange(summary)]
        for each in summaries:
            LogRecorder.replay(module, each.logs)
        if not summaries:  # the pipeline is filling: no minibatch has finished since the last drain
            return torch.tensor(float("nan"), device=self.root_device, requires_grad=True)
        newest = summaries[-1]
        loss_tensor = torch.tensor(newest.loss, device=self.root_device, requires_grad=True)
        return {"loss": loss_tensor, **newest.extra} if newest.extra else loss_tensor

    def _admitted_here(self, first: int) -> list[int]:
        """The minibatches of this step whose updates this rank will make: the step's one, or under 1F1B-RR
        pipedream those of the step's ``d`` minibatches that this rank's replica owns (m % replicas)."""
        if self._layout is None or self.schedule != "pipedream":
            return [first]
        layout, rank = self._layout, self.global_rank
        r = layout.replicas[layout.stage_of(rank)]
        return [m for m in range(first, first + layout.input_replicas) if m % r == layout.replica_of(rank)]

    def _pieces(self, batch: Any) -> tuple[list[Any], Callable[[int], int]]:
        """A training batch's micro-batches, and which of them the schedule's micro-batch number m is.

        With unequal replicas (1F1B-RR) every rank has the whole batch: it is split into one shard per
        replica of the first stage and each shard into ``chunks``; micro-batch m is chunk ``m // d`` of
        shard ``m % d``, and a replica computes only the micro-batches it owns.
        """
        if self._layout is None:
            return (split(batch, self.chunks) if self.chunks > 1 else [batch]), (lambda mb: mb)
        d, chunks = self._layout.input_replicas, self.chunks
        parts = [part for shard in split(batch, d) for part in split(shard, chunks)]  # shard-major
        return parts, lambda mb: (mb % d) * chunks + mb // d

    def _check_same_batch(self, batch: Any) -> None:
        """At each epoch's first batch, make sure every stage got the same one (a cheap fingerprint)."""
        if self.num_stages == 1:
            return
        leaves, _ = flatten(batch, "batch")
        mine = torch.tensor([fingerprint(t) for t in leaves[:4]] + [float(batch_size(batch))], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self._pipeline_group))]
        dist.all_gather(everyone, mine.to(self.root_device) if self.root_device.type != "cpu" else mine,
                        group=self._pipeline_group)
        if any(not torch.equal(everyone[0].cpu(), other.cpu()) for other in everyone[1:]):
            raise RuntimeError(
                "The pipeline stages received different training batches: every rank must iterate the same data "
                "in the same order (stage 0 reads the inputs, the last stage the targets). Keep Lightning's default "
                "sampler, or with use_distributed_sampler=False seed every rank's shuffling identically."
            )

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
        self.precision_plugin.optimizer_step(optimizer, model=self.lightning_module, closure=_gradients_ready)

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        """Clip by the norm over the whole model: every stage's gradients, summed across ranks.

        Under ``pipedream`` the stages hold gradients of different minibatches at any moment (and a
        drain updates stages a different number of times), so there each stage clips by its own
        norm, as PipeDream's runtime did.
        """
        # A tied parameter counts once in the whole model's norm: on the first stage that holds a copy.
        skip = self._graph.tie_copies_held_elsewhere_first() if self._graph is not None else set()
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None and id(p) not in skip]
        square = torch.zeros(1, device=self.root_device, dtype=torch.float32)
        for g in grads:
            square += g.detach().float().pow(2).sum()
        if self.num_stages > 1 and not self.asynchronous:
            if self._layout is not None and self._layout.replica_of(self.global_rank) != 0:
                square.zero_()  # a stage's replicas hold the same (summed) gradients: count the stage once
            dist.all_reduce(square, group=self._pipeline_group)  # replicas hold the same gradients: one pipeline
        factor = torch.clamp(clip_val / (square.sqrt() + 1e-6), max=1.0)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(factor.to(p.grad.dtype))

    # ----------------------------------------------------------------------------------- drain
    def drain(self) -> None:
        """Finish every minibatch in flight (``pipedream``): afterwards all stages hold final weights.

        Every rank must call it at the same point (they do: they run the same steps and hooks).
        """
        engine, updates = self._engine, self._updates
        if engine is None or updates is None or not self.asynchronous or self._failure is not None:
            return
        with updates.pipeline_grads():
            engine.drain(updates.apply)

    def _pipeline_failed(self, exception: BaseException) -> None:
        """A step raised (on this rank or a peer): the stages stopped at different places; drain nothing more."""
        self._failure = exception
        if self._updates is not None:
            self._updates.forget()
        if self._lagged is not None:
            self._lagged.forget()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._pipeline_failed(exception)
        super().on_exception(exception)

    # ------------------------------------------------------------------------------ evaluation
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
        engine, channel = self._engine, self._summary
        assert engine is not None and channel is not None
        module = self.lightning_module
        batch, batch_idx = batch_args(args, kwargs)
        extra_args = args[2:]
        step = getattr(module, hook)
        parts = split(batch, self.chunks) if self.chunks > 1 else [batch]
        sizes = [batch_size(p) for p in parts]
        recorder = LogRecorder()

        def inputs(mb: int) -> Any:
            return self._call.input_of(module, hook, parts[mb], batch_idx, *extra_args, **kwargs)

        def output_of(mb: int, output: Any) -> Any:
            with self._call.replaying(module, output), recorder.capture(module, sizes[mb]):
                return step(parts[mb], batch_idx, *extra_args, **kwargs)

        self._ensure_captured(module, hook, parts, batch_idx, *extra_args, **kwargs)
        actions = inference(self.num_stages, len(parts), self.virtual_stages).actions[self.stage_index]
        if self._layout is not None:  # the first replica of each stage evaluates; the others get the results
            layout = self._layout
            first = [layout.ranks_of(s)[0] for s in range(layout.num_stages)]
            actions = [] if layout.replica_of(self.global_rank) != 0 else [_to_peer_rank(a, first) for a in actions]
        outputs = engine.executor.run(actions, inputs=inputs, loss=output_of, optimizer_step=_no_update, train=False)
        payload = None
        if self.is_last_stage:
            merged = None
            if send_output:
                values = [outputs[mb] for mb in sorted(outputs)]
                merged = map_tensors(_to_cpu, values[0] if len(values) == 1 else merge_outputs(values))
            payload = (merged, recorder.aggregate())
        merged, logs = channel.broadcast_object(payload)
        LogRecorder.replay(module, channel.averaged_logs(logs))
        if send_output:
            return map_tensors(lambda t: t.to(self.root_device), merged)
        return None

    # ----------------------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's state dict, keyed by the module's own names, gathered on rank 0."""
        self._refuse_after_failure()
        self.drain()
        assert self._checkpoint is not None
        return self._checkpoint.state_dict(self._checkpoint_share())

    def _checkpoint_share(self) -> dict[str, Tensor]:
        """This rank's part of the model's state dict, under the module's own names."""
        module = self.lightning_module
        if self._graph is None:
            return module.state_dict()
        share = self._graph.stage.state_dict()
        if self.is_global_zero:  # state the graph never reads (metrics, unused layers) is the same on every rank
            share.update({k: v for k, v in module.state_dict().items() if k not in self._graph.graph_state_names})
        return share

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
        """The optimizer's state in single-device form (indices over the whole model), on rank 0."""
        self._refuse_after_failure()
        assert self._checkpoint is not None
        index = self.optimizers.index(optimizer) if optimizer in self.optimizers else 0
        raw = getattr(optimizer, "_optimizer", optimizer)
        return self._checkpoint.optimizer_state(raw, self._optimizer_layouts[index], self._local_names)

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
        load_own_share(self.lightning_module, checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        for i, optimizer in enumerate(self.optimizers):
            raw = getattr(optimizer, "_optimizer", optimizer)
            raw.load_state_dict(self._optimizer_layouts[i].to_local(raw, states[i], self._local_names))

    # ------------------------------------------------------------------------------------- end
    @override
    def on_train_end(self) -> None:
        self.drain()
        if self._lagged is not None and self._failure is None:
            self._lagged.take_all()  # training stopped between drains (should_stop): deliver, too late to log
        self._write_trace()
        super().on_train_end()

    def _write_trace(self) -> None:
        if self.trace_dir is None or self._engine is None:
            return
        from lightning_pipedream.schedule.timeline import to_chrome_trace

        os.makedirs(self.trace_dir, exist_ok=True)
        events = self._engine.executor.events(self.global_rank)
        path = os.path.join(self.trace_dir, f"trace_rank{self.global_rank}.json")
        with open(path, "w") as f:
            json.dump(to_chrome_trace(events), f)

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


def _keep_parameters(optimizers: list[torch.optim.Optimizer], keep: set[int]) -> None:
    """Drop from the optimizers' groups the parameters another stage trains."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in keep]




def _reduced_in_updates(average: bool = False) -> int:
    """The replicated schedule's ALLREDUCE_GRAD: a no-op, the strategy all-reduces right before each update
    (so that accumulated gradients are summed once per update, not once per step)."""
    return 0


def _to_peer_rank(action: Action, rank_of_stage: list[int]) -> Action:
    return dataclasses.replace(action, peer=rank_of_stage[action.peer]) if action.peer is not None else action


def _gradients_ready() -> None:
    """The closure of the pipeline's optimizer steps: the gradients are already in ``.grad``."""
    return None


def _no_update(action: Any) -> None:
    raise RuntimeError("An evaluation schedule contained an optimizer step.")


def _to_cpu(t: Tensor) -> Tensor:
    return t.detach().to(_CPU)


_package_log = logging.getLogger("lightning_pipedream")
if not _package_log.handlers and not logging.getLogger().handlers:
    # As Lightning does for its own logger: the plan reaches the console unless the user configured logging.
    _package_log.addHandler(logging.StreamHandler())
    _package_log.setLevel(logging.INFO)

PipeDreamStrategy.register_strategies(StrategyRegistry)

__all__ = ["NonFiniteError", "PipeDreamStrategy", "SCHEDULES"]
