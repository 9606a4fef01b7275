"""Lightning's model summary under the pipeline (in one process): the forward on ``example_input_array`` is left out
while the callbacks' ``on_fit_start`` run, since each rank holds only its stage; a forward outside a step says so."""

from __future__ import annotations

import re
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn

from lightning_pipedream.strategy.reporting.model_summary import ExampleInputAside, summary_without_example_input
from lightning_pipedream.strategy.setup.calls import Elsewhere


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.example_input_array = torch.zeros(2, 4)

    def forward(self, x):
        return self.layers(x)


def test_the_summary_runs_without_the_example_forward_and_the_example_comes_back(caplog):
    net, aside = Net(), ExampleInputAside()
    example = net.example_input_array
    net.layers._modules["2"] = Elsewhere("2", 1)  # what a rank of stage 0 holds
    with pytest.raises(RuntimeError, match="lives on pipeline stage 1"):
        ModelSummary(net)  # Lightning's own summary, as its callback makes it at on_fit_start
    with caplog.at_level("INFO", logger="lightning_pipedream"):
        aside.on_fit_start(SimpleNamespace(is_global_zero=True), net)
    assert "the model summary shows no input or output sizes" in caplog.text
    summary = ModelSummary(net)
    assert summary.total_parameters == 4 * 8 + 8
    aside.on_train_start(SimpleNamespace(), net)
    assert net.example_input_array is example


def test_it_goes_first_among_the_callbacks_once():
    trainer = SimpleNamespace(callbacks=[object()])
    summary_without_example_input(trainer)  # type: ignore[arg-type]
    summary_without_example_input(trainer)  # type: ignore[arg-type]
    assert isinstance(trainer.callbacks[0], ExampleInputAside) and len(trainer.callbacks) == 2


def test_a_forward_outside_a_step_says_where_it_may_run():
    with pytest.raises(RuntimeError, match=re.escape(
            "Layer '2' lives on pipeline stage 1, another process. Under PipeDreamStrategy the layers run only "
            "through the pipeline, from training_step, validation_step, test_step or predict_step, each calling "
            "self(x) (or the Sequential) once. A forward anywhere else (a hook such as on_fit_start or "
            "on_validation_epoch_end, a callback, a single layer) cannot run on one process: move it into a step.")):
        Elsewhere("2", 1)(torch.zeros(1))
