"""Sharded stage replicas in the plan: what FSDP2 holds per rank, and what its collectives cost per step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from lightning_pipedream.schedule.actions import Action, Op
from lightning_pipedream.schedule.specs import spec_of

SHARD_MODES = (None, "grad_op", "full")  # what the runtime runs (runtime/stages/sharding.py)
SHARD_CHOICES = ("none", "grad_op", "full", "auto")  # what the planner takes: "auto" weighs replicate against shard


def check_shard_choice(shard: str | None) -> str | None:
    """``shard`` as the planner takes it (``"none"`` is None); an unknown word is refused with the choices."""
    if shard == "none":
        return None
    if shard not in SHARD_MODES and shard != "auto":
        raise ValueError(f"shard={shard!r} is not a choice: use None or 'none' (replicas keep whole copies), "
                         "'grad_op' (gradients and optimizer state sharded), 'full' (parameters too) or 'auto' (the "
                         "planner weighs replicating against sharding under the memory limit).")
    return shard


def shard_modes(shard: str | None) -> tuple[str | None, ...]:
    """The sharding modes the planner tries for ``shard`` (None, a mode, or "auto": all three)."""
    shard = check_shard_choice(shard)
    return SHARD_MODES if shard == "auto" else (shard,)


def can_shard(schedule: str, replicas: Sequence[int]) -> bool:
    """Whether the runtime shards this configuration: equal replicas (at least 2) of a flushed schedule (gpipe, 1f1b,
    zb-h1, interleaved with any number of model chunks, each its own FSDP2 root), what ``check_shard`` and the
    strategy accept."""
    equal = len(set(replicas)) == 1 and replicas[0] >= 2
    spec = spec_of(schedule)
    return equal and not spec.asynchronous and not spec.v_shape  # the V schedules' chunks are not sharded yet


def gathered_bytes(shard: str | None, layer_parameters: Sequence[float], parameters: float,
                   forward_after_backward: bool = True, *, recompute: bool = False,
                   splits_backward: bool = False) -> float:
    """The gathered working copy of a sharded stage's weights at its peak (beside its whole gradients), on top of its
    shards.

    FSDP2 gathers a unit (each layer with parameters) into a flat buffer and copies it out into the unit's
    parameters; the flat buffer lives until the next unit's gather has begun. Every backward frees each unit's
    weights as it ends, and gathers the next unit ahead (its default prefetch): the two largest units. ``"full"``
    frees them after each forward too. The whole stage is gathered beside the whole gradients, and one unit's flat
    buffer on top (:func:`keeps_stage_gathered`), when

    - ``"grad_op"`` keeps every unit's weights from a forward to the backward that frees them and a forward runs
      after a backward within the step (``forward_after_backward``: 1f1b's steady state); otherwise (gpipe: every
      forward before the first backward) its backwards gather unit by unit, as ``"full"`` does;
    - the stage recomputes (``recompute``): the replay inside the backward gathers every unit, and FSDP2 frees none
      after a forward that runs in a backward, so each stays until its own backward ends (either mode);
    - the backward is split (``splits_backward``, zb-h1): the runtime keeps the stage gathered from the step's first
      forward to its last weight half (either mode).

    Measured: ``benchmarks/memory/sharding.py``.
    """
    if shard is None:
        return 0.0
    units = sorted((float(p) for p in layer_parameters if p), reverse=True)
    if keeps_stage_gathered(shard, forward_after_backward, recompute=recompute, splits_backward=splits_backward):
        return float(parameters) + (units[0] if units else 0.0)
    return float(sum(units[:2]))


def keeps_stage_gathered(shard: str | None, forward_after_backward: bool, *, recompute: bool = False,
                         splits_backward: bool = False) -> bool:
    """Whether a sharded stage's backward finds the whole stage gathered (see :func:`gathered_bytes`)."""
    if shard is None:
        return False
    return splits_backward or recompute or (shard == "grad_op" and forward_after_backward)


def whole_gradient_bytes(layer_parameters: Sequence[float], parameters: float, chunks: int,
                         splits_backward: bool = False) -> float:
    """The gradients a sharded stage holds whole within a step: with several micro-batches FSDP2 adds each backward's
    gradients into whole ones and reduce-scatters their sum in the step's last backward, so all of them; with one,
    each unit's is reduce-scattered as its backward ends, so the largest unit's. A split backward (zb-h1) adds every
    weight half into whole gradients and reduce-scatters once after the last: all of them, with any count."""
    if chunks > 1 or splits_backward:
        return float(parameters)
    return max((float(p) for p in layer_parameters), default=0.0)


