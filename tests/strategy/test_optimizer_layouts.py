"""The optimizers' layout (checkpoints' single-device form) is read only when fitting: a validate/test/predict before
any fit never calls ``configure_optimizers``, and a later fit reads the same layout with the other stages' layers
gone from the rank (their meta-device shadows stand in)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pipedream.strategy.checkpoints.checkpoint import OptimizerLayout
from lightning_pipedream.strategy.setup.calls import Elsewhere
from lightning_pipedream.strategy.setup.checks import optimizers_unvalidated
from lightning_pipedream.strategy.setup.optimizer_layouts import layouts_when_fitting, learn_layouts, meta_shadow


class Tied(L.LightningModule):
    """Two parameter groups (no weight decay for biases, as users write it) and an output layer tied to the first."""

    def __init__(self) -> None:
        super().__init__()
        first = nn.Linear(4, 4)
        last = nn.Linear(4, 4)
        last.weight = first.weight
        self.layers = nn.Sequential(first, nn.ReLU(), nn.BatchNorm1d(4), nn.Linear(4, 4), last)
        self.calls = 0

    def configure_optimizers(self):
        self.calls += 1
        params = dict(self.named_parameters())
        decay = [p for n, p in params.items() if not n.endswith("bias")]
        rest = [p for n, p in params.items() if n.endswith("bias")]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}])


def strip(module: Tied, own: set[str]) -> None:
    """What a rank's setup does to the layers of other stages under validate/test/predict (stage_pipeline.py)."""
    layers = module.layers
    kept = {id(p) for name in own for p in layers._modules[name].parameters()}
    for name in list(layers._modules):
        if name not in own:
            layers._modules[name] = Elsewhere(name, 1, meta_shadow(layers._modules[name], kept))


def test_validate_test_and_predict_never_call_configure_optimizers():
    module = Tied()
    assert layouts_when_fitting(module, fitting=False) == []
    assert module.calls == 0


@pytest.mark.parametrize("own", [{"0", "1", "2"}, {"3", "4"}])
def test_a_later_fit_reads_the_layout_a_fit_reads_before_the_split(own):
    whole = Tied()
    expected = OptimizerLayout.of_module(whole, optimizers_unvalidated)
    module = Tied()
    strip(module, own)
    assert learn_layouts(module, module.layers) == expected
    # the placeholders are back, the shadows hold no data and are not the module's state
    assert all(isinstance(module.layers._modules[n], Elsewhere) for n in module.layers._modules if n not in own)
    assert set(module.state_dict()) == {k for k in whole.state_dict() if k.split(".")[1] in own}
    shadows = [module.layers._modules[n].shadow for n in module.layers._modules if n not in own]
    assert all(t.is_meta or id(t) in {id(p) for p in module.parameters()}
               for s in shadows for t in [*s.parameters(), *s.buffers()])


def test_several_optimizers_are_refused_at_the_fit_in_words():
    class Two(Tied):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.layers[0].parameters(), lr=0.1),
                    torch.optim.SGD(self.layers[3].parameters(), lr=0.1)]

    with pytest.raises(ValueError, match=r"^Two.configure_optimizers returns 2 optimizers; PipeDreamStrategy trains "
                                         r"with one \(automatic optimization, which takes one\)\. Use one optimizer "
                                         r"with a parameter group per part of the model"):
        learn_layouts(Two(), None)
