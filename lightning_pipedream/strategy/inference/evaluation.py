"""Validation, test and predict steps through the pipeline: the inference schedule, then outputs and logs on every
rank."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_pipedream.runtime.execution.shares import BatchShares
from lightning_pipedream.schedule.actions import Action
from lightning_pipedream.schedule.builders import inference
from lightning_pipedream.strategy.reporting.logs import LogRecorder
from lightning_pipedream.strategy.setup.batches import batch_args, merge_outputs, to_cpu
from lightning_pipedream.strategy.setup.labels import labelled_token_counter
from lightning_pipedream.strategy.setup.marked_steps import generating_step, pipelined_step
from lightning_pipedream.strategy.setup.options import PipelineOptions
from lightning_pipedream.strategy.setup.stage_pipeline import StagePipeline
from lightning_pipedream.tree import map_tensors


def evaluate(pipeline: StagePipeline, module: LightningModule, hook: str, args: tuple, kwargs: dict, *,
             options: PipelineOptions, device: torch.device, send_output: bool) -> Any:
    """Run ``module``'s ``hook`` (``validation_step``, ``test_step``, ``predict_step``) on a batch through the
    pipeline's stages; every rank logs what the last stage's steps logged, and with ``send_output`` returns the
    batch's merged outputs."""
    pipeline.engine.accounts.interrupt()  # evaluation is no training step's time: the one before ends with its work
    if generating_step(module, hook):  # it decodes around the ring itself: every rank runs the whole step
        return getattr(module, hook)(*args, **kwargs)
    placement = pipeline.placement
    batch, batch_idx = batch_args(args, kwargs)
    extra_args = args[2:]
    step = getattr(module, hook)
    # Logged values combine by the micro-batches' labelled tokens where the labels are visible, as in training.
    mean_over = options.mean_over or labelled_token_counter(module, pipeline.call, hook, batch, batch_idx, *extra_args,
                                                            **kwargs)
    shares = BatchShares.of(batch, options.chunks, fewer_if_small=True, mean_over=mean_over)
    recorder = LogRecorder()

    def inputs(mb: int) -> Any:
        return pipeline.call.input_of(module, hook, shares.part(mb), batch_idx, *extra_args, **kwargs)

    def output_of(mb: int, output: Any) -> Any:
        logged = recorder.capture(module, shares.log_weight(mb), shares.size(mb))
        with pipeline.call.replaying(module, output), logged:
            return step(shares.part(mb), batch_idx, *extra_args, **kwargs)

    if pipeline.graph is not None:
        with pipelined_step(module, hook):
            pipeline.graph.ensure_captured(module, hook, shares.parts, batch_idx, *extra_args, **kwargs)
    actions = inference(placement.num_stages, len(shares.parts), options.virtual_stages, placement.v_shape).actions
    mine = actions[placement.stage_index]
    if placement.round_robin:  # the first replica of each stage evaluates; the others get the results
        first = placement.first_replica_ranks()
        mine = [] if placement.replica_index != 0 else [_to_peer_rank(a, first) for a in mine]
    with pipelined_step(module, hook):  # generate() in this unmarked step says to mark it
        outputs = pipeline.engine.executor.run(mine, inputs=inputs, loss=output_of, optimizer_step=_no_update,
                                               train=False)
    payload = None
    if placement.is_last_stage:
        merged = None
        if send_output:
            values = [outputs[mb] for mb in sorted(outputs)]
            merged = map_tensors(to_cpu, values[0] if len(values) == 1 else merge_outputs(values))
        payload = (merged, recorder.aggregate())
    merged, logs = pipeline.summary.broadcast_object(payload)
    LogRecorder.replay(module, pipeline.summary.averaged_logs(logs))
    if send_output:
        return map_tensors(lambda t: t.to(device), merged)
    return None


def _to_peer_rank(action: Action, rank_of_stage: list[int]) -> Action:
    return dataclasses.replace(action, peer=rank_of_stage[action.peer]) if action.peer is not None else action


def _no_update(action: Any) -> None:
    raise RuntimeError("An evaluation schedule contained an optimizer step.")
