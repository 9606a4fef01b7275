"""The stage's live tensor bytes over a traced window: a peak the memory model's prediction can be read against, on
any device (``pipeline/stage{k}/peak_live_mb``).

``peak_memory_mb`` on the CPU is the process's peak resident set (the interpreter, torch, Lightning, the data
loader): hundreds of MB beside a prediction that counts the model's tensors alone. :class:`WindowMemory` counts what
the prediction counts: every tensor storage alive on this rank (``plan/live_bytes.py``'s :class:`LiveTensorBytes`, a
dispatch mode that sees every operator's outputs until the last tensor on their storage dies), from the weights, their
gradients, the optimizer state and the stashed weight versions to the activations in flight and the backward's and
the update's working sets, and its peak over the window's training steps.

What is counted, and from when:

- Tensors made before the meter starts are added explicitly: the stage's parameters and buffers, their ``.grad``,
  the optimizer's state, and the weight versions the engine keeps (``WeightVersions``: stashed, spare and vertical
  sync's copies).
- Activations in flight that were made before the window: a flushed schedule (gpipe, 1f1b, interleaved, zero bubble)
  holds none between steps. An asynchronous one (``pipedream``, ``2bw``) holds a minibatch's activations on a stage
  from its forward to its backward, at most ``stages - 1`` training steps later; autograd keeps them (saved tensors),
  where no walk of Python objects finds them. So the meter starts ``stages - 1`` steps before the window (its ``lead``;
  those steps are metered, and pay the meter's cost, but are not traced) and forgets its peak at the window's first
  step: every activation alive then was made under it.
- Not counted: tensors made outside a training step (Lightning's between steps: the batch before the step takes it,
  the logged values), storages that cannot be resized (a mapped file: the shared-memory transport's rings) and tensors
  made on another thread (the meter is a dispatch mode of the training thread; CPU backwards run on it).

The meter runs only in the metered steps: it is entered at each one's start and left at its end (a dispatch mode
over a step costs a Python call per operator: see docs/reading_a_run.md for the figure).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from lightning_pipedream.plan.live_bytes import LiveTensorBytes


class WindowMemory:
    """The live tensor bytes of this rank's stage over training steps ``first .. first + count - 1`` (``count``
    None: to the fit's end), metered from ``lead`` steps before ``first`` (see the module text).

    ``tensors``: called when the meter starts, the tensors made before it that the stage holds (weights, gradients,
    optimizer state, weight versions: :func:`stage_tensors`).
    """

    def __init__(self, tensors: Callable[[], Iterable[Any]], first: int, count: int | None, lead: int,
                 device_type: str = "cpu", stages: Iterable[Any] = (),
                 optimizers: Callable[[], Iterable[torch.optim.Optimizer]] = tuple) -> None:
        self.tensors = tensors
        self._stages, self._optimizers = list(stages), optimizers
        self.first, self.count, self.lead = first, count, max(0, lead)
        self.device_type = device_type
        self.meter: LiveTensorBytes | None = None
        self.steps = 0  # window steps metered
        self._inside = False

    def metered(self, step: int) -> bool:
        """Whether training step ``step`` (of this fit, from 0) runs under the meter."""
        end = math.inf if self.count is None else self.first + self.count
        return max(0, self.first - self.lead) <= step < end

    def begin_step(self, step: int) -> None:
        if not self.metered(step):
            return
        if self.meter is None:
            self.meter = LiveTensorBytes(self.device_type)
            self.meter.add_all(self.tensors())
            self._label(self.meter)
        if step == self.first:
            self.meter.reset_peak()  # the window's peak: from the live bytes at its start
        self.meter.__enter__()
        self._inside = True
        if step >= self.first:
            self.steps += 1

    def end_step(self) -> None:
        if self._inside and self.meter is not None:
            self._inside = False
            self.meter.__exit__(None, None, None)

    def _label(self, meter: LiveTensorBytes) -> None:
        """What runs at the peak (:attr:`LiveTensorBytes.peak_phase`): each stage's forward and backwards, and the
        optimizers' steps (their step hooks). Installed when the meter starts; a call each, so never without it."""
        for stage in self._stages:
            for name in ("forward", "backward", "backward_input", "backward_weight"):
                if hasattr(stage, name):
                    setattr(stage, name, meter.labelled(name, getattr(stage, name)))
        outer: list[tuple[str, int]] = []

        def before(*_: Any) -> None:
            outer.append((meter.phase, meter.phase_base))
            meter.phase, meter.phase_base = "update", meter.live

        def after(*_: Any) -> None:
            if outer:
                meter.phase, meter.phase_base = outer.pop()

        for optimizer in self._optimizers():
            optimizer.register_step_pre_hook(before)
            optimizer.register_step_post_hook(after)

    def where(self) -> str:
        """The peak in words, with what ran at it (for the log)."""
        m = self.meter
        if m is None or self.steps == 0:
            return "not measured"
        from lightning_pipedream.plan.choice import bytes_text

        rises = ", ".join(f"{phase} +{bytes_text(rise)}" for phase, rise in sorted(m.transient.items()))
        return (f"{bytes_text(m.peak)} in {m.peak_phase} ({bytes_text(m.peak_phase_base)} live when it began; each "
                f"phase's most above its start: {rises})")

    @property
    def peak(self) -> float:
        """Bytes: the most live at once over the window's steps so far; NaN before its first step."""
        if self.meter is None or self.steps == 0:
            return math.nan
        return float(self.meter.peak)


def stage_tensors(modules: Iterable[torch.nn.Module], optimizers: Callable[[], Iterable[torch.optim.Optimizer]],
                  weights: Any = None) -> Callable[[], Iterator[Any]]:
    """What the stage holds that was made before the meter: its parameters and buffers, their gradients, the
    optimizers' state and the engine's weight versions (every tensor in the dictionaries a ``WeightVersions``
    keeps)."""

    def tensors() -> Iterator[Any]:
        for module in modules:
            for p in module.parameters():
                yield p
                yield p.grad
            yield from module.buffers()
        for optimizer in optimizers():
            for state in optimizer.state.values():
                yield from state.values()
        if weights is not None:
            yield from _tensors_in(vars(weights).values())

    return tensors


def _tensors_in(values: Iterable[Any], depth: int = 3) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif depth > 0 and isinstance(value, dict):
            yield from _tensors_in(value.values(), depth - 1)
        elif depth > 0 and isinstance(value, (list, tuple, set)):
            yield from _tensors_in(value, depth - 1)
