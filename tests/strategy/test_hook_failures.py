"""A user's epoch-end hook that fails on a rank which ran none of the steps' ends gets a note saying why and what
to write instead (in one process: the exception as Lightning's hook call raises it)."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import torch

from lightning_pipedream.strategy.reporting.hook_failures import explain_epoch_end_failure


class Net(L.LightningModule):
    """Lightning's documented idiom: the steps append, the epoch's end stacks."""

    def __init__(self) -> None:
        super().__init__()
        self.validation_step_outputs: list[torch.Tensor] = []

    def on_validation_epoch_end(self):
        return torch.stack(self.validation_step_outputs).mean()  # empty on a stage that ran no step's end


def raised(call) -> BaseException:
    try:
        call()
    except BaseException as error:  # noqa: BLE001 - the error as the strategy's on_exception gets it
        return error
    raise AssertionError("did not raise")


def test_the_note_says_why_the_list_is_empty_and_what_to_write_instead():
    error = raised(Net().on_validation_epoch_end)
    explain_epoch_end_failure(error, SimpleNamespace(is_last_stage=False, stage_index=0))
    explain_epoch_end_failure(error, SimpleNamespace(is_last_stage=False, stage_index=0))  # once
    assert error.__notes__ == [
        "PipeDreamStrategy: on_validation_epoch_end runs on every rank, but the end of validation_step (after "
        "self(...): its loss, metrics and whatever it appends to a list) runs only on the stage that computes the "
        "loss; this rank holds stage 0, where nothing the steps collect exists. Log the value from the step instead, "
        "self.log(name, value, on_epoch=True) (Lightning averages it over the epoch and every rank gets it), or use "
        "what the steps collected only where it exists: if self.trainer.strategy.is_last_stage: ..."
    ]


def test_no_note_on_the_last_stage_before_setup_or_outside_an_epoch_end_hook():
    for placement in (SimpleNamespace(is_last_stage=True, stage_index=1), None):
        error = raised(Net().on_validation_epoch_end)
        explain_epoch_end_failure(error, placement)
        assert not hasattr(error, "__notes__")
    error = raised(lambda: torch.stack([]))
    explain_epoch_end_failure(error, SimpleNamespace(is_last_stage=False, stage_index=0))
    assert not hasattr(error, "__notes__")
