"""The graph path: a module that is not one nn.Sequential is split from its captured forward graph."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from lightning_pipedream.graph import GraphCaptureError, GraphSplit
from lightning_pipedream.graph.estimate import estimate_graph
from lightning_pipedream.runtime.communication.microbatch import batch_size, split
from lightning_pipedream.runtime.execution.decode import evaluating
from lightning_pipedream.runtime.faults.failures import from_rank_zero
from lightning_pipedream.runtime.stages.graph_stage import CapturedStage
from lightning_pipedream.runtime.stages.materialize import has_meta_tensors
from lightning_pipedream.schedule.builders import rank_stages, stage_rank
from lightning_pipedream.strategy.setup.batches import EVALUATION_LOOP, STEP_OF, batch_shapes, first_batch
from lightning_pipedream.strategy.setup.calls import (
    ForwardCall,
    SubmoduleCall,
    innermost_called_module,
    pipelined_call,
)
from lightning_pipedream.strategy.setup.graph_memory import loss_bytes, memory_profile
from lightning_pipedream.strategy.setup.marked_steps import generating_step, pipelined_step
from lightning_pipedream.strategy.setup.memory_prediction import (
    Unpredictable,
    optimizer_and_replicas,
    predicted_stages,
    prediction_or_none,
)
from lightning_pipedream.strategy.setup.options import PipelineOptions
from lightning_pipedream.strategy.setup.placement import Placement
from lightning_pipedream.strategy.setup.pretrained import StageWeights, refuse_pretrained_with_real_weights

log = logging.getLogger("lightning_pipedream.strategy")

# A Trainer call whose every step runs in evaluation mode (Lightning switches the module to it before the loop).
EVALUATING = (TrainerFn.VALIDATING, TrainerFn.TESTING)


def _capture_or_none(module: torch.nn.Module, args: tuple, kwargs: dict, through: str | None,
                     on_meta: bool) -> Any:
    """The module's call captured, or None where it cannot be (the caller captures again, raising then)."""
    from lightning_pipedream.graph import capture

    try:
        return capture(module, args, kwargs, through, on_meta=on_meta)
    except Exception:  # noqa: BLE001 - rank 0 reports it; see GraphPath._split
        return None


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
        # a meta-built module split by the FLOP estimate: each rank's predicted peak memory and its terms
        # (plan.memory.StageMemory.to_json, one per stage: its replicas hold alike), None when not predicted
        self.predicted_memory: list[dict[str, Any]] | None = None
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
        """Capture the forward call on a first batch, choose split points, keep this rank's stage. A step marked
        ``@generates`` (``trainer.predict`` straight from a checkpoint) gives the model's plain forward call on its
        prompts: the pipeline is built from that, never from a cached decoding call."""
        hook = STEP_OF[trainer.state.fn]
        # trainer.validate() and trainer.test() run no step in training mode: the split is made from the capture
        # their steps run (one trace, not a training-mode one no step would use, then the evaluation one).
        evaluation = evaluating(module) if trainer.state.fn in EVALUATING else nullcontext()
        with pipelined_step(module, hook), evaluation:
            self._split(trainer, module, hook)
        if generating_step(module, hook):  # the next unmarked step captures its own call, whatever its batch's shapes
            self._inputs_seen.clear()

    def _split(self, trainer: Trainer, module: LightningModule, hook: str) -> None:
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
        # self(...), or a child holding the whole model that the step calls directly (self.model(..., labels=...))
        self.call, (args, kwargs) = pipelined_call(module, hook, part, 0)
        through = getattr(self.call, "name", None)
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

                on_rank_zero["captured"] = captured = capture(module, args, kwargs, through, on_meta=on_meta)
                estimate = estimate_graph(captured) if on_meta else None  # no weights to time: FLOPs of the shapes
                chosen, plan = choose_split_points(captured, module, args, kwargs, total, profile=estimate,
                                                   bandwidth=options.link_bandwidth)
                on_rank_zero["plan"] = plan = for_the_run(plan, options.schedule, chunks, batch_size(part),
                                                               options.virtual_stages)
                memory = None
                if estimate is not None and hook == "training_step":  # what training holds: the memory model's
                    loss = loss_bytes(module, self.call, hook, part, captured, self.device)
                    memory = predicted_memory(options, placement, module, captured, estimate, plan.balance, chunks,
                                              self.device, loss)
                log.info("PipeDreamStrategy split points (%d stages, schedule=%s, from %s): %s%s", total,
                         options.schedule, estimate_source(on_meta), chosen, memory_text(memory, plan))
                return chosen, memory

            # A model on the meta device is split by a FLOP estimate, not by timing: the other ranks trace the same
            # call meanwhile, rather than after rank 0's choice (which only the split needs), so their captures
            # overlap rank 0's. A model with weights is profiled by timing its layers on rank 0, which the others'
            # captures would disturb where the ranks share cores (the CPU): they wait, as the profile needs. A failure
            # here is left to rank 0's words (the same model fails there too) or, failing on this rank alone, to the
            # capture after the choice.
            early = None
            if on_meta and not self.is_global_zero:
                early = _capture_or_none(module, args, kwargs, through, on_meta)
            points, memory = from_rank_zero(f"split {type(module).__name__} into stages", choose)
            self.predicted_memory = memory
            captured, self.plan = on_rank_zero.get("captured", early), on_rank_zero.get("plan")
        if options.split_points is None:
            self.graph = CapturedStage(module, placement.stage_index, total, points, args, kwargs, captured,
                                       through, on_meta=on_meta, prepare=self._prepare, **self._chunk_layout())
        else:
            self.graph = self._stage_of_split_points(module, hook, part, args, kwargs, through)
        self._inputs_seen = {(module.training, batch_shapes(part))}
        refuse_ties_with_replicas(self.graph.ties, placement)

    def _stage_of_split_points(self, module: LightningModule, hook: str, part: Any, args: tuple,
                               kwargs: dict, through: str | None) -> CapturedStage:
        """split_points given: trace the module's forward; if that cannot be traced, the innermost module holding
        the split points that the step calls (every rank decides alike: the same model, batch and failure)."""
        assert self.options.split_points is not None
        points = list(self.options.split_points)
        stage_index, num_stages = self.placement.stage_index, self.placement.num_stages * self.options.virtual_stages
        on_meta = self.weights is not None
        try:
            return CapturedStage(module, stage_index, num_stages, points, args, kwargs, through=through,
                                 on_meta=on_meta, prepare=self._prepare, **self._chunk_layout())
        except GraphCaptureError as untraceable:
            inner = innermost_called_module(module, points, hook, part, 0)
            if inner is None or inner == through:
                raise
            through = inner
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


