"""The pipeline's optimizer steps under Lightning: which minibatches each update applies, with which
hyperparameters, through Lightning's own optimizer hooks; and the callback that drains the pipeline
before anything outside a training step looks at the model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn

# Per optimizer, per parameter group: the group's settings (lr, momentum, betas, ...) without its parameters.
Hyperparameters = list[list[dict[str, Any]]]


@dataclass(frozen=True)
class Admission:
    """What a minibatch's update needs from the training step that admitted it."""

    batch_idx: int
    closes_group: bool  # Lightning steps the optimizer after this batch (end of an accumulation group)
    hyperparameters: Hyperparameters  # the optimizers' settings when this minibatch was admitted


def hyperparameters_of(optimizers: list[torch.optim.Optimizer]) -> Hyperparameters:
    """A copy of every parameter group's settings, as they are now."""
    return [
        [{k: (v.clone() if isinstance(v, Tensor) else v) for k, v in group.items() if k != "params"}
         for group in optimizer.param_groups]
        for optimizer in optimizers
    ]


class PipelineUpdates:
    """Runs the pipeline's optimizer steps, each for the minibatch whose gradient it applies.

    Under Lightning a training step only admits a minibatch; when each stage applies its gradient
    is the schedule's business (under ``pipedream`` stage ``s`` applies minibatch ``t`` during step
    ``t + stages - 1 - s``, or in a drain). So the pipeline owns its gradients and its updates:

    - gradients accumulate in the parameters' ``.grad`` only inside :meth:`pipeline_grads`, and are
      kept aside in between, where Lightning's ``zero_grad`` cannot reach them;
    - minibatch ``t``'s update happens when ``t`` closes an accumulation group (Lightning's own rule:
      every ``accumulate_grad_batches`` batches, and at the epoch's last batch), on every stage;
    - it runs with the hyperparameters (learning rate, momentum, ...) the optimizers had when ``t``
      was admitted, so a scheduler gives minibatch ``t`` the same rate on every stage, drained or not;
    - it runs through the precision plugin's ``optimizer_step``, that is through Lightning's
      ``on_before_optimizer_step`` hooks and ``configure_gradient_clipping``, then zeroes the gradients.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        optimizers: Callable[[], list[torch.optim.Optimizer]],
        step: Callable[[torch.optim.Optimizer], None],
        before_step: Callable[[int], None] | None = None,
    ) -> None:
        self.params = params
        # Called with the batch index of the minibatch about to be applied (e.g. to sum tied copies' gradients).
        self._before_step = before_step
        self._optimizers = optimizers
        self._step = step
        self._pending: list[Tensor | None] = [None] * len(params)  # gradients accumulated, kept aside
        self._admitted: dict[int, Admission] = {}
        self._last: Admission | None = None  # the newest admission
        self._group_sizes: list[list[int]] | None = None

    def admit(self, minibatch: int, batch_idx: int, closes_group: bool) -> None:
        """Remember what ``minibatch``'s updates will need; call when its training step starts."""
        optimizers = self._optimizers()
        sizes = [[len(g["params"]) for g in opt.param_groups] for opt in optimizers]
        if self._group_sizes is None:
            self._group_sizes = sizes
        elif sizes != self._group_sizes:
            raise RuntimeError(
                "The optimizer's parameter groups changed during training (a callback such as BackboneFinetuning "
                "adds groups as it unfreezes layers). PipeDreamStrategy needs every parameter in the optimizer from "
                "the start: put them all in configure_optimizers, freeze with requires_grad=False and unfreeze by "
                "setting requires_grad=True again (a callback may do that); frozen parameters are not updated."
            )
        self._admitted[minibatch] = self._last = Admission(batch_idx, closes_group, hyperparameters_of(optimizers))
        for optimizer in optimizers:
            # The step's rate is read here, as optimizer.step() would read it: torch's check that a scheduler's first
            # step follows an optimizer step (stages - 1 - s steps later here) counts this, and does not warn that
            # the schedule's first value is skipped (it is not).
            getattr(optimizer, "_optimizer", optimizer)._opt_called = True

    @property
    def in_flight(self) -> int:
        """Minibatches admitted whose update on this stage has not run yet."""
        return len(self._admitted)

    @contextmanager
    def pipeline_grads(self) -> Iterator[None]:
        """Inside: ``.grad`` holds the pipeline's accumulated gradients. Outside: whatever Lightning left there."""
        lightning = [p.grad for p in self.params]
        for p, g in zip(self.params, self._pending):
            p.grad = g
        try:
            yield
        finally:
            self._pending = [p.grad for p in self.params]
            for p, g in zip(self.params, lightning):
                p.grad = g

    def apply(self, minibatch: int) -> None:
        """The schedule's OPTIMIZER_STEP after ``minibatch``'s backward (inside :meth:`pipeline_grads`)."""
        admission = self._admitted.pop(minibatch, None)
        if admission is None:
            # A replica that joins a drain's last all-reduce round without a minibatch of its own (1F1B-RR): it
            # updates with the others, with the settings of the last minibatch admitted.
            assert self._last is not None, f"update for minibatch {minibatch}, which was never admitted"
            admission = self._last
        if not admission.closes_group:
            return  # gradient accumulation: the group's last minibatch applies them all
        if self._before_step is not None:
            self._before_step(admission.batch_idx)
        for optimizer, settings in zip(self._optimizers(), admission.hyperparameters):
            now = hyperparameters_of([optimizer])[0]
            _set_hyperparameters(optimizer, settings)
            try:
                self._step(optimizer)
            finally:
                _set_hyperparameters(optimizer, now)
        for p in self.params:
            p.grad = None

    def forget(self) -> None:
        """After a failure: drop what was admitted and accumulated (nothing of it will be applied)."""
        self._admitted.clear()
        self._pending = [None] * len(self.params)


def _set_hyperparameters(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    for group, values in zip(optimizer.param_groups, settings):
        group.update(values)


class PipelineDrain(Callback):
    """First among the Trainer's callbacks: drains the pipeline before others look at the model.

    The strategy drains inside the training step at the end of each epoch's data and at the last
    step; this callback covers validation in the middle of an epoch, a stop requested by a callback
    (``should_stop``), and marks the pipeline as failed when a step raised, so that nothing tries to
    drain or gather a checkpoint from a pipeline whose ranks stopped at different places.
    """

    def __init__(self, drain: Callable[[], None], failed: Callable[[BaseException], None]) -> None:
        self._drain = drain
        self._failed = failed

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._drain()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._drain()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._drain()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._failed(exception)
