"""The user's ``self.log`` calls inside a pipelined step: recorded per micro-batch, logged once on every rank."""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_pipedream.strategy.reporting.summaries import LoggedValue

_LOG_SIGNATURE = inspect.signature(LightningModule.log)


@dataclass
class _Record:
    value: float
    weight: float  # how much the value counts in the step's (its micro-batch's samples, or mean_over count)
    samples: float  # the micro-batch's samples: the batch size Lightning averages the step's value with
    options: dict[str, Any]


class LogRecorder:
    """Collects the ``self.log`` calls of a step's micro-batches, to log their batch value once on every rank.

    The last stage runs the user's step once per micro-batch; each value is averaged over the
    micro-batches weighted by their size, which for mean-reduced metrics gives the batch's value.
    Metric objects are logged by their value on that micro-batch.
    """

    def __init__(self) -> None:
        self.records: dict[str, list[_Record]] = {}

    @contextmanager
    def capture(self, module: LightningModule, weight: float, samples: float | None = None) -> Iterator[None]:
        """Record the module's ``self.log`` calls of one micro-batch, counting ``weight`` in the step's value
        (``samples``, its batch size, by default)."""
        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            bound = _LOG_SIGNATURE.bind(module, name, value, *args, **kwargs)
            options = {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}
            options.update(options.pop("kwargs", {}) or {})
            given = options.pop("batch_size", None)
            w, n = (float(given), float(given)) if given else (weight, weight if samples is None else samples)
            self.records.setdefault(name, []).append(_Record(_as_float(value, name), w, n, options))

        module.log = log  # type: ignore[method-assign]  # an instance attribute shadows the method
        try:
            yield
        finally:
            del module.log

    def aggregate(self) -> list[LoggedValue]:
        """Each name's value over the step: micro-batch values weighted by their batch sizes."""
        out = []
        for name, records in self.records.items():
            total = sum(r.weight for r in records)
            value = (sum(r.value * r.weight for r in records) / total if total
                     else sum(r.value for r in records) / len(records))
            options = dict(records[-1].options)
            options["sync_dist"] = False  # every rank logs the same value: nothing to reduce
            options["batch_size"] = int(sum(r.samples for r in records))
            out.append(LoggedValue(name, value, options))
        return out

    @staticmethod
    def replay(module: LightningModule, logs: list[LoggedValue]) -> None:
        """Log the step's values on this rank, as if its own step had logged them."""
        for log in logs:
            without_sync_dist_advice(log.name)
            module.log(log.name, torch.tensor(log.value), **log.options)


_ADVICE = "It is recommended to use `self.log({name!r}, ..., sync_dist=True)`"  # Lightning's words, at an epoch's end
_quiet: set[str] = set()


def without_sync_dist_advice(name: str) -> None:
    """Lightning advises ``self.log(name, ..., sync_dist=True)`` for an epoch value logged without it in a distributed
    run. A replayed value is the same on every rank already (the last stage's, averaged over data-parallel
    pipelines), so there is nothing to reduce: the advice would be wrong, and a user who passed ``sync_dist=True``
    got it too. It is silenced for the names the pipeline logs, and no other."""
    if name not in _quiet:
        _quiet.add(name)
        warnings.filterwarnings("ignore", message=re.escape(_ADVICE.format(name=name)))


def _as_float(value: Any, name: str) -> float:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover
        Metric = ()  # type: ignore[assignment]
    if isinstance(value, Metric):
        cached = getattr(value, "_forward_cache", None)
        value = cached if cached is not None else value.compute()
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; log a scalar.")
        return float(value.detach().float().cpu())
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(
        f"self.log({name!r}, ...) got {type(value).__name__}; under PipeDreamStrategy log scalars or Metrics."
    )