def for_the_run(plan: Any, schedule: str, chunks: int, samples: int, virtual_stages: int = 1) -> Any:
    """The split-point plan as the run holds it (``strategy.plan``, which its explanation reads). The graph is
    profiled (or estimated) on one micro-batch of ``samples`` samples, so the partitioner's figures are per micro-batch
    and its plan says schedule "pipedream" with one: the run's schedule and ``chunks`` instead (the simulator then
    gives a step of ``chunks`` micro-batches of the plan's times divided by ``chunks``: its fill and drain in the
    same per-micro-batch units), and ``extra["batch_size"]`` the micro-batch's samples, from which the explanation
    counts the plan's minibatches a training step held (``minibatches_per_step``: the step's samples over these,
    ``chunks`` for a full batch). With ``virtual_stages`` chunks per rank (interleaved, a V) its stages are the model
    chunks in model order: it says so (``extra["chunk_stages"]``, ``extra["virtual_stages"]``), so that the explanation
    and the simulator put each chunk on the rank the schedule gives it."""
    plan.schedule, plan.chunks = schedule, chunks
    plan.extra["batch_size"] = int(samples)
    if virtual_stages > 1:
        plan.extra.update(chunk_stages=True, virtual_stages=int(virtual_stages))
    return plan


def estimate_source(on_meta: bool) -> str:
    """Where a traced module's layer times come from, for the plan's log line."""
    return "a FLOP estimate of the meta model's shapes" if on_meta else "profiling each layer"


