"""What the two paths that predict the stages' peak memory share: the terms of the run the memory model must know
(the optimizer's kind, the replicas), the call of the model itself, and the log line saying why where it cannot say.

``sequential_memory.py`` predicts a module whose layers are one nn.Sequential from the profile of its layers;
``graph_path.predicted_memory`` a traced module from the FLOP estimate's shapes. Both raise :class:`Unpredictable`
for a term the model cannot know, and :func:`prediction_or_none` turns it into None and the log line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_pipedream.strategy.setup.options import PipelineOptions
from lightning_pipedream.strategy.setup.placement import Placement

log = logging.getLogger("lightning_pipedream.strategy")


class Unpredictable(Exception):
    """A term the memory model cannot know for this run: why, in words."""


def prediction_or_none(predict: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]] | None:
    """``predict()``; None where it raises :class:`Unpredictable`, with a log line saying why."""
    try:
        return predict()
    except Unpredictable as unknown:
        log.info("PipeDreamStrategy: no memory prediction for the stages (%s); pipeline/stage{k}/predicted_memory_mb "
                 "is not logged.", unknown)
        return None


def optimizer_and_replicas(placement: Placement, optimizers: Sequence[Any],
                           without_optimizer: str | None = None) -> tuple[str, list[int] | None]:
    """The memory model's kind of the run's one optimizer (the state it counts) and each stage's replicas (None:
    one pipeline). :class:`Unpredictable` for other than one optimizer (``without_optimizer``: the kind to count
    when there is none), an optimizer of unknown state, or unequal replicas (1F1B-RR: a replica's share of the batch
    is not modelled)."""
    from lightning_pipedream.plan.memory import optimizer_kind

    if not optimizers and without_optimizer is not None:
        kind = without_optimizer
    elif len(optimizers) != 1:
        raise Unpredictable(f"{len(optimizers)} optimizers; the model counts the state of one")
    else:
        try:
            kind = optimizer_kind(optimizers[0])
        except ValueError as unknown_optimizer:
            raise Unpredictable(str(unknown_optimizer)) from None
    if placement.layout is not None:
        raise Unpredictable(f"unequal replicas {list(placement.layout.replicas)}")
    replicas = [placement.num_pipelines] * placement.num_stages if placement.num_pipelines > 1 else None
    return kind, replicas


def predicted_stages(stage_sizes: Sequence[Any], options: PipelineOptions, chunks: int, optimizer: str,
                     replicas: list[int] | None, device: torch.device, gradients_carried: bool) -> list[dict[str, Any]]:
    """Each rank's predicted peak memory (``StageMemory.to_json`` with ``"optimizer"``) for the stages' bytes
    ``stage_sizes`` (``plan.memory.stage_bytes``) under the run's schedule, recompute and shard;
    :class:`Unpredictable` where the model refuses the layout (e.g. a shard it does not count). On a CUDA device the
    model counts that device's cuBLAS workspace (by its compute capability)."""
    from lightning_pipedream.plan.memory import predict_memory

    gpu = {"cuda_capability": tuple(torch.cuda.get_device_capability(device))} if device.type == "cuda" else {}
    try:
        memory = predict_memory(stage_sizes, options.schedule, chunks, replicas=replicas,
                                virtual_stages=options.virtual_stages, recompute=options.recompute,
                                optimizer=optimizer, device=device.type, shard=options.shard,
                                gradients_carried=gradients_carried, **gpu)
    except ValueError as refused:
        raise Unpredictable(str(refused)) from None
    return [m.to_json() | {"optimizer": optimizer} for m in memory]
