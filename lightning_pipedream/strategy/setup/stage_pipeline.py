"""What setup builds for one LightningModule on a rank (its stage, the engine, the summaries' channels), and the
builder that decides the placement, keeps this rank's layers and builds the rest around them."""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn

from lightning_pipedream.graph.split import get_path
from lightning_pipedream.plan.balance import stage_slice
from lightning_pipedream.runtime.communication.transport import Transport
from lightning_pipedream.runtime.execution.engine import PipelineEngine
from lightning_pipedream.runtime.faults.failures import pipeline_failures
from lightning_pipedream.runtime.stages.materialize import has_meta_tensors
from lightning_pipedream.runtime.stages.replicas import GradientReducer
from lightning_pipedream.runtime.stages.sharding import (
    ShardedStep,
    WholeOptimizerState,
    local_square_norm,
    scale_gradient,
    shard_stage,
    sharded_optimizer_state,
    whole_state,
)
from lightning_pipedream.runtime.stages.ties import TiedParameters
from lightning_pipedream.schedule.builders import rank_stages
from lightning_pipedream.strategy.checkpoints.checkpoint import CheckpointGather, OptimizerLayout
from lightning_pipedream.strategy.reporting.summaries import LaggedFromSources, LaggedSummaries, SummaryChannel
from lightning_pipedream.strategy.setup.calls import (
    Elsewhere,
    ForwardCall,
    SequentialCall,
    find_layers,
    shared_parameters,
)
from lightning_pipedream.strategy.setup.checks import (
    FiniteChecks,
    check_stage_trains,
    optimizers_unvalidated,
    refuse_minibatches_with_replicas,
    sharded_param_dtype,
)
from lightning_pipedream.strategy.setup.graph_path import GraphPath
from lightning_pipedream.strategy.setup.optimizer_layouts import layouts_when_fitting, learn_layouts, meta_shadow
from lightning_pipedream.strategy.setup.options import PipelineOptions
from lightning_pipedream.strategy.setup.placement import Placement, ProcessGroups
from lightning_pipedream.strategy.setup.planning import LayerPlanner
from lightning_pipedream.strategy.setup.pretrained import StageWeights, refuse_pretrained_with_real_weights

log = logging.getLogger(__name__)