def refuse_ties_with_replicas(ties: Any, placement: Placement) -> None:
    """Tied weights across a traced graph's stages are synchronised within one pipeline only: refused beside
    data-parallel pipelines and beside unequal replicas (1F1B-RR) alike."""
    if ties and (placement.num_pipelines > 1 or placement.layout is not None):
        raise ValueError(
            f"Parameters {sorted(ties)} are used on several stages (tied weights), which PipeDreamStrategy does not "
            "combine with data-parallel pipelines or replicated stages yet. Run one pipeline (stages = processes, "
            "no replicas=), or split points that keep each tied parameter's users in one stage."
        )


def predicted_memory(options: PipelineOptions, placement: Placement, module: LightningModule, captured: Any,
                     estimate: Any, balance: list[int], chunks: int, device: torch.device,
                     loss: tuple[int, int] | None = None) -> list[dict] | None:
    """Each rank's predicted peak memory (``StageMemory.to_json``) for the split ``balance`` (layers per stage) of
    ``captured``, with ``estimate`` (of one micro-batch of ``chunks``) given the memory model's working sets on fake
    tensors and ``loss``'s bytes (:func:`~lightning_pipedream.strategy.setup.graph_memory.loss_bytes`); None (and a
    log line saying why) where the model does not say: an optimizer of unknown state, shards, unequal replicas."""
    from lightning_pipedream.graph.estimate import scaled_to_batch
    from lightning_pipedream.plan.memory import stage_bytes
    from lightning_pipedream.strategy.setup.checks import optimizers_unvalidated

    def predict() -> list[dict[str, Any]]:
        try:
            optimizers, _ = optimizers_unvalidated(module)  # on the meta device: only its kind and groups are read
        except (ValueError, TypeError, RuntimeError) as unknown:
            raise Unpredictable(str(unknown)) from None
        if options.shard is not None:
            raise Unpredictable(f"shard={options.shard!r}: the traced graph's stages are not sharded")
        kind, replicas = optimizer_and_replicas(placement, optimizers, without_optimizer="sgd")
        # the refusals above come first: the memory profile on fake tensors is the costly part
        profile = scaled_to_batch(memory_profile(estimate, captured, device, module, loss), chunks)
        return predicted_stages(stage_bytes(profile, balance, device=device.type), options, chunks, kind, replicas,
                                device, carries_gradients(module))

    return prediction_or_none(predict)


def carries_gradients(module: LightningModule) -> bool:
    """Whether each step starts with the last one's gradients (``accumulate_grad_batches`` > 1): the memory model
    then counts them at every moment."""
    trainer = module._trainer
    return trainer is not None and trainer.accumulate_grad_batches > 1


def memory_text(memory: list[dict] | None, plan: Any) -> str:
    """The log's lines for :func:`predicted_memory`: per rank its layers and each term of its predicted peak."""
    if not memory:
        return ""
    from lightning_pipedream.plan.choice import bytes_text

    lines = [f"\npredicted memory per rank (optimizer {memory[0]['optimizer']}; the FLOP estimate's shapes, what "
             "autograd saves found on fake tensors):"]
    for m in memory:
        first, last = plan.stages[m["chunks"][0]].layers[0], plan.stages[m["chunks"][-1]].layers[-1]
        step = m["activations_at_update"] + max(m["update_working"], m.get("sync_working", 0))
        lines.append(f"  rank {m['stage']} ({first} .. {last}): weights {bytes_text(m['parameters'])}, gradients "
                     f"{bytes_text(m['gradients'])}, optimizer {bytes_text(m['optimizer_state'])}, activations "
                     f"{bytes_text(m['activations'])} ({m['held']} micro-batches in flight), backward "
                     f"{bytes_text(m['backward_working'])}, step {bytes_text(step)}: peak "
                     f"{bytes_text(m['predicted_peak_bytes'])}")
    return "\n".join(lines)


