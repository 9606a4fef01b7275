"""The memory model's prediction for a module whose layers are one nn.Sequential: each stage's predicted peak, from
the profile the strategy made of the layers (kept in ``plan.extra["profile"]``), the split, the schedule, the
micro-batches and the optimizer, for ``pipeline/stage{k}/predicted_memory_mb`` beside the measured peak.

The graph path predicts its stages when it splits them (``graph_path.predicted_memory``); ``schedule="auto"`` keeps
the planner's prediction in ``plan.extra["memory"]``. Here the same model (``plan/memory.py``: weights, gradients,
optimizer state, stashed weight versions, activations in flight per schedule) runs on the Sequential's profile, whole
first training batch as the strategy profiled it. Where a term cannot be known (no profile of the layers, an optimizer
of unknown state, unequal replicas, minibatches_per_batch), there is no prediction and a log line says why.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from lightning_pipedream.strategy.setup.memory_prediction import (
    Unpredictable,
    optimizer_and_replicas,
    predicted_stages,
    prediction_or_none,
)
from lightning_pipedream.strategy.setup.options import PipelineOptions
from lightning_pipedream.strategy.setup.placement import Placement

log = logging.getLogger("lightning_pipedream.strategy")


def sequential_predicted_memory(options: PipelineOptions, placement: Placement, plan: Any,
                                balance: Sequence[int] | None, optimizers: Sequence[Any], device: torch.device,
                                gradients_carried: bool = False) -> list[dict[str, Any]] | None:
    """Each rank's predicted peak memory (``StageMemory.to_json`` with ``"optimizer"``, one per stage: its replicas
    hold alike), as ``graph_path.predicted_memory`` gives it; the auto planner's own where it chose the plan
    (``plan.extra["memory"]``). None, and a log line saying why, where the model cannot say."""
    if plan is not None and isinstance(plan.extra.get("memory"), list):  # schedule="auto": the planner's prediction
        return list(plan.extra["memory"])
    return prediction_or_none(
        lambda: _predicted(options, placement, plan, balance, optimizers, device, gradients_carried))


def _predicted(options: PipelineOptions, placement: Placement, plan: Any, balance: Sequence[int] | None,
               optimizers: Sequence[Any], device: torch.device, gradients_carried: bool) -> list[dict[str, Any]]:
    from lightning_pipedream.plan.memory import stage_bytes
    from lightning_pipedream.plan.profile import Profile

    profile_json = plan.extra.get("profile") if plan is not None else None
    if not isinstance(profile_json, dict):
        raise Unpredictable("no profile of the layers, so no activation sizes: the split came from balance=, a plan "
                            "without a profile, or the weights' sizes; let the strategy profile the layers (no "
                            "balance=)")
    profile = Profile.from_json(profile_json)
    if balance is None:
        balance = plan.balance
    if sum(balance) != len(profile.layers):
        raise Unpredictable(f"the split {list(balance)} covers {sum(balance)} layers and the profile "
                            f"{len(profile.layers)}")
    # 1F1B-RR's unequal replicas are refused: a replica's share of the profiled batch is not modelled here
    kind, replicas = optimizer_and_replicas(placement, optimizers)
    if options.minibatches_per_batch > 1:  # each PipeDream minibatch is a part of the profiled batch
        raise Unpredictable(f"minibatches_per_batch={options.minibatches_per_batch}: the profile is of a whole batch")
    memory = predicted_stages(stage_bytes(profile, balance, device=device.type), options, options.chunks, kind,
                              replicas, device, gradients_carried)
    from lightning_pipedream.plan.choice import bytes_text

    log.info("PipeDreamStrategy: predicted peak memory per stage (the memory model on the layers' profile, schedule "
             "%s, chunks %d, optimizer %s): %s", options.schedule, options.chunks, kind,
             ", ".join(f"stage {m['stage']} {bytes_text(m['predicted_peak_bytes'])} (weights "
                       f"{bytes_text(m['parameters'])}, optimizer {bytes_text(m['optimizer_state'])}, stashed "
                       f"{bytes_text(m['stashed_weights'])}, activations {bytes_text(m['activations'])} for "
                       f"{m['held']} in flight)" for m in memory))
    return memory
