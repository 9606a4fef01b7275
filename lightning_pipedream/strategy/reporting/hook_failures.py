"""Why a user's epoch-end hook failed on a rank that ran none of the steps' ends: a note on the error.

Lightning's own docs collect a step's values in a list (``self.validation_step_outputs.append(loss)``) and reduce
it in ``on_validation_epoch_end``. Under the pipeline the end of every step (after ``self(...)``: the loss, the
metrics, those appends) runs on the stage that computes the loss only, while the epoch-end hooks run on every rank,
so on the other ranks the list is empty and the hook fails there (``torch.stack`` of nothing, a mean of nothing). The
error itself says nothing of the pipeline; the note added here says why and what to write instead.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Protocol

EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end", "on_predict_epoch_end")


def failed_epoch_end_hook(traceback: TracebackType | None) -> str | None:
    """The epoch-end hook of the user's code (a LightningModule's or a callback's) the traceback passes through."""
    import lightning.pytorch  # here: importing this package may come first, within Lightning's own import

    lightning_code = os.path.dirname(lightning.pytorch.__file__)
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if code.co_name in EPOCH_END_HOOKS and not code.co_filename.startswith(lightning_code):
            return code.co_name
        traceback = traceback.tb_next
    return None


class PipelinePosition(Protocol):
    """Where this rank sits in its pipeline (a :class:`~lightning_pipedream.strategy.setup.placement.Placement`)."""

    @property
    def is_last_stage(self) -> bool: ...

    @property
    def stage_index(self) -> int: ...


def explain_epoch_end_failure(exception: BaseException, placement: PipelinePosition | None) -> None:
    """On a rank that does not compute the loss, note on ``exception`` raised in a user's epoch-end hook why the
    steps' values are missing there and what to write instead (``placement``: None before setup made it)."""
    hook = failed_epoch_end_hook(exception.__traceback__)
    if hook is None or placement is None or placement.is_last_stage or getattr(exception, "_epoch_end_noted", False):
        return
    exception._epoch_end_noted = True  # type: ignore[attr-defined]
    step = {"on_train_epoch_end": "training_step", "on_test_epoch_end": "test_step",
            "on_predict_epoch_end": "predict_step"}.get(hook, "validation_step")
    exception.add_note(
        f"PipeDreamStrategy: {hook} runs on every rank, but the end of {step} (after self(...): its loss, metrics and "
        f"whatever it appends to a list) runs only on the stage that computes the loss; this rank holds stage "
        f"{placement.stage_index}, where nothing the steps collect exists. Log the value from the step instead, "
        f"self.log(name, value, on_epoch=True) (Lightning averages it over the epoch and every rank gets it), or "
        f"use what the steps collected only where it exists: if self.trainer.strategy.is_last_stage: ..."
    )
