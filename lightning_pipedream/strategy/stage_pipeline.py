"""What setup builds for one LightningModule on a rank: its stage, the engine, the summaries' channels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import nn

from lightning_pipedream.runtime.execution.engine import PipelineEngine
from lightning_pipedream.runtime.stages.replicas import GradientReducer
from lightning_pipedream.runtime.stages.sharding import local_square_norm, scale_gradient, shard_stage
from lightning_pipedream.runtime.stages.ties import TiedParameters
from lightning_pipedream.strategy.calls import ForwardCall, SequentialCall
from lightning_pipedream.strategy.checkpoint import CheckpointGather, OptimizerLayout
from lightning_pipedream.strategy.checks import FiniteChecks
from lightning_pipedream.strategy.graph_path import GraphPath
from lightning_pipedream.strategy.placement import Placement, ProcessGroups
from lightning_pipedream.strategy.summaries import LaggedFromSources, LaggedSummaries, SummaryChannel


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
    optimizer_layouts: list[OptimizerLayout]
    local_names: dict[int, str]  # parameter id -> the module's own name
    graph: GraphPath | None = None  # the graph path, for a module that is not one nn.Sequential
    lagged: LaggedFromSources | None = None  # pipedream: summaries used ``stages - 1`` steps late
    reducer: GradientReducer | None = None  # the stage's replicas' all-reduce
    finite: FiniteChecks | None = None
    ties: TiedParameters | None = None  # a Sequential's parameters used on several stages (tied embeddings)
    shard: str | None = None  # each stage's replicas shard it (runtime/stages/sharding.py); None: whole copies


def shard_own_stage(stage: nn.Module, placement: Placement, groups: ProcessGroups, shard: str, unsupported: bool,
                    device: torch.device) -> nn.Module:
    """``shard=``: this rank's stage sharded over its replicas (the same stage in every data-parallel pipeline)."""
    check_shard_layout(placement, shard)
    assert groups.replicas is not None
    if unsupported:
        raise ValueError(f"PipeDreamStrategy(shard={shard!r}) shards a module whose layers are one nn.Sequential, "
                         "without parameters shared between stages; the traced graph's stages and tied parameters are "
                         "not sharded yet. Put the layers in one nn.Sequential without ties, or shard=None.")
    return shard_stage(stage, groups.replicas, shard, device)


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
    if pipeline.shard is not None and pipeline.groups.replicas is not None:
        dist.all_reduce(square, group=pipeline.groups.replicas)  # each replica holds a shard of every gradient
    if placement.num_stages > 1 and not asynchronous:
        if placement.round_robin and placement.replica_index != 0:
            square.zero_()  # a stage's replicas hold the same (summed) gradients: count the stage once
        dist.all_reduce(square, group=pipeline.groups.pipeline)  # replicas hold the same gradients: one pipeline
    factor = torch.clamp(clip_val / (square.sqrt() + 1e-6), max=1.0)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not (asynchronous and id(p) in skip):
                scale_gradient(p.grad, factor)
