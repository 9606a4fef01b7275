"""The graph path: a module that is not one nn.Sequential is split from its captured forward graph.
A part of :class:`~lightning_pipedream.PipeDreamStrategy`."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from lightning_pipedream.runtime.graph_stage import CapturedStage
from lightning_pipedream.runtime.microbatch import split
from lightning_pipedream.strategy.batches import EVALUATION_LOOP, STEP_OF, batch_shapes, first_batch
from lightning_pipedream.strategy.calls import SubmoduleCall, innermost_called_module

log = logging.getLogger("lightning_pipedream.strategy")


class GraphPath:
    """PipeDreamStrategy's graph path: capture the forward call, choose or take split points, keep this rank's
    stage, and capture again for shapes not seen yet."""

    def _split_captured_graph(self, trainer: Trainer, module: LightningModule) -> None:
        """The graph path: capture the forward call on a first batch, choose split points, keep this rank's stage."""
        fitting = trainer.state.fn == TrainerFn.FITTING
        batch = first_batch(trainer.fit_loop) if fitting else first_batch(EVALUATION_LOOP[trainer.state.fn](trainer))
        if batch is None:
            raise ValueError(
                f"PipeDreamStrategy splits {type(module).__name__} from its traced forward call, which needs a batch "
                "before the first step, but the dataloader gave none. Give a dataloader with at least one batch, or "
                "put the layers in one nn.Sequential."
            )
        batch = self.batch_to_device(batch)
        part = split(batch, self.chunks)[0] if self.chunks > 1 else batch
        hook = STEP_OF[trainer.state.fn]
        args, kwargs = self._call.input_of(module, hook, part, 0)
        points, captured = self._split_points, None
        if points is None:
            payload: list[Any] = [None]
            if self.is_global_zero:
                from lightning_pipedream.graph import capture
                from lightning_pipedream.graph.split_points import choose_split_points

                captured = capture(module, args, kwargs)
                points, plan = choose_split_points(captured, module, args, kwargs, self.num_stages,
                                                   bandwidth=self._link_bandwidth)
                self.plan = plan
                log.info("PipeDreamStrategy split points (%d stages, schedule=%s): %s", self.num_stages,
                         self.schedule, points)
                payload = [points]
            if self.num_stages > 1:
                dist.broadcast_object_list(payload, src=0)
            points = payload[0]
        if self._split_points is None:
            self._graph = CapturedStage(module, self.stage_index, self.num_stages, points, args, kwargs, captured)
        else:
            self._graph = self._stage_of_split_points(module, hook, part, args, kwargs)
        self._graph_inputs_seen = {(module.training, batch_shapes(part))}
        if self._graph.ties and self.num_pipelines > 1:
            raise ValueError(
                f"Parameters {sorted(self._graph.ties)} are used on several stages (tied weights), which "
                "PipeDreamStrategy does not combine with data-parallel pipelines yet. Run one pipeline (stages = "
                "processes), or split points that keep each tied parameter's users in one stage."
            )
        if self._graph.ties and self.schedule == "2bw":
            raise ValueError(
                f"Parameters {sorted(self._graph.ties)} are used on several stages (tied weights), which "
                "schedule='2bw' does not support yet (pipedream, 1f1b and gpipe do). Use one of those, or "
                "split_points that keep each tied parameter's users in one stage."
            )
        self._stage_module = self._graph.stage
        self._local_names = {id(p): n for n, p in self._stage_module.named_parameters()}

    def _stage_of_split_points(self, module: LightningModule, hook: str, part: Any, args: tuple,
                               kwargs: dict) -> CapturedStage:
        """split_points given: trace the module's forward; if that cannot be traced, the innermost module holding
        the split points that the step calls (every rank decides alike: the same model, batch and failure)."""
        from lightning_pipedream.graph import GraphCaptureError

        assert self._split_points is not None
        points = self._split_points
        try:
            return CapturedStage(module, self.stage_index, self.num_stages, points, args, kwargs)
        except GraphCaptureError as untraceable:
            through = innermost_called_module(module, points, hook, part, 0)
            if through is None:
                raise
            outside = [n for n, p in module.named_parameters() if p.requires_grad and not n.startswith(through + ".")]
            if outside:
                raise ValueError(
                    f"{type(module).__name__}.forward cannot be traced, so PipeDreamStrategy pipelines "
                    f"self.{through} (the innermost module holding split_points={points} that the step calls), "
                    f"but parameters {outside[:4]} are outside it and would not train. Move them into "
                    f"self.{through}, or make forward traceable ({untraceable})."
                ) from untraceable
            if self.is_global_zero:
                log.info("PipeDreamStrategy: %s.forward cannot be traced; pipelining self.%s, split at %s.",
                         type(module).__name__, through, points)
            self._call = SubmoduleCall(through)
            args, kwargs = self._call.input_of(module, hook, part, 0)
            return CapturedStage(module, self.stage_index, self.num_stages, points, args, kwargs, through=through)

    def _ensure_captured(self, module: LightningModule, hook: str, parts: list[Any], *step_args: Any,
                         **step_kwargs: Any) -> None:
        """The graph path: capture the forward call for micro-batch shapes (or a mode) not seen yet, on every rank."""
        if self._graph is None:
            return
        self._stage_module.train(module.training)  # type: ignore[union-attr]
        for part in parts:
            key = (module.training, batch_shapes(part))
            if key not in self._graph_inputs_seen:
                args, kwargs = self._call.input_of(module, hook, part, *step_args, **step_kwargs)
                self._graph.ensure(module, args, kwargs)
                self._graph_inputs_seen.add(key)
