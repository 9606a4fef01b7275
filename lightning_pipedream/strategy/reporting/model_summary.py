"""Lightning's model summary under the pipeline: without the forward on ``example_input_array``.

Lightning's ``ModelSummary`` callback runs the module on ``self.example_input_array`` at the start of ``fit`` to
show each layer's input and output sizes. That forward is outside any step, on every rank, and each rank holds only
its stage's layers, so it failed on the first layer of another stage (a user's first try with Lightning's tutorials'
idiom). The example input is put aside while the callbacks' ``on_fit_start`` run, and put back before any step: the
summary lists the layers and parameters without the sizes, as for a module without an example input.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

log = logging.getLogger(__name__)


class ExampleInputAside(Callback):
    """First among the callbacks: ``example_input_array`` is None during ``on_fit_start``, as it was after."""

    def __init__(self) -> None:
        self._kept: Any = None
        self._said = False

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._kept = pl_module.example_input_array
        if self._kept is None:
            return
        pl_module.example_input_array = None
        if trainer.is_global_zero and not self._said:
            self._said = True
            log.info("PipeDreamStrategy: the model summary shows no input or output sizes: its forward on "
                     "example_input_array would need every stage's layers in one process (each holds its own).")

    def _put_back(self, pl_module: LightningModule) -> None:
        if self._kept is not None:
            pl_module.example_input_array, self._kept = self._kept, None

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._put_back(pl_module)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._put_back(pl_module)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._put_back(pl_module)


def summary_without_example_input(trainer: Trainer) -> None:
    """Put :class:`ExampleInputAside` first among the Trainer's callbacks (once)."""
    if not any(isinstance(c, ExampleInputAside) for c in trainer.callbacks):
        trainer.callbacks.insert(0, ExampleInputAside())
