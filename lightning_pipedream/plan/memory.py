"""Memory per stage and schedule: weights, gradients, optimizer state, stashed versions and activations in flight."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lightning_pipedream.plan.profile import Profile
from lightning_pipedream.plan.shards import (
    SHARD_MODES,
    can_shard,
    chunks_unsharded,
    gathered_bytes,
    whole_gradient_bytes,
)
from lightning_pipedream.schedule.actions import Op, Schedule
from lightning_pipedream.schedule.builders import build_schedule, rank_stages, v_virtual_stages
from lightning_pipedream.schedule.specs import spec_of

# Bytes of optimizer state per byte of parameters: SGD keeps none, momentum one buffer, Adam two (exp_avg, exp_avg_sq).
OPTIMIZER_STATE = {"sgd": 0, "momentum": 1, "adam": 2}
# Temporaries of one step, in largest parameter tensors: torch's per-tensor loops (its default on the CPU) make them
# one tensor at a time: Adam's denominator (a square root, then a division: two at once), Adagrad's and RMSprop's
# square root (one), plain SGD none. (Its multi-tensor loops, the default on GPUs, make them for all tensors at once.)
OPTIMIZER_TEMPORARIES = {"sgd": 0, "momentum": 1, "adam": 2}

# ---- What CUDA adds (device="cuda"); every number from torch's own code, as of torch 2.x:
# Temporaries of one step on CUDA, in bytes of *all* the worker's parameters: torch's optimizers default to their
# multi-tensor ("foreach") loops there (torch/optim/optimizer.py, _default_to_fused_or_foreach), which make each
# temporary for every parameter tensor in one call. torch/optim/adam.py, _multi_tensor_adam: ``exp_avg_sq_sqrt =
# torch._foreach_sqrt(exp_avg_sqs)`` is the one list alive at the update (everything after it is in place; the
# weight-decay copy of the gradients, ``torch._foreach_add``, is deleted before it is made): 1. torch/optim/sgd.py,
# _multi_tensor_sgd: the momentum buffers are updated in place (``_foreach_mul_``, ``_foreach_add_``) and added into
# the parameters: 0 (weight decay would add one list, 1; not modelled). Plain SGD: ``_foreach_add_``, 0. (Adagrad's
# and RMSprop's foreach loops make one list, ``_foreach_sqrt``, but share the "momentum" kind with SGD: 1 too few.)
FOREACH_TEMPORARIES = {"sgd": 0, "momentum": 0, "adam": 1}
# The caching allocator (c10/cuda/CUDACachingAllocator.cpp): ``round_size`` makes every block a multiple of
# kMinBlockSize = 512 B (at least 512); a request of kMinLargeAlloc = 10 MiB or more gets a segment of its own,
# rounded to kRoundLarge = 2 MiB, and ``should_split`` leaves a large block whole when what would remain is
# kSmallSize = 1 MiB or less: ``memory_allocated`` then counts the whole segment.
CUDA_BLOCK = 512
CUDA_SMALL_SIZE = 1 << 20
CUDA_MIN_LARGE_ALLOC = 10 << 20
CUDA_ROUND_LARGE = 2 << 20
# cuBLAS's workspace, allocated through the caching allocator once per (cuBLAS handle, stream) and kept
# (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize): by default 4096 KiB x 8 = 32 MiB on Hopper
# (compute capability 9.0), else ":4096:2:16:8" = 4096 KiB x 2 + 16 KiB x 8; CUBLAS_WORKSPACE_CONFIG overrides it.
# cuBLASLt's own (getCUDABlasLtWorkspace; CUBLASLT_WORKSPACE_SIZE, default 1024 KiB) comes on top unless
# TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 shares cuBLAS's.
CUBLAS_WORKSPACE_HOPPER = 4096 * 1024 * 8
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLASLT_WORKSPACE = 1024 * 1024
# Handles are per thread (a thread-local pool window): a training process runs its forward's matrix products on its
# own thread and its backward's on autograd's thread for the device (torch/csrc/autograd/engine.cpp runs CUDA
# backwards on a device thread): two workspaces.
CUBLAS_THREADS = 2
DEVICES = ("cpu", "cuda")


def cuda_block_bytes(nbytes: float) -> int:
    """What CUDA's caching allocator counts (``torch.cuda.memory_allocated``) for one tensor of ``nbytes`` taken from a
    fresh segment: rounded up to 512 B; from 10 MiB on, the whole 2 MiB-rounded segment when the rest would be 1 MiB
    or less (see :data:`CUDA_BLOCK`). A cached larger block reused whole (up to 1 MiB more) is not modelled."""
    if nbytes <= 0:
        return 0  # an empty tensor takes no block
    size = max(CUDA_BLOCK, CUDA_BLOCK * math.ceil(nbytes / CUDA_BLOCK))
    if size >= CUDA_MIN_LARGE_ALLOC:
        segment = CUDA_ROUND_LARGE * math.ceil(size / CUDA_ROUND_LARGE)
        if segment - size <= CUDA_SMALL_SIZE:
            return segment
    return size


def cublas_workspace_bytes(capability: tuple[int, int] = (9, 0), threads: int = CUBLAS_THREADS) -> int:
    """The cuBLAS (and cuBLASLt) workspaces a process training on a GPU of compute ``capability`` holds, with its matrix
    products run on ``threads`` threads (see :data:`CUBLAS_THREADS`); each rounded as the allocator does."""
    cublas = CUBLAS_WORKSPACE_HOPPER if tuple(capability) == (9, 0) else CUBLAS_WORKSPACE_DEFAULT
    return threads * (cuda_block_bytes(cublas) + cuda_block_bytes(CUBLASLT_WORKSPACE))


def _check_device(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"device={device!r}: the memory model knows {', '.join(DEVICES)} (what CUDA's allocator, "
                         "foreach optimizers and cuBLAS add is modelled under 'cuda').")
    return device


def backward_working(grad_working: Any, grad_temps: Any, chunks: int) -> Any:
    """What one backward holds while it runs (bytes, or a table of them): its activation gradients, 1/chunks of the
    whole batch's, and with several micro-batches the parameter gradients computed before they are added into
    ``.grad`` (with one micro-batch per update each becomes ``.grad`` as it is: the gradients term holds it)."""
    return grad_working / chunks + (grad_temps if chunks > 1 else 0.0)


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

    Sharded over its ``replicas`` (``shard``, FSDP2): ``parameters``, ``gradients`` and ``optimizer_state`` are this
    rank's shards (1 / replicas each); within a step ``whole_gradients`` are held whole until the reduce-scatter, and
    ``gathered`` is the working copy of the weights a forward or backward gathers. Replicated (``replicas`` > 1, no
    shard), ``sync_working`` is the all-reduce's flat copy of the gradients.
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
    held: int  # the most micro-batches (interleaved: chunk micro-batches) in flight at once
    recompute: bool
    replay: int
    backward_working: int = 0
    activations_at_update: int = 0
    update_working: int = 0
    workspace: int = 0  # device="cuda": cuBLAS's workspaces, allocated once and held for good
    shard: str | None = None  # FSDP2 over the replicas: "grad_op" or "full"
    whole_gradients: int = 0  # sharded: the gradients held whole within a step, until the reduce-scatter
    gathered: int = 0  # sharded: the gathered working copy of the weights in a forward or backward
    sync_working: int = 0  # replicated: the all-reduce's flat copy of the gradients, before the update
    # Counted from the step's first backward on (see :func:`gradients_from_first_backward`): the most activations held
    # while the gradients exist, and the most bytes (beyond parameters, optimizer state and stashed weights) at the
    # moments before they do, the first backward included, which makes them layer by layer as it frees activations.
    # None: gradients counted at every moment.
    activations_with_gradients: int | None = None
    before_gradients: int | None = None

    @property
    def predicted_peak_bytes(self) -> int:
        weights = self.parameters + self.gradients + self.optimizer_state + self.stashed_weights
        unsharded = max(0, self.whole_gradients - self.gradients) + self.gathered  # within a step only
        held = self.activations if self.activations_with_gradients is None else self.activations_with_gradients
        in_backward = held + self.replay + self.backward_working + unsharded
        in_update = self.activations_at_update + max(self.update_working, self.sync_working)
        before = -self.gradients if self.before_gradients is None else self.before_gradients - self.gradients
        return weights + self.workspace + max(in_backward, in_update, before)

    def to_json(self) -> dict:
        data = asdict(self)
        data["chunks"] = list(self.chunks)
        if not self.workspace:  # the CPU's terms: the JSON as before the CUDA terms came
            del data["workspace"]
        for key in ("shard", "whole_gradients", "gathered", "sync_working"):  # unsharded, unreplicated: as before
            if not data[key]:
                del data[key]
        for key in ("activations_with_gradients", "before_gradients"):
            if data[key] is None:
                del data[key]
        data["predicted_peak_bytes"] = self.predicted_peak_bytes
        return data


@dataclass(frozen=True)
class Held:
    """One rank's activations in flight over its schedule: the most bytes at once (``peak``), the most micro-batches
    at once (``count``), the same two when an optimizer step runs, the most micro-batches between the two halves
    of a split backward at once, and whether a forward runs after a backward between two updates (then a sharded
    stage's whole gradients and the weights that forward gathers are alive together)."""

    peak: float
    count: int
    at_update: float = 0.0
    count_at_update: int = 0
    most_pending: int = 0
    forward_after_backward: bool = False
    # The same counts (micro-batches held, and waiting for their weight half) split by whether the step's parameter
    # gradients exist yet: a step starts without them (the update before set them to None) and makes them in its first
    # backward (a split backward: its first weight half). ``first``: at that backward, its own micro-batch included.
    with_gradients: tuple[int, int] = (0, 0)
    before_gradients: tuple[int, int] = (0, 0)
    first: tuple[int, int] = (0, 0)


def walk_held(
    schedule: Schedule, per_microbatch: Sequence[float], pending: Sequence[float] | None = None
) -> list[Held]:
    """Per rank, what :class:`Held` says, walking each rank's actions in order.

    A forward of stage s adds ``per_microbatch[s]``, its backward releases it; when the backward is split, its
    input half adds ``pending[s]`` (the gradients kept for the weight half) and the weight half releases both.
    Counted on the built schedule, so every schedule's own order decides (gpipe holds all micro-batches, 1f1b
    ``stages - s``, zb-h1 until each W, interleaved its chunks' warm-up).
    """
    split = schedule.splits_backward
    release = Op.BACKWARD_WEIGHT if split else Op.BACKWARD  # also the action that makes parameter gradients
    extra = list(pending) if pending is not None and split else [0.0] * len(per_microbatch)
    out = []
    for actions in schedule.actions:
        live: dict[tuple[int, int | None], float] = {}
        waiting: set[tuple[int, int | None]] = set()
        total = peak = at_update = 0.0
        count = count_at_update = most_pending = 0
        backward_ran = forward_after_backward = have_gradients = False
        moments = {"with": (0, 0), "before": (0, 0), "first": (0, 0)}
        for a in actions:
            if a.op is release:  # at the moment it starts: what it holds, its own micro-batch included
                kind = "with" if have_gradients else "first"
                moments[kind] = _most(moments[kind], (len(live), len(waiting)))
                have_gradients = True
            if a.op is Op.FORWARD and backward_ran:
                forward_after_backward = True
            elif a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
                backward_ran = True
            elif a.op is Op.OPTIMIZER_STEP:
                backward_ran = False
            key = (a.stage, a.microbatch)
            if a.op is Op.FORWARD:
                live[key] = per_microbatch[a.stage]
                total += per_microbatch[a.stage]
            elif a.op is Op.BACKWARD and split:
                live[key] += extra[a.stage]
                total += extra[a.stage]
                waiting.add(key)
            elif a.op is release:
                total -= live.pop(key)
                waiting.discard(key)
            elif a.op is Op.OPTIMIZER_STEP:
                at_update, count_at_update = max(at_update, total), max(count_at_update, len(live))
                have_gradients = False  # the update sets them to None
            if a.op is not release:
                kind = "with" if have_gradients else "before"
                moments[kind] = _most(moments[kind], (len(live), len(waiting)))
            peak, count, most_pending = max(peak, total), max(count, len(live)), max(most_pending, len(waiting))
        out.append(Held(peak, count, at_update, count_at_update, most_pending, forward_after_backward,
                        moments["with"], moments["before"], moments["first"]))
    return out


def _most(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return max(a[0], b[0]), max(a[1], b[1])


def held_bytes(schedule: Schedule, per_microbatch: Sequence[float]) -> list[tuple[float, int]]:
    """Per rank, the most bytes of activations it holds at once and how many micro-batches that is
    (:func:`walk_held` without the gradients a split backward keeps)."""
    return [(h.peak, h.count) for h in walk_held(schedule, per_microbatch)]


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
    # What its backward and its optimizer step need on top (per whole batch where it scales with the batch):
    grad_working: float = 0.0  # the most activation gradients one of its layers' backwards holds at once
    grad_temps: float = 0.0  # the most parameter gradients a layer computes before they are added into .grad
    pending: float = 0.0  # what a split backward keeps from its input half for its weight half (output gradient too)
    largest_parameter: float = 0.0  # its largest parameter tensor (the optimizer's temporaries are that big)
    # each layer's parameter bytes (sharded, each is a unit FSDP2 gathers); a detail of ``parameters``, not compared
    layer_parameters: tuple[float, ...] = field(default=(), compare=False)
    # each layer's saved bytes and backward working set (per whole batch): details of ``layers`` and ``grad_working``
    # for the first backward of a step, which frees a layer's activations as it makes its gradients
    layer_saved: tuple[float, ...] = field(default=(), compare=False)
    layer_grad_working: tuple[float, ...] = field(default=(), compare=False)
    # each layer's ``pending`` (per whole batch, without the stage output's gradient): for a step's first weight half
    layer_pending: tuple[float, ...] = field(default=(), compare=False)


def layer_work(profile: Profile, device: str = "cpu") -> tuple[list[float], list[float], list[float], list[float]]:
    """Per layer: the activation gradients its backward holds at once, its parameter-gradient temporaries, what a split
    backward keeps for the weight half, and its largest parameter tensor. Measured by ``profile_module``; for a
    profile without them (PipeDream's graph.txt, a traced graph's), estimated: the gradients of its output and of its
    input, all its parameters, its output's gradient when it has parameters, all its parameters as one tensor.
    ``device="cuda"``: each as the caching allocator counts it (:func:`cuda_block_bytes`, the layer's figure as one
    block: the profile does not list its tensors)."""
    cuts = [float(profile.extra.get("input_bytes", 0) or 0)] + [float(c) for c in profile.cut_bytes()]
    working, temps, pending, largest = [], [], [], []
    for index, layer in enumerate(profile.layers):
        params = float(layer.parameter_bytes)
        working.append(float(layer.grad_working_bytes) if layer.grad_working_bytes is not None
                       else float(layer.activation_bytes) + cuts[index])
        temps.append(float(layer.grad_temp_bytes) if layer.grad_temp_bytes is not None else params)
        pending.append(float(layer.pending_bytes) if layer.pending_bytes is not None
                       else float(layer.activation_bytes) if params else 0.0)
        largest.append(float(layer.largest_parameter_bytes) if layer.largest_parameter_bytes is not None else params)
    if _check_device(device) == "cuda":
        return tuple(_blocks(values) for values in (working, temps, pending, largest))  # type: ignore[return-value]
    return working, temps, pending, largest


def _blocks(values: Sequence[float]) -> list[float]:
    return [float(cuda_block_bytes(v)) for v in values]


def layer_keeps(profile: Profile, device: str = "cpu") -> tuple[list[float], list[float]]:
    """Per layer, the bytes its forward keeps for the backward (the profiler's ``saved_bytes``; unmeasured: its
    output), and what a stage ending at the layer keeps on top: its output, which the stage holds to start the
    backward from, when no layer saves it (0 on the last layer, whose output only the loss reads).
    ``device="cuda"``: as the caching allocator counts them (:func:`cuda_block_bytes`, each layer's as one block)."""
    cuts = profile.cut_bytes() + [0]
    saved = [float(layer.activation_bytes if layer.saved_bytes is None else layer.saved_bytes)
             for layer in profile.layers]
    ending = [0.0 if layer.output_saved in (None, True) else float(cut) for layer, cut in zip(profile.layers, cuts)]
    if _check_device(device) == "cuda":
        return _blocks(saved), _blocks(ending)
    return saved, ending


def layer_parameters(profile: Profile, device: str = "cpu") -> list[float]:
    """Per layer, its parameter bytes (``device="cuda"``: as one allocator block, :func:`cuda_block_bytes`)."""
    params = [float(layer.parameter_bytes) for layer in profile.layers]
    return _blocks(params) if _check_device(device) == "cuda" else params


def cut_bytes(profile: Profile, input_bytes: float, device: str = "cpu") -> list[float]:
    """What each stage boundary carries: the batch stage 0 receives, then each layer's output (``device="cuda"``:
    rounded as the allocator rounds one tensor)."""
    cuts = [float(input_bytes)] + [float(c) for c in profile.cut_bytes()]
    return _blocks(cuts) if _check_device(device) == "cuda" else cuts


def stage_bytes(
    profile: Profile, balance: Sequence[int], input_bytes: float | None = None, device: str = "cpu"
) -> list[StageBytes]:
    """The bytes of each stage of ``balance`` (layers per stage) under ``profile``.

    ``input_bytes``: the batch stage 0 receives (default: the profile's ``extra["input_bytes"]``, else 0).
    ``device="cuda"``: every figure as CUDA's caching allocator counts it (:func:`cuda_block_bytes`, per layer).
    """
    if input_bytes is None:
        input_bytes = float(profile.extra.get("input_bytes", 0) or 0)
    cuts = cut_bytes(profile, input_bytes, device) + [0.0]  # cuts[k]: what layer k receives
    params = layer_parameters(profile, device)
    saved, ending = layer_keeps(profile, device)
    working, temps, pending, largest = layer_work(profile, device)
    out, first = [], 0
    for count in balance:
        last = first + count - 1
        span = slice(first, last + 1)
        out.append(
            StageBytes(
                parameters=float(sum(params[span])),
                input=cuts[first],
                layers=float(np.sum(saved[span])) + ending[last],
                output=cuts[last + 1],
                grad_working=max(working[span]),
                grad_temps=max(temps[span]),
                pending=float(np.sum(pending[span])) + cuts[last + 1],
                largest_parameter=max(largest[span]),
                layer_parameters=tuple(params[span]),
                layer_saved=tuple(saved[span]),
                layer_grad_working=tuple(working[span]),
                layer_pending=tuple(pending[span]),
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
        return build_schedule(schedule, stages, chunks, virtual_stages=v_virtual_stages(schedule, virtual_stages))
    return build_schedule(schedule, stages, chunks, replicas=reps)


def gradients_from_first_backward(schedule: str, virtual_stages: int = 1, shard: str | None = None,
                                   unequal_replicas: bool = False, gradients_carried: bool = False) -> bool:
    """Whether the model counts a worker's gradients only from its step's first backward on: a flushed schedule with
    one weight version and one stage per worker, unsharded, straight or with equal replicas, whose steps start without
    gradients (the update before set them to None; ``gradients_carried``: ``accumulate_grad_batches`` > 1 keeps them
    across steps). Elsewhere they are counted at every moment, an upper bound."""
    spec = spec_of(schedule)
    return (not spec.asynchronous and spec.weight_versions == 1 and not spec.virtual_stages and virtual_stages == 1
            and shard is None and not unequal_replicas and not gradients_carried)


def first_backward_bytes(size: StageBytes, chunks: int) -> float:
    """The most one micro-batch's backward holds while it makes the stage's gradients for the first time in a step:
    going back from the stage's last layer, at layer k the activations of layers up to k (and the stage's input and
    the output it started from), the gradients of layers k on (each becomes ``.grad`` as it is made, no temporary),
    layer k's activation gradients; and to the end, the stage's output and its gradient (the backward starts from
    both and holds them until it returns; at the last layer the gradient is in its working set). Without per-layer
    figures: the whole micro-batch, all gradients and the stage's working set."""
    if not size.layer_saved:
        return (size.input + size.layers + size.output) / chunks + size.parameters + size.grad_working / chunks
    *earlier, last = size.layer_saved
    kept = size.input + size.layers - sum(earlier)  # the input, and the output (the last layer's, or ``ending``)
    after = float(sum(size.layer_parameters))
    most = 0.0
    for k, (params, working) in enumerate(zip(size.layer_parameters, size.layer_grad_working)):
        if k < len(earlier):
            kept += earlier[k]
        arriving = size.output if k < len(earlier) else 0.0
        most = max(most, (kept + arriving) / chunks + after + working / chunks)
        after -= params
    return most


def weight_half_bytes(size: StageBytes, chunks: int) -> float:
    """The most one micro-batch's split weight half adds to what it starts with when it makes the stage's gradients
    for the first time in a step (a stage other than the first): the gradients made so far, less the kept gradients it
    has released. It goes back layer by layer (``WeightBranches``: the latest branch point first, a layer's together)
    and drops the gradients kept at a layer's branch points once it has made that layer's weight gradients, so at
    layer k it holds at most the gradients of the layers done, less their kept gradients where those weigh less, and
    all of layer k's: ``sum((params_l - pending_l)+ for l done) + params_k``, at most
    ``sum((params_l - pending_l)+) + max(min(params_l, pending_l))`` over the stage's layers, whatever their order
    (``pending_l`` per micro-batch). The micro-batch's activations and the stage output's gradient stay to its end.
    Without per-layer figures: all the stage's parameters (nothing released)."""
    if not size.layer_pending:
        return size.parameters
    # in whole-batch bytes (integers) and divided once: the planner's range tables find the same figure
    scaled = [(chunks * p, q) for p, q in zip(size.layer_parameters, size.layer_pending)]
    return (sum(max(0.0, p - q) for p, q in scaled) + max(min(p, q) for p, q in scaled)) / chunks


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
    device: str = "cpu",
    cuda_capability: tuple[int, int] = (9, 0),
    shard: str | None = None,
    gradients_carried: bool = False,
) -> list[StageMemory]:
    """Each worker's predicted peak memory under ``schedule`` (one entry per stage; interleaved: per rank).

    ``sizes`` are the stages' bytes per whole batch (interleaved: the ``ranks x virtual_stages`` model chunks, chunk
    c of rank r being stage ``c * ranks + r``; zb-v and dualpipev: ``2 x ranks`` chunks, rank r holding r and
    ``2 ranks - 1 - r``); each micro-batch carries ``1 / chunks`` of the activations.
    ``recompute[s]`` keeps only stage s's input and output per micro-batch and rebuilds the rest in its backward.
    Stashed versions: pipedream keeps one per minibatch in flight on the worker (``stages - s`` in a straight
    pipeline, ``ceil(workers from s on / replicas of s)`` under replicas), 2bw two, the rest one.
    ``flight``: the schedule to count in-flight micro-batches on (default: :func:`flight_schedule`).
    ``device="cuda"`` (``sizes`` from :func:`stage_bytes` with the same device): the optimizer's foreach temporaries
    for all the worker's parameters at once (:data:`FOREACH_TEMPORARIES`) instead of the CPU's per-tensor ones, and
    the cuBLAS workspaces of a GPU of ``cuda_capability`` (:func:`cublas_workspace_bytes`; default 9.0, Hopper).

    Replicated stages (``replicas`` > 1) hold the all-reduce's flat copy of their gradients before the update.
    ``shard="grad_op"`` or ``"full"`` (equal replicas of a flushed schedule): each replica holds ``1 / replicas`` of
    the parameters, gradients and optimizer state, and within a step the gradients whole and the gathered working
    copy of the weights (``plan.shards``: :func:`gathered_bytes`, :func:`whole_gradient_bytes`; a rank with several
    model chunks, each its own FSDP2 root: both at once at their worst over its actions, :func:`chunks_unsharded`).

    Gradients: a step starts without them and its first backward makes them layer by layer while it frees that
    micro-batch's activations (:func:`first_backward_bytes`); where :func:`gradients_from_first_backward` holds
    (``gradients_carried``: ``accumulate_grad_batches`` > 1) they are counted from there on
    (``activations_with_gradients``, ``before_gradients``), elsewhere at every moment. The first stage's split
    backward computes nothing in its input half (no input needs a gradient): it keeps its output's gradient, and its
    weight half is a whole backward.
    """
    spec = spec_of(schedule)
    cuda = _check_device(device) == "cuda"
    ratio = optimizer_state_ratio(optimizer)
    v = v_virtual_stages(schedule, virtual_stages) if spec.virtual_stages else 1  # a V: always its two
    total = len(sizes)
    if total % v:
        raise ValueError(f"{total} stages do not divide into {v} virtual stages per rank; give ranks x {v} stages.")
    ranks = total // v
    flags = _per_stage_flags("recompute", recompute, total)
    if replicas is None:
        replicas = [1] * ranks
    if len(replicas) != ranks:
        raise ValueError(f"replicas lists {len(replicas)} counts for {ranks} stages; give one per stage.")
    _check_shard(shard, schedule, replicas)
    if flight is None:
        flight = flight_schedule(schedule, ranks, chunks, replicas, v)
    kept = [
        (s.input + s.output) if rc else (s.input + s.layers) for s, rc in zip(sizes, flags)
    ]
    per_mb = [k / chunks for k in kept]
    # with recompute the weight half replays the stage from its input (nothing is kept at branch points)
    # (the first stage's input half computes nothing: only the gradient of its output waits)
    pending = [(s.output if rc or index == 0 else s.pending) / chunks
               for index, (s, rc) in enumerate(zip(sizes, flags))]
    held = walk_held(flight, per_mb, pending)
    from_first = gradients_from_first_backward(schedule, v, shard, flight.replicas is not None, gradients_carried)
    if flight.replicas is not None:  # unequal replicas: the busiest replica of each stage
        layout = flight.layout
        assert layout is not None
        by_stage = [max((held[r] for r in layout.ranks_of(s)), key=lambda h: (h.count, h.peak)) for s in range(ranks)]
    else:
        by_stage = held
    temporaries = OPTIMIZER_TEMPORARIES[optimizer]
    workspace = cublas_workspace_bytes(cuda_capability) if cuda else 0
    out = []
    for rank in range(ranks):
        mine = rank_stages(schedule, ranks, rank, v)  # interleaved: r, r + ranks, ...; a V: r and 2 ranks - 1 - r
        params = sum(sizes[s].parameters for s in mine)
        h = by_stage[rank]
        act_bytes, count, at_update = h.peak, h.count, h.at_update
        if v == 1:  # one stage per worker: its micro-batches all weigh the same (the planner's tables multiply too)
            act_bytes = count * per_mb[rank] + h.most_pending * pending[rank]
            at_update = h.count_at_update * per_mb[rank]
        if spec.weight_versions is None:  # weight stashing: one version per minibatch in flight
            versions = max(1, count)
        else:
            versions = spec.weight_versions
        replay = max(
            ((sizes[s].layers - sizes[s].output) / chunks if flags[s] else 0.0 for s in mine), default=0.0
        )
        working = max(backward_working(sizes[s].grad_working, sizes[s].grad_temps, chunks) for s in mine)
        d = int(replicas[rank])
        part = d if shard is not None else 1  # this rank's share of the weights, gradients and optimizer state
        units = [p for s in mine for p in sizes[s].layer_parameters] or [params]
        whole, gathered = 0.0, 0.0
        if shard is not None and len(mine) > 1:  # interleaved: each chunk gathers and reduce-scatters on its own
            chunk_units = {s: sizes[s].layer_parameters or (sizes[s].parameters,) for s in mine}
            whole, gathered = chunks_unsharded(flight.actions[rank], chunk_units, shard, {s: flags[s] for s in mine},
                                               chunks)
        elif shard is not None:
            whole = whole_gradient_bytes(units, params, chunks, spec.splits_backward)
            gathered = gathered_bytes(shard, units, params, h.forward_after_backward, recompute=flags[rank],
                                      splits_backward=spec.splits_backward)
        with_gradients = before = None
        if from_first and not flags[rank]:
            with_gradients, before = _gradients_from_first(h, per_mb[rank], pending[rank], working,
                                                           first_backward_bytes(sizes[rank], chunks),
                                                           sweeps=rank == 0 or not spec.splits_backward,
                                                           weight_half=weight_half_bytes(sizes[rank], chunks)
                                                           - sizes[rank].parameters)
        out.append(
            StageMemory(
                stage=rank,
                chunks=tuple(mine),
                replicas=d,
                parameters=round(params / part),
                gradients=round(params / part),
                optimizer_state=round(ratio * params / part),
                stashed_weights=round((versions - 1) * params),
                weight_versions=versions,
                activations=round(act_bytes),
                held=count,
                recompute=any(flags[s] for s in mine),
                replay=round(max(0.0, replay)),
                backward_working=round(working),
                activations_at_update=round(at_update),
                update_working=round((FOREACH_TEMPORARIES[optimizer] * params if cuda
                                      else temporaries * max(sizes[s].largest_parameter for s in mine)) / part),
                workspace=workspace,
                shard=shard,
                whole_gradients=round(whole),
                gathered=round(gathered),
                sync_working=round(params) if shard is None and d > 1 else 0,
                activations_with_gradients=with_gradients,
                before_gradients=before,
            )
        )
    return out


def _gradients_from_first(held: Held, per_mb: float, pending: float, working: float, sweep: float,
                          sweeps: bool, weight_half: float = 0.0) -> tuple[int, int]:
    """``activations_with_gradients`` and ``before_gradients`` of one stage (see :func:`predict_memory`). ``sweeps``:
    its first backward frees activations as it makes gradients (a whole backward, or the first stage's weight half;
    another stage's weight half keeps the micro-batch's graph to its end: it counts with the gradients, less
    ``weight_half``, what :func:`weight_half_bytes` finds below all the gradients, which it makes as it releases the
    gradients it kept)."""
    with_count, with_pending = held.with_gradients
    before_count, before_pending = held.before_gradients
    first_count, first_pending = held.first
    with_gradients = with_count * per_mb + with_pending * pending
    before = round(before_count * per_mb + before_pending * pending) + round(working)
    if first_count and sweeps:
        before = max(before, round((first_count - 1) * per_mb + first_pending * pending + sweep))
    elif first_count:
        with_gradients = max(with_gradients, first_count * per_mb + first_pending * pending + weight_half)
    return round(with_gradients), before


def _check_shard(shard: str | None, schedule: str, replicas: Sequence[int]) -> None:
    if shard not in SHARD_MODES:
        raise ValueError(f"shard={shard!r}: the memory model knows None (whole copies), 'grad_op' and 'full'.")
    if shard is not None and not can_shard(schedule, replicas):
        raise ValueError(f"shard={shard!r} with schedule={schedule!r} and replicas {list(replicas)}: sharding runs "
                         "equal replicas (at least 2) of a flushed schedule (gpipe, 1f1b, interleaved, zb-h1). Give "
                         "replicas=[d] * stages with one of those schedules, or shard=None.")
