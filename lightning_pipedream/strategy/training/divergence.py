"""The divergence guard of the asynchronous schedules: when the loss blows up, go back to the last drained weights
and go on under ``1f1b``; and the weight staleness each stage measured, for the logs."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_pipedream.strategy.setup.options import DEFAULT_FACTOR

SMOOTHING = 0.9  # the smoothed loss: an exponential moving average, this much of the old value per step
WARMUP = 4  # losses after which the guard may step in for a rise (a non-finite loss trips it at once)


@dataclass(frozen=True)
class Divergence:
    """Why the guard stepped in: which loss (its number among those seen), its value, and the limit it broke."""

    seen: int
    loss: float
    smoothed: float
    limit: float  # nan: the loss was not finite

    def words(self) -> str:
        minibatch = self.seen - 1  # the losses come in minibatch order, from the first
        if not math.isfinite(self.loss):
            return f"the training loss of minibatch {minibatch} is {self.loss}"
        return (f"the smoothed training loss reached {self.smoothed:.4g} at minibatch {minibatch} (its loss: "
                f"{self.loss:.4g}), above the limit {self.limit:.4g} (divergence_factor x its lowest)")


class DivergenceGuard:
    """Watches the training losses, in the order every rank sees them, and says when they diverge.

    A loss that is not finite diverges at once. Otherwise the guard keeps an exponential moving average of the
    losses (``SMOOTHING``) and its lowest value; from the ``WARMUP``-th loss on, the run diverges when the average
    is above ``factor`` times that lowest value (only for positive losses: the rule is a ratio). The average, not
    each loss, is compared, so that one hard batch does not trip it. Every rank sees the same losses (the step
    summaries) and so decides alike, without a collective of its own.
    """

    def __init__(self, factor: float = DEFAULT_FACTOR) -> None:
        self.factor = factor
        self.seen = 0
        self.smoothed: float | None = None
        self.lowest = math.inf

    def observe(self, loss: float) -> Divergence | None:
        """Take the next loss; a :class:`Divergence` if the run diverges with it."""
        self.seen += 1
        if not math.isfinite(loss):
            return Divergence(self.seen, loss, self.smoothed if self.smoothed is not None else loss, math.nan)
        self.smoothed = loss if self.smoothed is None else SMOOTHING * self.smoothed + (1 - SMOOTHING) * loss
        self.lowest = min(self.lowest, self.smoothed)
        if self.seen >= WARMUP and not self.healthy:
            return Divergence(self.seen, loss, self.smoothed, self.factor * self.lowest)
        return None

    @property
    def healthy(self) -> bool:
        """Whether the losses so far stay within the limit: weights drained now are worth going back to."""
        return self.smoothed is None or not (self.lowest > 0 and self.smoothed > self.factor * self.lowest)


class DrainedWeights:
    """A copy of a stage's weights and optimizer states, taken when the pipeline is drained (all stages agree on
    them), to go back to after a divergence. It costs one copy of the stage's parameters and optimizer state."""

    def __init__(self) -> None:
        self._params: list[Tensor] | None = None
        self._optimizers: list[dict] | None = None

    @property
    def taken(self) -> bool:
        return self._params is not None

    def take(self, stage: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        with torch.no_grad():
            if self._params is None:
                self._params = [p.detach().clone() for p in stage.parameters()]
            else:
                for kept, p in zip(self._params, stage.parameters()):
                    kept.copy_(p)
        self._optimizers = [copy.deepcopy(opt.state_dict()) for opt in optimizers]

    def restore(self, stage: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        assert self._params is not None and self._optimizers is not None
        with torch.no_grad():
            for kept, p in zip(self._params, stage.parameters()):
                p.copy_(kept)
        for opt, state in zip(optimizers, self._optimizers):
            opt.load_state_dict(copy.deepcopy(state))


class Staleness:
    """Per stage, the weight staleness its updates measured: how many updates the weights had received between a
    minibatch's forward and the update that applies its gradient (PipeDream: ``stages - 1 - s`` once full)."""

    def __init__(self) -> None:
        self.total = 0
        self.count = 0
        self.largest = 0

    def add(self, values: list[int]) -> None:
        self.total += sum(values)
        self.count += len(values)
        self.largest = max([self.largest, *values])

    def take(self) -> tuple[float, int]:
        """The mean and largest staleness since the last call (0, 0 without updates); starts over."""
        mean = self.total / self.count if self.count else 0.0
        out = (mean, self.largest)
        self.total = self.count = self.largest = 0
        return out