def auto_plan_graph(options: PipelineOptions, trainer: Trainer, module: LightningModule,
                    batch_to_device: Callable[[Any], Any], processes_per_node: int, num_nodes: int, optimizer: str,
                    device: torch.device) -> tuple[dict[str, Any], Any]:
    """``schedule='auto'`` for a module split from its traced graph: rank 0 traces the forward call on the first
    training batch (on the meta device for a model built there), estimates each layer (a FLOP estimate of the shapes
    on meta, else profiled), finds what each layer's forward and backward hold on fake tensors, and the auto planner
    chooses the split (between the model's blocks), the pipelines (d data-parallel pipelines of processes/d stages, d
    dividing the processes; one straight pipeline among them), schedule, micro-batches and recompute within
    ``memory_limit``. Every rank gets the strategy arguments (``split_points`` for the split, ``stages`` when there
    are several pipelines) and the Plan."""
    from lightning_pipedream.plan.partition import Plan

    if options.shard in ("full", "grad_op"):
        raise ValueError(f"PipeDreamStrategy(schedule='auto', shard={options.shard!r}): the traced graph's stages "
                         f"are not sharded yet, so {type(module).__name__} (not one nn.Sequential) cannot run sharded "
                         "replicas. Drop shard= (or shard='auto': whole replicas), or put the layers in one "
                         "nn.Sequential.")
    workers = processes_per_node * num_nodes

    def choose() -> tuple[dict[str, Any] | None, dict | None, str | None]:
        batch = first_batch(trainer.fit_loop)
        if batch is None:
            return None, None, ("PipeDreamStrategy(schedule='auto') plans on the first training batch, but the "
                                "dataloader gave none. Give a dataloader with at least one batch, or name a schedule.")
        captured, profile, on_meta = graph_auto_profile(module, batch_to_device(batch), device, workers)
        try:
            arguments, chosen, described = plan_graph(options, module, captured, profile, processes_per_node,
                                                      num_nodes, optimizer, device, trainer.accumulate_grad_batches > 1)
        except ValueError as refused:  # every rank raises the refusal itself, as if it had planned
            return None, None, str(refused)
        log.info("PipeDreamStrategy(schedule='auto') chose (from %s; memory from what autograd saves, found on fake "
                 "tensors):\n%s\nrun it with PipeDreamStrategy(%s)", estimate_source(on_meta), described,
                 ", ".join(f"{key}={value!r}" for key, value in arguments.items()))
        return {**arguments, "shard": None}, chosen.plan.to_json(), None

    arguments, plan_json, refused = from_rank_zero(f"trace {type(module).__name__} and plan the pipeline "
                                                   "(schedule='auto')", choose)
    if refused is not None:
        raise ValueError(refused)
    assert arguments is not None
    return arguments, Plan.from_json(plan_json)


