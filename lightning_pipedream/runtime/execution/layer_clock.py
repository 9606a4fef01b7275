"""Each layer's forward time on this rank, read only while a traced window runs: what lets a plan made again from a run
(``plan/explain.py``'s ``replan``) find one slow layer among its stage's, where the step accounts time stages.

:class:`LayerClock` puts a forward pre-hook and a forward hook on each child of the stage (its layers, named as in the
model's ``nn.Sequential`` and the profile) between :meth:`LayerClock.start` and :meth:`LayerClock.stop`, which the
strategy calls around the traced training steps only: outside the window no hook is there, so the untraced steps pay
nothing. Inside it, two clock reads and two additions per layer and forward.

Forwards only. A backward hook per layer (``register_full_backward_hook``) wraps the layer's inputs and outputs in an
autograd function, which refuses a later in-place change of an output (an ``inplace=True`` activation) and misses the
backward of a layer whose inputs need no gradient; a forward hook changes nothing in what runs. ``replan`` takes the
measured forwards per layer and scales the stage's backward as a whole to its measured compute.

On CUDA the host clock reads kernel launches, not the kernels: the strategy does not time layers there (a plan is then
made again from the stage's compute alone).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_pipedream.runtime.execution.accounts import clock


class LayerClock:
    """Forward seconds and calls per child of ``stage`` (by name) while started; see the module's text."""

    def __init__(self, stage: nn.Module) -> None:
        self.layers = dict(stage.named_children())
        self.seconds = dict.fromkeys(self.layers, 0.0)
        self.calls = dict.fromkeys(self.layers, 0)
        self._started: dict[str, list[float]] = {name: [] for name in self.layers}  # a layer called inside itself
        self._handles: list[Any] = []

    @property
    def running(self) -> bool:
        return bool(self._handles)

    def start(self) -> None:
        if self._handles:
            return
        for name, layer in self.layers.items():
            started = self._started[name]

            def before(module: nn.Module, args: Any, started: list[float] = started) -> None:
                started.append(clock())

            def after(module: nn.Module, args: Any, output: Any, name: str = name,
                      started: list[float] = started) -> None:
                if started:
                    self.seconds[name] += clock() - started.pop()
                    self.calls[name] += 1

            self._handles.append(layer.register_forward_pre_hook(before))
            self._handles.append(layer.register_forward_hook(after))

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for started in self._started.values():  # a forward that raised: its start is no one's
            started.clear()

    def per_step(self, steps: int) -> dict[str, float]:
        """Each timed layer's forward seconds per training step over ``steps`` timed steps (layers never called are
        left out)."""
        if steps <= 0:
            return {}
        return {name: seconds / steps for name, seconds in self.seconds.items() if self.calls[name]}
