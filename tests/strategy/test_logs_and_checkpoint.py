"""In-process unit tests of the Lightning-side helpers: LogRecorder and OptimizerLayout (no Trainer, no processes)."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pipedream.strategy.checkpoints.checkpoint import OptimizerLayout
from lightning_pipedream.strategy.reporting.logs import LogRecorder


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        self.logged: list = []

    def log(self, name, value, **options):  # what replay() calls: record instead of needing a Trainer
        self.logged.append((name, float(value), options))

    def configure_optimizers(self):
        first, last = self.layers[0].parameters(), self.layers[2].parameters()
        return torch.optim.SGD([{"params": first}, {"params": last, "lr": 0.5}], lr=0.1, momentum=0.9)


def test_log_recorder_weights_microbatches_by_size_and_replays_once():
    net, recorder = Net(), LogRecorder()
    with recorder.capture(net, weight=3):
        net.log("loss", torch.tensor(1.0), prog_bar=True)
    with recorder.capture(net, weight=1):
        net.log("loss", 5.0, prog_bar=True)
        net.log("acc", torch.tensor(0.5), batch_size=4)
    assert net.log.__func__ is Net.log  # the capture's stand-in is gone
    logs = {v.name: v for v in recorder.aggregate()}
    assert logs["loss"].value == pytest.approx((3 * 1.0 + 1 * 5.0) / 4)
    assert logs["loss"].options == {"prog_bar": True, "sync_dist": False, "batch_size": 4}
    assert logs["acc"].value == 0.5 and logs["acc"].options["batch_size"] == 4
    LogRecorder.replay(net, recorder.aggregate())
    assert [(n, v) for n, v, _ in net.logged] == [("loss", 2.0), ("acc", 0.5)]


def test_lightnings_advice_to_sync_dist_is_silenced_for_the_replayed_names_only():
    from lightning.pytorch.trainer.connectors.logger_connector.result import warning_cache

    net, recorder = Net(), LogRecorder()
    with recorder.capture(net, weight=1):
        net.log("val_loss", torch.tensor(1.0), sync_dist=True)  # as the user wrote it: the strategy drops sync_dist
    LogRecorder.replay(net, recorder.aggregate())
    advice = "It is recommended to use `self.log({!r}, ..., sync_dist=True)` when logging on epoch level in distributed "
    with warnings.catch_warnings(record=True) as seen:  # the filters as they are, the strategy's in front
        for name in ("val_loss", "other"):
            warning_cache.warn(advice.format(name) + "setting to accumulate the metric across devices.")
    assert [str(w.message).split("`")[1] for w in seen] == ["self.log('other', ..., sync_dist=True)"]


def test_log_recorder_refuses_non_scalars():
    net, recorder = Net(), LogRecorder()
    with recorder.capture(net, weight=1), pytest.raises(ValueError, match=r"got a tensor of shape \(2,\); log a scalar"):
        net.log("v", torch.zeros(2))
    with recorder.capture(net, weight=1), pytest.raises(TypeError, match="got str; under PipeDreamStrategy log scalars"):
        net.log("v", "text")


def _init(module):
    return [module.configure_optimizers()], []


def test_optimizer_layout_round_trips_state_between_stages_and_one_device():
    torch.manual_seed(0)
    net = Net()
    (layout,) = OptimizerLayout.of_module(net, _init)
    assert layout.groups == [["layers.0.weight", "layers.0.bias"], ["layers.2.weight", "layers.2.bias"]]
    # Two "stages": each with the optimizer over its own parameters, stepped once so momentum exists.
    stage_params = [dict(net.layers[0].named_parameters(prefix="layers.0")),
                    dict(net.layers[2].named_parameters(prefix="layers.2"))]
    optimizers, parts = [], []
    for params in stage_params:
        opt = torch.optim.SGD([{"params": list(params.values())}], lr=0.1, momentum=0.9)
        for p in params.values():
            p.grad = torch.ones_like(p)
        opt.step()
        names = {id(p): n for n, p in params.items()}
        optimizers.append((opt, names))
        parts.append(layout.named_state(opt, names))
    full = layout.to_full(parts)
    assert sorted(full["state"]) == [0, 1, 2, 3]
    assert [g["params"] for g in full["param_groups"]] == [[0, 1], [2, 3]]
    # ... and back: each stage picks exactly its own momentum buffers.
    for opt, names in optimizers:
        local = layout.to_local(opt, full, names)
        mine = [names[id(p)] for g in opt.param_groups for p in g["params"]]
        assert sorted(local["state"]) == list(range(len(mine)))
        for i in range(len(mine)):
            assert torch.equal(local["state"][i]["momentum_buffer"], opt.state_dict()["state"][i]["momentum_buffer"])
        opt.load_state_dict(local)


def test_optimizer_layout_rejects_a_checkpoint_of_another_model():
    (layout,) = OptimizerLayout.of_module(Net(), _init)
    other = {"state": {}, "param_groups": [{"params": [0, 1, 2]}]}
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="checkpoint is from a different model or optimizer setup"):
        layout.to_local(opt, other, {})
