"""Memory per stage and schedule: weights, gradients, optimizer state, stashed versions and activations in flight."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lightning_pipedream.plan.profile import Profile
from lightning_pipedream.schedule.actions import Op, Schedule
from lightning_pipedream.schedule.builders import build_schedule
from lightning_pipedream.schedule.specs import spec_of

# Bytes of optimizer state per byte of parameters: SGD keeps none, momentum one buffer, Adam two (exp_avg, exp_avg_sq).
OPTIMIZER_STATE = {"sgd": 0, "momentum": 1, "adam": 2}


def optimizer_state_ratio(optimizer: str) -> int:
    """Bytes of optimizer state per parameter byte for ``optimizer`` (one of :data:`OPTIMIZER_STATE`)."""
    try:
        return OPTIMIZER_STATE[optimizer]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown optimizer kind {optimizer!r}; choose one of {', '.join(OPTIMIZER_STATE)} "
            "(SGD without momentum keeps no state, momentum one buffer, Adam two)."
        ) from None


_ADAM_FAMILY = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax")  # exp_avg and exp_avg_sq (Adamax: exp_inf)


def optimizer_kind(optimizer: Any) -> str:
    """The memory model's kind of a ``torch.optim`` optimizer: "sgd", "momentum" (one buffer per parameter: SGD
    with momentum, Adagrad, RMSprop without momentum) or "adam" (two: the Adam family, RMSprop with momentum)."""
    name = type(optimizer).__name__
    groups = getattr(optimizer, "param_groups", [])
    momentum = any(group.get("momentum", 0) for group in groups)
    if name == "SGD":
        return "momentum" if momentum else "sgd"
    if name in _ADAM_FAMILY or (name == "RMSprop" and momentum):
        return "adam"
    if name in ("Adagrad", "RMSprop"):
        return "momentum"
    raise ValueError(
        f"The memory model does not know how much state {name} keeps; pass optimizer='sgd' (none), 'momentum' "
        "(one buffer the size of the parameters) or 'adam' (two)."
    )


@dataclass(frozen=True)
class StageMemory:
    """The predicted peak memory of one worker holding ``stage`` (interleaved: the rank holding ``chunks``).

    Every term is in bytes. ``parameters`` are the live weights, ``stashed_weights`` the other versions kept for
    minibatches in flight (``weight_versions - 1`` copies), ``activations`` what the ``held`` micro-batches in flight
    keep between forward and backward at the worst moment, ``replay`` what a recomputed backward rebuilds for one
    micro-batch on top of that.
    """

    stage: int
    chunks: tuple[int, ...]  # the model stages this worker holds (one, except interleaved)
    replicas: int
    parameters: int
    gradients: int
    optimizer_state: int
    stashed_weights: int
    weight_versions: int
    activations: int
    held: int  # micro-batches (interleaved: chunk micro-batches) in flight at the peak
    recompute: bool
    replay: int

    @property
    def predicted_peak_bytes(self) -> int:
        return (
            self.parameters + self.gradients + self.optimizer_state + self.stashed_weights + self.activations
            + self.replay
        )

    def to_json(self) -> dict:
        data = asdict(self)
        data["chunks"] = list(self.chunks)
        data["predicted_peak_bytes"] = self.predicted_peak_bytes
        return data


def held_bytes(schedule: Schedule, per_microbatch: Sequence[float]) -> list[tuple[float, int]]:
    """Per rank, the most bytes of activations it holds at once and how many micro-batches that is.

    Walks each rank's actions in order: a forward of stage s adds ``per_microbatch[s]``, its backward (the
    weight half when the backward is split) releases it. Counted on the built schedule, so every schedule's own
    order decides (gpipe holds all micro-batches, 1f1b ``stages - s``, zb-h1 until each W, interleaved its
    chunks' warm-up).
    """
    release = Op.BACKWARD_WEIGHT if schedule.splits_backward else Op.BACKWARD
    out = []
    for actions in schedule.actions:
        live: dict[tuple[int, int | None], float] = {}
        total = peak = 0.0
        count = 0
        for a in actions:
            if a.op is Op.FORWARD:
                live[(a.stage, a.microbatch)] = per_microbatch[a.stage]
                total += per_microbatch[a.stage]
            elif a.op is release:
                total -= live.pop((a.stage, a.microbatch))
            else:
                continue
            if total > peak or (total == peak and len(live) > count):
                peak, count = total, len(live)
        out.append((peak, count))
    return out


def in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most micro-batches (minibatches under pipedream) whose forward ran and backward has not."""
    return [count for _, count in held_bytes(schedule, [1.0] * schedule.num_stages)]


@dataclass(frozen=True)
class StageBytes:
    """What one stage's layers weigh, per whole batch (one data shard): the inputs to the memory model."""

    parameters: float
    input: float  # what the stage receives (stage 0: the batch), kept for its backward
    layers: float  # what its layers keep between forward and backward, its output included
    output: float  # what it hands to the next stage (0 on the last)


def layer_keeps(profile: Profile) -> tuple[list[float], list[float]]:
    """Per layer, the bytes its forward keeps for the backward (the profiler's ``saved_bytes``; unmeasured: its
    output), and what a stage ending at the layer keeps on top: its output, which the stage holds to start the
    backward from, when no layer saves it (0 on the last layer, whose output only the loss reads)."""
    cuts = profile.cut_bytes() + [0]
    saved = [float(layer.activation_bytes if layer.saved_bytes is None else layer.saved_bytes)
             for layer in profile.layers]
    ending = [0.0 if layer.output_saved in (None, True) else float(cut) for layer, cut in zip(profile.layers, cuts)]
    return saved, ending


def stage_bytes(profile: Profile, balance: Sequence[int], input_bytes: float | None = None) -> list[StageBytes]:
    """The bytes of each stage of ``balance`` (layers per stage) under ``profile``.

    ``input_bytes``: the batch stage 0 receives (default: the profile's ``extra["input_bytes"]``, else 0).
    """
    if input_bytes is None:
        input_bytes = float(profile.extra.get("input_bytes", 0) or 0)
    cuts = profile.cut_bytes() + [0]
    saved, ending = layer_keeps(profile)
    out, first = [], 0
    for count in balance:
        last = first + count - 1
        layers = profile.layers[first : last + 1]
        out.append(
            StageBytes(
                parameters=float(sum(layer.parameter_bytes for layer in layers)),
                input=float(cuts[first - 1]) if first > 0 else float(input_bytes),
                layers=float(np.sum(saved[first : last + 1])) + ending[last],
                output=float(cuts[last]),
            )
        )
        first = last + 1
    return out


def _per_stage_flags(name: str, value: bool | Sequence[bool], stages: int) -> list[bool]:
    flags = [bool(value)] * stages if isinstance(value, bool) else [bool(v) for v in value]
    if len(flags) != stages:
        raise ValueError(f"{name} lists {len(flags)} values for {stages} stages; give one per stage, or one bool.")
    return flags


def flight_schedule(
    schedule: str, stages: int, chunks: int, replicas: Sequence[int] | None = None, virtual_stages: int = 1
) -> Schedule:
    """The schedule whose action lists the memory model counts: long enough to reach its steady state.

    Equal replicas are data-parallel copies of a straight pipeline, so they count as one pipeline.
    """
    spec = spec_of(schedule)
    unequal = replicas is not None and len(set(replicas)) > 1
    reps = list(replicas) if unequal and replicas is not None else None
    if spec.asynchronous:
        # the first warm-up fills within (workers + 1) minibatches; a few more cost little
        workers = sum(replicas) if replicas is not None else stages
        return build_schedule(schedule, stages, chunks, minibatches=workers + 2, replicas=reps)
    if spec.virtual_stages:
        return build_schedule(schedule, stages, chunks, virtual_stages=virtual_stages)
    return build_schedule(schedule, stages, chunks, replicas=reps)


def predict_memory(
    sizes: Sequence[StageBytes],
    schedule: str,
    chunks: int = 1,
    *,
    replicas: Sequence[int] | None = None,
    virtual_stages: int = 1,
    recompute: bool | Sequence[bool] = False,
    optimizer: str = "adam",
    flight: Schedule | None = None,
) -> list[StageMemory]:
    """Each worker's predicted peak memory under ``schedule`` (one entry per stage; interleaved: per rank).

    ``sizes`` are the stages' bytes per whole batch (interleaved: the ``ranks x virtual_stages`` model chunks, chunk
    c of rank r being stage ``c * ranks + r``); each micro-batch carries ``1 / chunks`` of the activations.
    ``recompute[s]`` keeps only stage s's input and output per micro-batch and rebuilds the rest in its backward.
    Stashed versions: pipedream keeps one per minibatch in flight on the worker (``stages - s`` in a straight
    pipeline, ``ceil(workers from s on / replicas of s)`` under replicas), 2bw two, the rest one.
    ``flight``: the schedule to count in-flight micro-batches on (default: :func:`flight_schedule`).
    """
    spec = spec_of(schedule)
    ratio = optimizer_state_ratio(optimizer)
    v = virtual_stages if spec.virtual_stages else 1
    total = len(sizes)
    if total % v:
        raise ValueError(f"{total} stages do not divide into {v} virtual stages per rank; give ranks x {v} stages.")
    ranks = total // v
    flags = _per_stage_flags("recompute", recompute, total)
    if replicas is None:
        replicas = [1] * ranks
    if len(replicas) != ranks:
        raise ValueError(f"replicas lists {len(replicas)} counts for {ranks} stages; give one per stage.")
    if flight is None:
        flight = flight_schedule(schedule, ranks, chunks, replicas, v)
    kept = [
        (s.input + s.output) if rc else (s.input + s.layers) for s, rc in zip(sizes, flags)
    ]
    per_mb = [k / chunks for k in kept]
    held = held_bytes(flight, per_mb)
    if flight.replicas is not None:  # unequal replicas: the busiest replica of each stage
        layout = flight.layout
        assert layout is not None
        by_stage = [max(held[r] for r in layout.ranks_of(s)) for s in range(ranks)]
    else:
        by_stage = held
    out = []
    for rank in range(ranks):
        mine = list(range(rank, total, ranks))
        params = sum(sizes[s].parameters for s in mine)
        act_bytes, count = by_stage[rank]
        if v == 1:  # one stage per worker: its micro-batches all weigh the same (the planner's tables multiply too)
            act_bytes = count * per_mb[rank]
        if spec.weight_versions is None:  # weight stashing: one version per minibatch in flight
            versions = max(1, count)
        else:
            versions = spec.weight_versions
        replay = max(
            ((sizes[s].layers - sizes[s].output) / chunks if flags[s] else 0.0 for s in mine), default=0.0
        )
        out.append(
            StageMemory(
                stage=rank,
                chunks=tuple(mine),
                replicas=int(replicas[rank]),
                parameters=round(params),
                gradients=round(params),
                optimizer_state=round(ratio * params),
                stashed_weights=round((versions - 1) * params),
                weight_versions=versions,
                activations=round(act_bytes),
                held=count,
                recompute=any(flags[s] for s in mine),
                replay=round(max(0.0, replay)),
            )
        )
    return out