@dataclass
class StagePipeline:
    """What ``setup`` builds for one LightningModule on this rank: its stage, the engine that runs it, and the
    channels, checks and checkpoint mapping around it. A later fit/validate/test with the same module reuses it."""

    module: LightningModule
    placement: Placement
    groups: ProcessGroups
    call: SequentialCall | ForwardCall  # how the user's step calls the pipelined part
    stage: nn.Module  # this rank's layers (interleaved: all its model chunks)
    engine: PipelineEngine
    summary: SummaryChannel
    checkpoint: CheckpointGather
    optimizer_layouts: list[OptimizerLayout]  # [] until a fit reads them (prepare_fit)
    local_names: dict[int, str]  # parameter id -> the module's own name
    graph: GraphPath | None = None  # the graph path, for a module that is not one nn.Sequential
    lagged: LaggedFromSources | None = None  # pipedream: summaries used ``stages - 1`` steps late
    reducer: GradientReducer | None = None  # the stage's replicas' all-reduce
    finite: FiniteChecks | None = None
    ties: TiedParameters | None = None  # a Sequential's parameters used on several stages (tied embeddings)
    shard: str | None = None  # each stage's replicas shard it (runtime/stages/sharding.py); None: whole copies
    step_context: str = "setup"  # what the pipeline runs now, for error messages
    layouts_pending: bool = False  # built by validate/test/predict: the first fit reads the optimizer layouts

    def prepare_fit(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """At a fit, once the optimizers exist: on the graph path (every rank holds the whole module) they keep only
        this stage's parameters; a pipeline that ``validate``/``test``/``predict`` built reads their layout now."""
        if self.graph is not None:
            keep_parameters(optimizers, {id(p) for p in self.stage.parameters()})
        if self.layouts_pending:
            layers = self.module.get_submodule(self.call.name) if isinstance(self.call, SequentialCall) else None
            self.optimizer_layouts = learn_layouts(self.module, layers)  # type: ignore[arg-type]
            self.layouts_pending = False

    # -- checkpoints (single-device form) ---------------------------------------------------------------
    def state_share(self, is_global_zero: bool, gather: bool = True) -> dict[str, Tensor]:
        """This rank's part of the model's state dict, under the module's own names. Under ``shard=``, each sharded
        tensor gathered whole (``gather``: a collective over the stage's replicas), or this replica's shard as a
        DTensor (its global shape and offsets with it: what a sharded checkpoint writes)."""
        graph = self.graph
        if graph is None or graph.graph is None:
            state = self.module.state_dict()
            return whole_state(state) if self.shard is not None and gather else state  # every replica at once
        share = graph.graph.state_dict()
        if is_global_zero:  # state the graph never reads (metrics, unused layers) is the same on every rank
            share.update({k: v for k, v in self.module.state_dict().items() if k not in graph.graph.graph_state_names})
        return share

    def optimizer_state(self, optimizer: torch.optim.Optimizer, index: int) -> dict[str, Tensor]:
        """The ``index``-th optimizer's state in single-device form (indices over the whole model), on rank 0."""
        raw = getattr(optimizer, "_optimizer", optimizer)
        if self.shard is not None:  # gathered whole on every replica at once, then as without sharding
            raw = WholeOptimizerState(raw)
        return self.checkpoint.optimizer_state(raw, self.optimizer_layouts[index], self.local_names)

    def load_optimizer_states(self, optimizers: list[torch.optim.Optimizer], states: list[dict]) -> None:
        """Each optimizer takes this rank's part of its single-device state (its shards, under ``shard=``)."""
        for i, optimizer in enumerate(optimizers):
            raw = getattr(optimizer, "_optimizer", optimizer)
            local = self.optimizer_layouts[i].to_local(raw, states[i], self.local_names)
            raw.load_state_dict(sharded_optimizer_state(raw, local) if self.shard is not None else local)


def shard_own_stage(stage: nn.Module, placement: Placement, groups: ProcessGroups, shard: str, unsupported: bool,
                    device: torch.device, precision: str, model_chunks: list[nn.Module] | None = None) -> nn.Module:
    """``shard=``: this rank's stage sharded over its replicas (the same stage in every data-parallel pipeline);
    under ``precision="bf16-mixed"`` gathered and computed in bfloat16, with float32 shards (FSDP2's policy).
    Interleaved ``model_chunks`` are sharded each as a root of its own (the engine runs them one by one), their
    layers shared with ``stage``, which is returned."""
    check_shard_layout(placement, shard)
    assert groups.replicas is not None
    if unsupported:
        raise ValueError(f"PipeDreamStrategy(shard={shard!r}) shards a module whose layers are one nn.Sequential, "
                         "without parameters shared between stages; the traced graph's stages and tied parameters are "
                         "not sharded yet. Put the layers in one nn.Sequential without ties, or shard=None.")
    param_dtype = sharded_param_dtype(precision, shard)
    if model_chunks is not None and len(model_chunks) > 1:
        for chunk in model_chunks:
            shard_stage(chunk, groups.replicas, shard, device, param_dtype)
        return stage
    return shard_stage(stage, groups.replicas, shard, device, param_dtype)


def check_shard_layout(placement: Placement, shard: str) -> None:
    """``shard=`` needs data-parallel copies of a straight pipeline: refused with the way out otherwise."""
    if placement.layout is not None or placement.num_pipelines < 2:
        raise ValueError(f"PipeDreamStrategy(shard={shard!r}) shards each stage over its copies in data-parallel "
                         f"pipelines, but this run has {placement.num_pipelines} pipeline(s) of {placement.num_stages} "
                         "stages. Run devices = stages x copies with stages= (e.g. stages=2 on 4 devices), or "
                         "shard=None.")


def summary_channel(placement: Placement, groups: ProcessGroups, device: torch.device) -> SummaryChannel:
    """The channel that brings the last stage's step summary (loss, logs) to every rank."""
    sources = placement.last_stage_ranks()
    return SummaryChannel(placement.stage_index, placement.num_stages, device, groups.pipeline, groups.replicas,
                          placement.num_pipelines, source=sources[0], sources=sources)


def lagged_summaries(placement: Placement, groups: ProcessGroups, channel: SummaryChannel,
                     minibatches_per_step: int = 1) -> LaggedFromSources | None:
    """pipedream and 2bw: step summaries sent point to point on their own group and used ``stages - 1`` steps
    late, so that no rank waits for the last stage within a step. With ``minibatches_per_step`` k, stage 0
    back-propagates a step's last minibatch ``ceil((stages - 1) / k)`` steps later: that is the lag."""
    if groups.summaries is None:
        return None
    lag = -(-(placement.num_stages - 1) // minibatches_per_step)
    me = dist.get_rank(groups.summaries)
    size = dist.get_world_size(groups.summaries)
    return LaggedFromSources([
        LaggedSummaries(channel, groups.summaries, source=source, receivers=[r for r in range(size) if r != source],
                        lag=lag, is_source=me == source, reverse_group=groups.summaries_reverse)
        for source in placement.last_stage_ranks()
    ])


@dataclass
class Ranks:
    """What the builder needs to know of the processes: this rank, how many there are and how they talk."""

    global_rank: int
    world_size: int
    devices_per_node: int
    num_nodes: int
    device: torch.device
    backend: str
    timeout: timedelta | None

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0


def plan_replicas(options: PipelineOptions, plan: Any) -> tuple[int, ...] | None:
    """Replicas per stage: ``replicas=``, else those of a plan file or of the replicating planner's plan."""
    if options.replicas is None and plan is not None and (options.plan_path is not None or not options.straight):
        return tuple(stage.replicas for stage in plan.stages)
    return options.replicas


def decide_placement(options: PipelineOptions, world_size: int, global_rank: int, plan: Any,
                     accumulate_grad_batches: int = 1) -> Placement:
    """Replicas per stage from ``replicas=`` or the plan: equal counts are data-parallel pipelines, unequal ones
    PipeDream's 1F1B-RR."""
    return Placement.decide(options.schedule, world_size, global_rank, stages=options.stages,
                            replicas=plan_replicas(options, plan), accumulate_grad_batches=accumulate_grad_batches)


def sequential_layers(options: PipelineOptions, module: LightningModule,
                      is_global_zero: bool) -> tuple[str, nn.Sequential] | None:
    """The module's Sequential to split between layers (its attribute name too), or None to split its traced
    forward graph."""
    if options.split_points is not None:
        return None
    if options.layers is not None:  # asked for by name: its errors are the user's to see
        return find_layers(module, options.layers, allow_ties=True)
    try:
        return find_layers(module, None, allow_ties=True)
    except ValueError as not_sequential:
        if is_global_zero:
            log.info("PipeDreamStrategy: %s is not one nn.Sequential (%s); it splits the graph of its forward "
                     "call instead.", type(module).__name__, str(not_sequential).split(";")[0])
        return None


def choose_automatically(options: PipelineOptions, ranks: Ranks, trainer: Trainer, module: LightningModule,
                         fitting: bool, batch_to_device: Callable[[Any], Any]) -> tuple[PipelineOptions, Any]:
    """``schedule='auto'``: the planner chooses the schedule, the split, replicas, micro-batches and recompute on
    a profile of the first training batch. Returns the options of its choice and its plan."""
    found = sequential_layers(options, module, ranks.is_global_zero)
    if not fitting:  # nothing to profile a training step with: an even split, flushed, one stage per process
        return dataclasses.replace(options, schedule="1f1b", memory_limit=None, exact=False, shard=None), None
    optimizers, _ = optimizers_unvalidated(module)
    from lightning_pipedream.plan.memory import optimizer_kind

    if found is None:  # the graph path: traced; equal replicas (data-parallel pipelines) only
        from lightning_pipedream.strategy.setup.graph_path import auto_plan_graph

        arguments, plan = auto_plan_graph(options, trainer, module, batch_to_device, ranks.devices_per_node,
                                          ranks.num_nodes, optimizer_kind(optimizers[0]) if optimizers else "adam",
                                          ranks.device)
        arguments = {k: tuple(v) if isinstance(v, list) else v for k, v in arguments.items()}
        return dataclasses.replace(options, memory_limit=None, exact=False, **arguments), plan
    planner = LayerPlanner(options, trainer, module, SequentialCall(found[0]), ranks.is_global_zero, batch_to_device)
    arguments, plan = planner.auto_plan(found[1], ranks.devices_per_node, ranks.num_nodes,
                                        optimizer_kind(optimizers[0]) if optimizers else "adam", device=ranks.device)
    arguments = {k: tuple(v) if isinstance(v, list) else v for k, v in arguments.items()}
    return dataclasses.replace(options, memory_limit=None, exact=False, **arguments), plan


def make_engine(options: PipelineOptions, stage: nn.Module, model_chunks: list[nn.Module], placement: Placement,
                groups: ProcessGroups, device: torch.device) -> PipelineEngine:
    """The engine that runs this rank's stage under the options' schedule."""
    return PipelineEngine(
        model_chunks if options.virtual_stages > 1 else stage,
        placement.stage_index,
        placement.num_stages,
        Transport(group=groups.pipeline, device=device, kind=options.transport, reverse_group=groups.pipeline_reverse),
        schedule=options.schedule,
        chunks=options.chunks,
        weight_stashing=options.weight_stashing,
        vertical_sync=options.vertical_sync,
        record=options.trace_dir is not None,
        # 1F1B-RR: the engine runs the replicated schedule; the replicas' all-reduce happens in the updates.
        replicas=placement.layout.replicas if placement.layout is not None else None,
        rank=placement.rank if placement.layout is not None else None,
        allreduce=_reduced_in_updates if placement.layout is not None else None,
        recompute=options.recompute,
        virtual_stages=options.virtual_stages,
        sharded_step=ShardedStep(model_chunks, placement.num_stages, options.shard,
                                  split_backward=options.spec.splits_backward)
        if options.shard is not None else None,
    )


def _reduced_in_updates(average: bool = False) -> int:
    """The replicated schedule's ALLREDUCE_GRAD: a no-op, the strategy all-reduces right before each update
    (so that accumulated gradients are summed once per update, not once per step)."""
    return 0


def layer_ties(module: LightningModule, shared: dict[str, list[str]], layers: nn.Sequential, placement: Placement,
               balance: list[int], virtual_stages: int) -> dict[str, list[int]]:
    """The Sequential's parameters used by layers on different stages: first name -> the stages holding it."""
    stage_of = dict(zip(layers._modules, (s for s, count in enumerate(balance) for _ in range(count))))
    ties = {key: sorted({stage_of[n.split(".", 1)[0]] for n in names}) for key, names in shared.items()}
    ties = {key: stages for key, stages in ties.items() if len(stages) > 1}
    if ties and (virtual_stages > 1 or placement.num_pipelines > 1 or placement.layout is not None
                 or has_meta_tensors(module)):
        users = {key: [n.split(".", 1)[0] for n in shared[key]] for key in ties}
        raise ValueError(
            f"Layers {users} of {type(module).__name__} share parameters across stages (tied weights), which "
            "PipeDreamStrategy runs with one straight pipeline of real weights; not with interleaved model "
            "chunks, replicated stages, data-parallel pipelines or a model built on the meta device. Use one of "
            "those without ties, or balance= that keeps each tied parameter's layers in one stage."
        )
    return ties


class StagePipelineBuilder:
    """Builds this rank's :class:`StagePipeline` for one module: decides the placement (after the replicating
    planner, if asked), keeps this rank's layers (or splits the traced graph), shards them, and builds the engine,
    channels, checks and checkpoint mapping around them. ``plan`` and ``balance`` are those used, once built."""

    def __init__(self, options: PipelineOptions, ranks: Ranks, plan: Any,
                 batch_to_device: Callable[[Any], Any]) -> None:
        self.options = options
        self.ranks = ranks
        self.plan = plan
        self.balance: list[int] | None = None
        self.batch_to_device = batch_to_device

    def build(self, trainer: Trainer, module: LightningModule, fitting: bool,
              to_device: Callable[[], None]) -> StagePipeline:
        """``to_device``: the strategy's own preparation of the module (precision, device), once this rank holds
        only its layers."""
        options, ranks = self.options, self.ranks
        found = sequential_layers(options, module, ranks.is_global_zero)
        call: SequentialCall | ForwardCall = SequentialCall(found[0]) if found is not None else ForwardCall()
        planner = LayerPlanner(options, trainer, module, call, ranks.is_global_zero,
                               self.batch_to_device) if isinstance(call, SequentialCall) else None
        if fitting and not options.straight and ranks.world_size > 1:
            if found is None or planner is None:
                raise ValueError(
                    f"PipeDreamStrategy(straight=False) plans replicated stages for a module whose layers are one "
                    f"nn.Sequential; {type(module).__name__}'s are not. Use straight=True (the default) for the graph "
                    "path, or put the layers in one nn.Sequential."
                )
            self.plan = planner.replicated_plan(found[1], ranks.world_size, ranks.devices_per_node, ranks.num_nodes)
        placement = decide_placement(options, ranks.world_size, ranks.global_rank, self.plan,
                                     trainer.accumulate_grad_batches if fitting else 1)
        refuse_minibatches_with_replicas(placement, options.minibatches_per_batch)
        groups = ProcessGroups.make(placement, ranks.backend, ranks.timeout)
        full_keys = list(module.state_dict())
        # The full model's optimizer layout maps checkpoints (single-device form) to this rank's stage.
        optimizer_layouts = layouts_when_fitting(module, fitting)  # []: validate/test/predict, learned at a fit
        graph, tied = None, None
        if found is not None and planner is not None:
            name, layers = found
            shared = shared_parameters(layers)  # before the other stages' layers make way for placeholders
            self.balance, self.plan = planner.balance(layers, placement.num_stages, self.plan)
            ties = layer_ties(module, shared, layers, placement, self.balance, options.virtual_stages)
            stage, model_chunks = self._keep_own_stage(module, layers, placement, shadows=not fitting)
            local_names = {id(p): f"{name}.{n}" for n, p in stage.named_parameters()}
            if ties:
                # Each holder's copy lives under its own layer's name; checkpoints and optimizer states use the first.
                here = {key: next(n for n in shared[key] if n.split(".", 1)[0] in stage._modules)
                        for key, stages in ties.items() if placement.stage_index in stages}
                tied = TiedParameters(stage, ties, placement.stage_index, names=here)
                for key, path in here.items():
                    local_names[id(get_path(stage, path))] = f"{name}.{key}"
        else:
            graph = GraphPath(options, placement, ranks.is_global_zero, self.batch_to_device, ranks.device)
            graph.split(trainer, module)
            call, stage, local_names = graph.call, graph.stage, graph.local_names()
            model_chunks = graph.chunks
            self.plan = graph.plan if graph.plan is not None else self.plan
            if graph.predicted_memory is None and self.plan is not None:  # schedule="auto": the planner's prediction
                graph.predicted_memory = self.plan.extra.get("memory")
        to_device()
        stage.to(ranks.device)  # a graph stage is not a child of the module
        if options.shard is not None:  # before the optimizers: they keep state for this rank's shards only
            before = {n: id(p) for n, p in stage.named_parameters()}
            stage = shard_own_stage(stage, placement, groups, options.shard, graph is not None or tied is not None,
                                    ranks.device, str(trainer.precision), model_chunks)
            local_names = {id(p): local_names[before[n]] for n, p in stage.named_parameters()}  # new parameters
        pipeline = StagePipeline(
            module, placement, groups, call, stage,
            engine=make_engine(options, stage, model_chunks, placement, groups, ranks.device),
            summary=summary_channel(placement, groups, ranks.device),
            checkpoint=CheckpointGather(ranks.global_rank, ranks.world_size, full_keys),
            optimizer_layouts=optimizer_layouts, local_names=local_names, graph=graph,
        )
        pipeline.lagged = lagged_summaries(placement, groups, pipeline.summary, options.minibatches_per_batch)
        pipeline.ties = tied
        pipeline.layouts_pending = not fitting
        pipeline.shard = options.shard
        if groups.replicas is not None and options.shard is None:  # sharded replicas reduce-scatter in the backward
            pipeline.reducer = GradientReducer(stage.parameters(), groups.replicas)
        if options.check_finite:
            pipeline.finite = FiniteChecks(stage, placement.stage_index, lambda: pipeline.step_context,
                                           per_layer=graph is None)
        return pipeline

    def _keep_own_stage(self, module: LightningModule, layers: nn.Sequential, placement: Placement,
                        shadows: bool = False) -> tuple[nn.Module, list[nn.Module]]:
        """Replace the other stages' layers by placeholders so this rank holds only its own; returns the stage and
        its model chunks (interleaved: stages r, r + p, ...; a V schedule: r and 2p-1-r; one otherwise).
        ``shadows``: each placeholder keeps a meta-device shadow of its layer, for a later fit's optimizer layout."""
        assert self.balance is not None
        mine = rank_stages(self.options.schedule, placement.num_stages, placement.stage_index,
                           self.options.virtual_stages)
        model_chunks = [stage_slice(layers, self.balance, s) for s in mine]
        own = model_chunks[0] if len(mine) == 1 else nn.Sequential(
            OrderedDict((layer_name, layer) for chunk in model_chunks for layer_name, layer in chunk.named_children())
        )
        check_stage_trains(own, placement.stage_index, self.balance)
        # Built on the meta device: real (or pretrained) weights for this stage only, checked against the whole.
        weights = StageWeights(self.options, module, self.ranks.device) if has_meta_tensors(module) else None
        if weights is None:
            refuse_pretrained_with_real_weights(self.options, module)
        stage_of = [s for s, count in enumerate(self.balance) for _ in range(count)]
        kept = {id(p) for p in own.parameters()}
        for i, layer_name in enumerate(list(layers._modules)):
            if layer_name not in own._modules:
                layer = layers._modules[layer_name]
                shadow = meta_shadow(layer, kept) if shadows and layer is not None else None
                layers._modules[layer_name] = Elsewhere(layer_name, stage_of[i], shadow)
        if weights is not None:
            weights.of_names(None)
        return own, model_chunks


def clip_grad_by_norm(pipeline: StagePipeline, optimizer: torch.optim.Optimizer, clip_val: float, *,
                      asynchronous: bool, device: torch.device) -> None:
    """Clip by the norm over the whole model: every stage's gradients, summed across ranks.

    Under ``pipedream`` the stages hold gradients of different minibatches at any moment (and a
    drain updates stages a different number of times), so there each stage clips by its own
    norm, as PipeDream's runtime did.
    """
    placement = pipeline.placement
    captured = pipeline.graph.graph if pipeline.graph is not None else None
    ties = pipeline.ties if pipeline.ties is not None else captured.tied if captured is not None else None
    if ties is not None and asynchronous:
        # Each stage clips by its own norm, which would clip the tied copies apart: a tied parameter is clipped
        # by its own norm instead, which every holder computes alike (their gradients were just summed).
        for copy in ties.copies():
            if copy.grad is not None:
                copy.grad.mul_(torch.clamp(clip_val / (copy.grad.detach().float().norm() + 1e-6), max=1.0))
        skip = {id(copy) for copy in ties.copies()}
    else:  # a tied parameter counts once in the whole model's norm: on the first stage that holds a copy
        skip = ties.held_first_elsewhere() if ties is not None else set()
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None and id(p) not in skip]
    square = local_square_norm(grads, device)
    with pipeline_failures(placement.stage_index, waiting="the gradient norm's all-reduce"):
        if pipeline.shard is not None and pipeline.groups.replicas is not None:
            dist.all_reduce(square, group=pipeline.groups.replicas)  # each replica holds a shard of every gradient
        if placement.num_stages > 1 and not asynchronous:
            if placement.round_robin and placement.replica_index != 0:
                square.zero_()  # a stage's replicas hold the same (summed) gradients: count the stage once
            dist.all_reduce(square, group=pipeline.groups.pipeline)  # replicas hold the same gradients
    factor = torch.clamp(clip_val / (square.sqrt() + 1e-6), max=1.0)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not (asynchronous and id(p) in skip):
                scale_gradient(p.grad, factor)


def keep_parameters(optimizers: list[torch.optim.Optimizer], keep: set[int]) -> None:
    """Drop from the optimizers' groups the parameters another stage trains."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in keep]
