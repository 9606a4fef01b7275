"""Balances: how many consecutive layers each pipeline stage takes, checked, and a stage's slice of the model."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn


def check_stage_count(num_layers: int, num_stages: int) -> None:
    """Every stage needs at least one layer."""
    if num_stages > num_layers:
        raise ValueError(
            f"The model has {num_layers} layers but {num_stages} stages were asked for; every stage needs at "
            f"least one layer. Use at most {num_layers} processes, or split the model into more layers."
        )


def check_chunk_count(num_layers: int, processes: int, chunks_per_process: int, schedule: str) -> None:
    """Every model chunk needs at least one layer (interleaved, zb-v, dualpipev: several chunks per process)."""
    total = processes * chunks_per_process
    if total > num_layers:
        raise ValueError(
            f"schedule={schedule!r} cuts the model into {processes} processes x {chunks_per_process} model chunks = "
            f"{total} stages, but the model has {num_layers} layers; every stage needs at least one. Use at most "
            f"{num_layers // chunks_per_process} processes, or split the model into more layers."
        )


def check_balance(balance: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Validate a balance (layers per stage) and return it as a list."""
    check_stage_count(num_layers, num_stages)
    balance = list(balance)
    if (
        len(balance) != num_stages
        or any((not isinstance(b, int)) or b < 1 for b in balance)
        or sum(balance) != num_layers
    ):
        raise ValueError(
            f"balance={balance} must list {num_stages} positive layer counts (one per stage) that add up to "
            f"the model's {num_layers} layers."
        )
    return balance


def even_balance(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible (earlier stages take the remainder)."""
    check_stage_count(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def stage_slice(layers: nn.Sequential, balance: Sequence[int], stage: int) -> nn.Sequential:
    """The layers of ``stage``, keeping their names (so state dicts keep the model's keys)."""
    start = sum(balance[:stage])
    names = list(layers._modules)[start : start + balance[stage]]
    return nn.Sequential(OrderedDict((name, layers._modules[name]) for name in names))