def chunks_unsharded(actions: Sequence[Action], chunk_units: Mapping[int, Sequence[float]], shard: str,
                     recompute: Mapping[int, bool], chunks: int) -> tuple[float, float]:
    """Whole gradients and gathered weights at once, at their worst, on a rank holding several sharded model chunks
    (interleaved: each its own FSDP2 root), walking its ``actions`` (``chunk_units[stage]``: that chunk's units).

    In a backward of chunk c: c's whole gradients and its gathered copy (:func:`gathered_bytes`, found gathered when
    a forward of c ran since its last backward under ``"grad_op"``, or c recomputes; in the first backward of the
    step a gathered chunk's gradients replace its freed units, so only the gathered copy counts); beside them every
    other chunk whose backwards have begun and not ended holds its whole gradients (each reduce-scatters in its own
    last backward of the step), and every other ``"grad_op"`` chunk with a forward since its last backward its
    weights.
    """
    params = {stage: float(sum(units)) for stage, units in chunk_units.items()}
    left = {stage: sum(1 for a in actions if a.op is Op.BACKWARD and a.stage == stage) for stage in chunk_units}
    kept = dict.fromkeys(chunk_units, False)  # the whole chunk gathered, since a forward (grad_op)
    whole = dict.fromkeys(chunk_units, False)  # whole gradients, from the chunk's first backward to its last
    best = (0.0, 0.0)
    for a in actions:
        if a.op is Op.FORWARD:
            kept[a.stage] = shard == "grad_op"
        elif a.op is Op.BACKWARD:
            c = a.stage
            others = [s for s in chunk_units if s != c]
            # a gathered chunk's first backward of the step frees each unit as that unit's gradients come: the two
            # never add up (its gradients' temporaries are the backward's working set)
            first_kept = (kept[c] or recompute[c]) and not whole[c]
            own = 0.0 if first_kept else whole_gradient_bytes(chunk_units[c], params[c], chunks)
            grads = own + sum(params[s] for s in others if whole[s])
            gathered = (gathered_bytes(shard, chunk_units[c], params[c], kept[c], recompute=recompute[c])
                        + sum(params[s] for s in others if kept[s]))
            best = max(best, (grads, gathered), key=sum)
            left[c] -= 1
            kept[c], whole[c] = False, left[c] > 0 and chunks > 1
        elif a.op is Op.OPTIMIZER_STEP:  # a new step: every chunk's gradients reduce-scattered, weights freed
            kept, whole = dict.fromkeys(chunk_units, False), dict.fromkeys(chunk_units, False)
    return best


def gathers_per_step(shard: str | None, chunks: int, splits_backward: bool = False) -> int:
    """All-gathers of a sharded stage's weights per step: ``chunks`` times :func:`gathers_per_microbatch`, except
    under a split backward (zb-h1), whose stage stays gathered from the step's first forward to its end: one."""
    if shard is None:
        return 0
    return 1 if splits_backward else chunks * gathers_per_microbatch(shard)


def top_two_sum(values: Sequence[float]) -> np.ndarray:
    """``[i, j]``: the sum of the two largest of ``values[i..j]`` (0 where j < i): the gathered units of a "full"
    stage over layers i..j, as a table for the planner."""
    n = len(values)
    table = np.zeros((n, n))
    for i in range(n):
        first = second = 0.0
        for j in range(i, n):
            v = float(values[j])
            if v > first:
                first, second = v, first
            elif v > second:
                second = v
            table[i, j] = first + second
    return table


def ring_allreduce_seconds(nbytes: np.ndarray | float, replicas: int, bandwidth: float) -> np.ndarray | float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``replicas`` workers (the simulator's formula): a
    reduce-scatter and an all-gather."""
    if replicas <= 1:
        return nbytes * 0.0
    return 2.0 * (replicas - 1) / replicas * nbytes / bandwidth


def ring_half_seconds(nbytes: np.ndarray | float, replicas: int, bandwidth: float) -> np.ndarray | float:
    """Seconds of a ring all-gather (or reduce-scatter) of ``nbytes`` whole over ``replicas`` workers: each sends
    and receives ``(replicas - 1) / replicas`` of them, half an all-reduce."""
    return ring_allreduce_seconds(nbytes, replicas, bandwidth) / 2.0


def gathers_per_microbatch(shard: str | None, splits_backward: bool = False) -> int:
    """All-gathers of the stage's weights per micro-batch: ``"full"`` one for the forward and one for the backward
    (with recompute as well: the backward's replay gathers, and the backward finds the units gathered);
    ``"grad_op"`` one (the backward uses what the forward gathered); replicas none; a split backward none (one per
    step, :func:`gathers_per_step`)."""
    return 0 if splits_backward else {None: 0, "grad_op": 1, "full": 2}[shard]


def shard_label(shard: str | None, replicas: int) -> str:
    """``", sharded (full) over 2 replicas"`` for a label; empty when replicated."""
    return "" if shard is None else f", sharded ({shard}) over {replicas} replicas"