def graph_auto_profile(module: LightningModule, batch: Any, device: torch.device,
                       workers: int) -> tuple[Any, Any, bool]:
    """What ``schedule='auto'`` plans a traced module from: its forward call captured on ``batch`` (on the meta device
    for a model built there), each layer's times (a FLOP estimate on meta, else profiled) and what its forward and
    backward hold (fake tensors), cuts allowed only between the model's blocks. Returns (captured, profile, on_meta)."""
    from lightning_pipedream.graph import capture
    from lightning_pipedream.graph.split_points import profile_graph, unit_starts

    call, (args, kwargs) = pipelined_call(module, "training_step", batch, 0)
    on_meta = has_meta_tensors(module)
    captured = capture(module, args, kwargs, getattr(call, "name", None), on_meta=on_meta)
    profile = estimate_graph(captured) if on_meta else profile_graph(captured, module, args, kwargs)
    loss = loss_bytes(module, call, "training_step", batch, captured, device)
    profile = memory_profile(profile, captured, device, module, loss)
    # Cuts between the model's blocks: the shallowest modules that give every chunk of an interleaved split one
    depths = range(1, 1 + max((len(layer.module.split(".")) for layer in captured.layers), default=1))
    starts = [unit_starts(module, captured, depth) for depth in depths]
    allowed = next((s for s in starts if len(s) >= 2 * workers - 1),
                   next((s for s in starts if len(s) >= workers - 1), None))
    if allowed is not None:
        profile = dataclasses.replace(profile, no_cut_after=sorted(
            set(profile.no_cut_after) | {i for i in range(len(profile.layers) - 1) if i + 1 not in allowed}))
    return captured, profile, on_meta


def plan_graph(options: PipelineOptions, module: LightningModule, captured: Any, profile: Any,
               processes_per_node: int, num_nodes: int, optimizer: str, device: torch.device,
               gradients_carried: bool = False) -> tuple[dict[str, Any], Any, str]:
    """The auto planner's choice for a traced module, among what the graph path runs: equal replicas (d data-parallel
    pipelines, a straight pipeline the case d = 1), never unequal ones or shards (not run on traced stages yet), and
    one straight pipeline when a parameter tied across the chosen stages would need the data-parallel pipelines that
    the graph path refuses with ties. Returns the strategy arguments (``split_points``; ``stages`` for several
    pipelines), the :class:`~lightning_pipedream.plan.choice.AutoPlan` and its description for the log."""
    from lightning_pipedream.graph.split import split_graph
    from lightning_pipedream.graph.split_points import module_names
    from lightning_pipedream.plan.auto import auto_plan
    from lightning_pipedream.plan.topology import Topology

    def planned(replicas: str) -> tuple[dict[str, Any], Any]:
        chosen = auto_plan(profile, Topology.of_cluster(processes_per_node, num_nodes, options.bandwidth),
                           options.memory_limit, exact=options.exact, optimizer=optimizer, replicas=replicas,
                           gradients_carried=gradients_carried,
                           **({"device": "cuda", "cuda_capability": tuple(torch.cuda.get_device_capability(device))}
                              if device.type == "cuda" else {}))
        arguments = chosen.strategy_arguments()
        starts_at = list(itertools.accumulate(arguments.pop("balance")))[:-1]
        arguments["split_points"] = module_names(module, captured, [profile.layers[i].name for i in starts_at])
        counts = arguments.pop("replicas", None)  # equal: d data-parallel pipelines of len(counts) stages
        if counts is not None:
            arguments["stages"] = len(counts)
        return arguments, chosen

    arguments, chosen = planned("equal")
    first = chosen.chosen
    tied = sorted(split_graph(captured, arguments["split_points"]).ties) if "stages" in arguments else []
    if tied:  # the graph path refuses ties with data-parallel pipelines (GraphPath.split): one pipeline instead
        arguments, chosen = planned("none")
    c = chosen.chosen
    stages = f"{len(c.replicas)} stage{'s' if len(c.replicas) > 1 else ''}"
    described = chosen.describe().rsplit("\n", 1)[0]  # its last line names balance=, which a graph does not take
    if tied:
        described += (f"\none straight pipeline of {stages}: the fastest plan, {first.label()}, has parameters "
                      f"{tied} on several stages (tied weights), which data-parallel pipelines of a traced graph do "
                      "not take yet")
    elif c.replicas[0] > 1:
        described += f"\n{c.replicas[0]} data-parallel pipelines of {stages}"
    else:
        described += f"\none straight pipeline of {stages}"
    return arguments, chosen, described
