"""The graph path: a module that is not one nn.Sequential is split from its captured forward graph."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from lightning_pipedream.graph import GraphCaptureError, GraphSplit
from lightning_pipedream.graph.estimate import estimate_graph
from lightning_pipedream.runtime.communication.microbatch import batch_size, split
from lightning_pipedream.runtime.faults.failures import from_rank_zero
from lightning_pipedream.runtime.stages.graph_stage import CapturedStage
from lightning_pipedream.runtime.stages.materialize import has_meta_tensors
from lightning_pipedream.schedule.builders import rank_stages, stage_rank
from lightning_pipedream.strategy.batches import EVALUATION_LOOP, STEP_OF, batch_shapes, first_batch
from lightning_pipedream.strategy.calls import ForwardCall, SubmoduleCall, innermost_called_module
from lightning_pipedream.strategy.options import PipelineOptions
from lightning_pipedream.strategy.placement import Placement
from lightning_pipedream.strategy.pretrained import StageWeights, refuse_pretrained_with_real_weights

log = logging.getLogger("lightning_pipedream.strategy")


class GraphPath:
    """Capture the forward call, choose or take split points, keep this rank's stage, and capture again for
    shapes (or a train/eval mode) not seen yet. Owned by the strategy for a module that is not one nn.Sequential."""

    def __init__(self, options: PipelineOptions, placement: Placement, is_global_zero: bool,
                 batch_to_device: Callable[[Any], Any], device: torch.device | None = None) -> None:
        self.options = options
        self.device = device if device is not None else torch.device("cpu")  # where a meta-built stage materializes
        self.placement = placement
        self.is_global_zero = is_global_zero
        self.batch_to_device = batch_to_device
        self.call: ForwardCall = ForwardCall()  # SubmoduleCall when only a submodule's forward can be traced
        self.graph: CapturedStage | None = None
        self.plan: Any = None  # the partitioner's plan, when split points were chosen by profiling
        self.weights: StageWeights | None = None  # a meta-built module's per-stage materialization
        self._inputs_seen: set[tuple] = set()

    @property
    def stage(self) -> Any:
        """This rank's stage module (the captured graph's part that it runs; several model chunks: a ModuleList)."""
        assert self.graph is not None
        return self.graph.stage

    @property
    def chunks(self) -> list[Any]:
        """This rank's model chunks, in the order the engine takes them (one unless several chunks per process)."""
        assert self.graph is not None
        return list(self.graph.chunks)

    def local_names(self) -> dict[int, str]:
        """Parameter id -> the module's own name, for this rank's stage."""
        assert self.graph is not None
        return {id(p): n for n, p in self.graph.named_parameters().items()}

    def _chunk_layout(self) -> dict[str, Any]:
        """Several model chunks per process (interleaved, zb-v, dualpipev): the stages this rank holds and where every
        stage lives, for :class:`CapturedStage`; nothing for one stage per process."""
        options, placement = self.options, self.placement
        if options.virtual_stages == 1:
            return {}
        p, schedule = placement.num_stages, options.schedule
        return {"chunks": rank_stages(schedule, p, placement.stage_index, options.virtual_stages),
                "rank_of_stage": lambda stage: stage_rank(schedule, p, stage)}

    def split(self, trainer: Trainer, module: LightningModule) -> None:
        """Capture the forward call on a first batch, choose split points, keep this rank's stage."""
        options, placement = self.options, self.placement
        fitting = trainer.state.fn == TrainerFn.FITTING
        batch = first_batch(trainer.fit_loop) if fitting else first_batch(EVALUATION_LOOP[trainer.state.fn](trainer))
        if batch is None:
            raise ValueError(
                f"PipeDreamStrategy splits {type(module).__name__} from its traced forward call, which needs a batch "
                "before the first step, but the dataloader gave none. Give a dataloader with at least one batch, or "
                "put the layers in one nn.Sequential."
            )
        batch = self.batch_to_device(batch)
        chunks = min(options.chunks, batch_size(batch))  # a batch smaller than chunks runs a micro-batch per sample
        part = split(batch, chunks)[0] if chunks > 1 else batch  # the shape of a step's micro-batch
        hook = STEP_OF[trainer.state.fn]
        args, kwargs = self.call.input_of(module, hook, part, 0)
        points = list(options.split_points) if options.split_points is not None else None
        captured = None
        total = placement.num_stages * options.virtual_stages  # model chunks in all
        # Built on the meta device: traced from shapes, split by a FLOP estimate, this rank's stages alone materialized.
        on_meta = has_meta_tensors(module)
        self.weights = StageWeights(options, module, self.device) if on_meta else None
        if not on_meta:
            refuse_pretrained_with_real_weights(options, module)
        if points is None:
            on_rank_zero: dict[str, Any] = {}  # what rank 0 keeps of its work besides the points: the graph, the plan

            def choose() -> list[str]:
                from lightning_pipedream.graph import capture
                from lightning_pipedream.graph.split_points import choose_split_points

                on_rank_zero["captured"] = captured = capture(module, args, kwargs, on_meta=on_meta)
                estimate = estimate_graph(captured) if on_meta else None  # no weights to time: FLOPs of the shapes
                chosen, on_rank_zero["plan"] = choose_split_points(captured, module, args, kwargs, total,
                                                                   profile=estimate, bandwidth=options.link_bandwidth)
                log.info("PipeDreamStrategy split points (%d stages, schedule=%s, from %s): %s", total,
                         options.schedule, "a FLOP estimate of the meta model's shapes" if on_meta
                         else "profiling each layer", chosen)
                return chosen

            points = from_rank_zero(f"split {type(module).__name__} into stages", choose)
            captured, self.plan = on_rank_zero.get("captured"), on_rank_zero.get("plan")
        if options.split_points is None:
            self.graph = CapturedStage(module, placement.stage_index, total, points, args, kwargs, captured,
                                       on_meta=on_meta, prepare=self._prepare, **self._chunk_layout())
        else:
            self.graph = self._stage_of_split_points(module, hook, part, args, kwargs)
        self._inputs_seen = {(module.training, batch_shapes(part))}
        if self.graph.ties and placement.num_pipelines > 1:
            raise ValueError(
                f"Parameters {sorted(self.graph.ties)} are used on several stages (tied weights), which "
                "PipeDreamStrategy does not combine with data-parallel pipelines yet. Run one pipeline (stages = "
                "processes), or split points that keep each tied parameter's users in one stage."
            )

    def _stage_of_split_points(self, module: LightningModule, hook: str, part: Any, args: tuple,
                               kwargs: dict) -> CapturedStage:
        """split_points given: trace the module's forward; if that cannot be traced, the innermost module holding
        the split points that the step calls (every rank decides alike: the same model, batch and failure)."""
        assert self.options.split_points is not None
        points = list(self.options.split_points)
        stage_index, num_stages = self.placement.stage_index, self.placement.num_stages * self.options.virtual_stages
        on_meta = self.weights is not None
        try:
            return CapturedStage(module, stage_index, num_stages, points, args, kwargs, on_meta=on_meta,
                                 prepare=self._prepare, **self._chunk_layout())
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
            self.call = SubmoduleCall(through)
            args, kwargs = self.call.input_of(module, hook, part, 0)
            return CapturedStage(module, stage_index, num_stages, points, args, kwargs, through=through,
                                 on_meta=on_meta, prepare=self._prepare, **self._chunk_layout())

    def _prepare(self, split: GraphSplit, stages: list[int]) -> None:
        """A meta-built module: materialize (and load) this rank's stages' tensors before the stages take them."""
        if self.weights is not None:
            self.weights.of_split(split, stages)

    def ensure_captured(self, module: LightningModule, hook: str, parts: list[Any] | tuple[Any, ...],
                        *step_args: Any, **step_kwargs: Any) -> None:
        """Capture the forward call for micro-batch shapes (or a mode) not seen yet, on every rank."""
        assert self.graph is not None
        self.stage.train(module.training)
        for part in parts:
            key = (module.training, batch_shapes(part))
            if key not in self._inputs_seen:
                args, kwargs = self.call.input_of(module, hook, part, *step_args, **step_kwargs)
                self.graph.ensure(module, args, kwargs)
                self._inputs_seen.add(key)
