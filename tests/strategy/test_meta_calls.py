"""A step that runs a module built on the meta device itself (``self.model(...)`` rather than ``self(...)``, which the
strategy pipelines) is told what happened and what to do, instead of torch's words about meta tensors. In one
process: the strategy's call capture (what setup runs first on every rank) and the last stage's loss replay."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pipedream.strategy.setup.calls import ForwardCall, MetaModuleCalledError, explaining_meta_calls

WORDS = (r"Net.training_step ran a module whose weights are on the meta device, outside the pipelined call "
         r"\((NotImplementedError|RuntimeError): .*meta.*\)\. Under PipeDreamStrategy a model built in "
         r"configure_model .* stays a meta skeleton: each rank holds only its own stage's weights, inside the "
         r"pipeline, so a direct call such as self.model\(...\) has nothing to compute with. Call the LightningModule "
         r"itself, self\(...\), whose forward the strategy pipelines")


class Net(L.LightningModule):
    def __init__(self, direct: bool) -> None:
        super().__init__()
        self.direct = direct
        with torch.device("meta"):  # as configure_model builds it under the strategy
            self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        out = self.model(x) if self.direct else self(x)
        return out.sum()


def test_a_step_calling_the_meta_model_directly_is_told_to_call_self():
    batch = (torch.ones(3, 4),)
    with pytest.raises(MetaModuleCalledError, match=WORDS) as err:
        ForwardCall().input_of(Net(direct=True), "training_step", batch, 0)
    assert isinstance(err.value.__cause__, (NotImplementedError, RuntimeError))  # torch's own error, chained
    # Through self(...), the call is the pipeline's: captured, nothing run on meta.
    args, kwargs = ForwardCall().input_of(Net(direct=False), "training_step", batch, 0)
    assert torch.equal(args[0], batch[0]) and kwargs == {}


def test_only_meta_failures_of_a_meta_built_module_are_reworded():
    with pytest.raises(MetaModuleCalledError, match=WORDS):  # the last stage's loss replay runs the step so too
        with explaining_meta_calls(Net(direct=True), "training_step"):
            Net(direct=True).model(torch.ones(3, 4))
    real = Net(direct=True).to_empty(device="cpu")  # the same module with real weights: its errors stay torch's
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied") as err:
        with explaining_meta_calls(real, "training_step"):
            real.model(torch.ones(3, 5))
    assert not isinstance(err.value, MetaModuleCalledError)
    with pytest.raises(ValueError, match="the user's own"), explaining_meta_calls(Net(direct=True), "training_step"):
        raise ValueError("the user's own error, about meta tensors or not")


@pytest.mark.multiprocess  # a forked child: see below
def test_the_loss_s_memory_is_found_on_fake_tensors_and_the_module_left_as_it_was():
    """strategy.setup.graph_memory.loss_bytes runs the step after the model's call on fake tensors (what the memory model
    adds for the loss): what the step assigns there (a metric's state, a counter) is put back, logs go nowhere."""
    from lightning_pipedream.runtime.faults.launch import run_local

    # In a forked child: a trace (torch.export) and a backward in one process make autograd refuse to run in the
    # processes forked from it later (other tests' ranks).
    run_local(_in_child, 1, check_the_loss_probe, timeout=120)


def _in_child(rank: int, world: int, fn) -> None:
    fn()


def check_the_loss_probe() -> None:
    import torchmetrics

    from lightning_pipedream.graph import capture
    from lightning_pipedream.strategy.setup.graph_memory import loss_bytes

    class Classifier(Net):
        def __init__(self) -> None:
            super().__init__(direct=False)
            self.accuracy, self.calls = torchmetrics.Accuracy(task="multiclass", num_classes=2), 0

        def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
            x, y = batch
            out = self(x)
            self.calls += 1
            self.accuracy(out, y)
            self.log("accuracy", self.accuracy)
            return nn.functional.cross_entropy(out, y)

    module = Classifier()
    x, y = torch.ones(5, 4), torch.tensor([0, 1, 1, 0, 1])
    kept, working = loss_bytes(module, ForwardCall(), "training_step", (x, y), capture(module, (x,), on_meta=True),
                               torch.device("cpu"))
    assert kept >= 5 * 2 * 4 and working >= 5 * 2 * 4  # the log-probabilities kept; the logits' gradient made
    assert module.calls == 0 and not {"forward", "log"} & set(module.__dict__)
    assert all(isinstance(t, torch.Tensor) and t.sum() == 0 and type(t) is torch.Tensor
               for t in (getattr(module.accuracy, name) for name in module.accuracy._defaults))
    module.accuracy.update(torch.tensor([[1.0, 0.0]] * 5), y)
    assert float(module.accuracy.compute()) == pytest.approx(0.4)  # the metric still counts real values
