"""What the last stage tells every rank after a step: the loss, the step's extra outputs and its logged values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipedream.runtime.failures import pipeline_failures


@dataclass(frozen=True)
class LoggedValue:
    """One ``self.log(name, value, **options)`` call, reduced over a step's micro-batches."""

    name: str
    value: float
    options: dict[str, Any]


@dataclass
class StepSummary:
    """The last stage's view of one step, which rank 0 needs for Lightning's loggers and callbacks."""

    loss: float
    extra: dict[str, Any] = field(default_factory=dict)  # training_step's outputs besides "loss"
    logs: list[LoggedValue] = field(default_factory=list)

    def layout(self) -> tuple:
        """Everything but the numbers: while it stays the same from step to step, only numbers travel."""
        return (self.extra, [(log.name, log.options) for log in self.logs])

    def numbers(self) -> list[float]:
        return [self.loss] + [log.value for log in self.logs]


class SummaryChannel:
    """Sends each step's :class:`StepSummary` from the last stage to every rank.

    A summary is usually the same names and options with new numbers; then it travels as one
    fixed-size float64 tensor (one broadcast). When its layout changes (or it carries extra
    outputs), it travels pickled once and its layout is remembered on every rank.
    """

    SLOTS = 64  # numbers per fast message: [fits?, count, loss, logged values...]

    def __init__(self, stage_index: int, num_stages: int, device: torch.device) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = device
        self._layout: tuple | None = None

    @property
    def source(self) -> int:
        return self.num_stages - 1

    def exchange(self, summary: StepSummary | None) -> StepSummary:
        """Call on every rank; ``summary`` is given on the last stage (None elsewhere). Returns it everywhere."""
        if self.num_stages == 1:
            assert summary is not None
            return summary
        message = torch.zeros(self.SLOTS, dtype=torch.float64)
        if summary is not None:
            values = summary.numbers()
            fits = not summary.extra and len(values) <= self.SLOTS - 2 and summary.layout() == self._layout
            message[0], message[1] = (1.0 if fits else 0.0), len(values)
            if fits:
                message[2 : 2 + len(values)] = torch.tensor(values, dtype=torch.float64)
        on_device = message.to(self.device)
        with pipeline_failures(self.stage_index):
            dist.broadcast(on_device, src=self.source)
        message = on_device.cpu()
        if message[0] == 0.0:  # something new: it travels whole, and every rank remembers its layout
            summary = self.broadcast_object(summary)
            self._layout = summary.layout()
            return summary
        assert self._layout is not None
        extra, names = self._layout
        values = message[2 : 2 + int(message[1])].tolist()
        logs = [LoggedValue(name, value, options) for (name, options), value in zip(names, values[1:])]
        return StepSummary(values[0], dict(extra), logs)

    def broadcast_object(self, value: Any) -> Any:
        """A small picklable value from the last stage to every rank (outputs of evaluation steps)."""
        if self.num_stages == 1:
            return value
        box = [value]
        with pipeline_failures(self.stage_index):
            dist.broadcast_object_list(box, src=self.source, device=self.device)
        return box[0]
