"""Sharded stage replicas in the plan: what FSDP2 holds per rank, and what its collectives cost per step."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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


def can_shard(schedule: str, replicas: Sequence[int], virtual_stages: int = 1) -> bool:
    """Whether the runtime shards this configuration: equal replicas (at least 2) of a flushed schedule whose backward
    is whole (gpipe, 1f1b), one model chunk per rank (what ``check_shard`` and the strategy accept)."""
    spec = spec_of(schedule)
    equal = len(set(replicas)) == 1 and replicas[0] >= 2
    return equal and not spec.asynchronous and not spec.splits_backward and virtual_stages == 1


def gathered_bytes(shard: str | None, layer_parameters: Sequence[float], parameters: float,
                   forward_after_backward: bool = True) -> float:
    """The gathered working copy of a sharded stage's weights at its peak (beside its whole gradients), on top of its
    shards.

    FSDP2 gathers a unit (each layer with parameters) into a flat buffer and copies it out into the unit's
    parameters; the flat buffer lives until the next unit's gather has begun. Every backward frees each unit's
    weights as it ends, and gathers the next unit ahead (its default prefetch): the two largest units. ``"full"``
    frees them after each forward too. ``"grad_op"`` keeps every unit's weights from a forward to the backward that
    frees them: when a forward runs after a backward within the step (``forward_after_backward``: 1f1b's steady
    state), the whole stage is gathered beside the whole gradients, and one unit's flat buffer on top; otherwise
    (gpipe: every forward before the first backward) its backwards gather unit by unit, as ``"full"`` does.
    Measured: ``benchmarks/sharding.py``.
    """
    if shard is None:
        return 0.0
    units = sorted((float(p) for p in layer_parameters if p), reverse=True)
    if shard == "full" or not forward_after_backward:
        return float(sum(units[:2]))
    return float(parameters) + (units[0] if units else 0.0)


def whole_gradient_bytes(layer_parameters: Sequence[float], parameters: float, chunks: int) -> float:
    """The gradients a sharded stage holds whole within a step: with several micro-batches FSDP2 adds each backward's
    gradients into whole ones and reduce-scatters their sum in the step's last backward, so all of them; with one,
    each unit's is reduce-scattered as its backward ends, so the largest unit's."""
    if chunks > 1:
        return float(parameters)
    return max((float(p) for p in layer_parameters), default=0.0)


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


def gathers_per_microbatch(shard: str | None) -> int:
    """All-gathers of the stage's weights per micro-batch: ``"full"`` one for the forward and one for the backward;
    ``"grad_op"`` one (the backward uses what the forward gathered); replicas none."""
    return {None: 0, "grad_op": 1, "full": 2}[shard]


def shard_label(shard: str | None, replicas: int) -> str:
    """``", sharded (full) over 2 replicas"`` for a label; empty when replicated."""
    return "" if shard is None else f", sharded ({shard}) over {replicas} replicas"
