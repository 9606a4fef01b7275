"""Per-stage construction: layers built on the meta device, materialized where they run, with partition-free seeds."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pipedream import PipeDreamStrategy
from lightning_pipedream.runtime.stages.materialize import (
    balance_by_parameters,
    has_meta_tensors,
    layer_seed,
    materialize,
)


def _layers() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 4))


def test_a_layer_gets_the_same_weights_whatever_else_is_materialized():
    with torch.device("meta"):
        whole, part = _layers(), _layers()
    materialize(whole, torch.device("cpu"), base_seed=3)
    allocated = materialize(part[2:], torch.device("cpu"), base_seed=3)  # stage 1 only (a slice keeps names)
    assert has_meta_tensors(part[:2]) and not has_meta_tensors(part[2:])
    assert allocated == 4 * (64 * 64 + 64 + 4 * 64 + 64 * 4 + 4) + 8  # BatchNorm: 4 x 64 floats and a counter
    for key, value in part[2:].state_dict().items():
        assert torch.equal(value, whole.state_dict()[key]), key
    assert torch.equal(part[3].running_var, torch.ones(64))  # buffers reset too
    # The seed depends on the name and the base, not on anything else.
    assert layer_seed(3, "layers.2") == layer_seed(3, "layers.2") != layer_seed(4, "layers.2")
    assert layer_seed(3, "layers.2") != layer_seed(3, "layers.3")


def test_balance_by_parameters_reads_shapes_only():
    with torch.device("meta"):
        layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)], nn.Linear(256, 2))
    assert balance_by_parameters(layers, 2) == [3, 4]
    assert has_meta_tensors(layers)  # nothing was allocated


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.scale


def test_a_module_that_cannot_initialize_itself_is_named():
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(3, 3), NoReset())
    with pytest.raises(ValueError, match=r"NoReset 'layers.1' was built on the meta device but has no "
                                         r"reset_parameters\(\), so PipeDreamStrategy cannot initialize its weights"):
        materialize(layers, torch.device("cpu"), 0, prefix="layers.")


class GraphBuiltInConfigureModel(L.LightningModule):
    """Not one nn.Sequential: the graph path, which traces the shapes of a model built on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = None

    def configure_model(self) -> None:
        if self.encoder is None:
            self.encoder, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_graph_path_module_built_on_the_meta_device_trains_with_the_weights_materialize_gives():
    """configure_model runs on the meta device; the graph path traces the shapes and materializes the stage under
    rank 0's seed (one process: the whole model), exactly as materialize() does."""
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=PipeDreamStrategy(schedule="1f1b"), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    module = GraphBuiltInConfigureModel()
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.0)  # weights stay as built
    trainer.fit(module, data)
    stage = trainer.strategy._pipeline.stage
    with torch.device("meta"):
        expected = GraphBuiltInConfigureModel()
        expected.configure_model()
    materialize(expected, torch.device("cpu"), torch.initial_seed())
    assert set(stage.state_dict()) == set(expected.state_dict())
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(stage.state_dict()[name], value, rtol=0, atol=0)


def test_init_module_with_empty_init_builds_on_the_meta_device_and_each_stage_materializes():
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=PipeDreamStrategy(schedule="1f1b"), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with trainer.init_module(empty_init=True):
        module = GraphBuiltInConfigureModel()
        module.configure_model()
    assert has_meta_tensors(module)  # nothing allocated yet
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4))
    assert not has_meta_tensors(trainer.strategy._pipeline.stage)


def test_a_sequential_on_the_meta_device_is_profiled_one_block_at_a_time():
    from lightning_pipedream.plan.profile import profile_module
    from lightning_pipedream.strategy.setup.planning import profile_block_by_block

    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8), NoReset3())

    with torch.device("meta"):
        layers = build()
    profile = profile_block_by_block(layers, torch.randn(4, 16), working_sets=True)
    assert has_meta_tensors(layers) and all(t.is_meta for t in layers.parameters())  # the model stays shapes only
    real = profile_module(build(), torch.randn(4, 16), working_sets=True)
    assert [layer.name for layer in profile.layers] == [layer.name for layer in real.layers]
    assert [layer.parameter_bytes for layer in profile.layers] == [layer.parameter_bytes for layer in real.layers]
    assert [layer.activation_bytes for layer in profile.layers] == [layer.activation_bytes for layer in real.layers]
    assert "one block at a time with random weights" in profile.source


class NoReset3(nn.Module):
    """A layer without reset_parameters(): profiled with random values of its shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.scale


class SequentialBuiltInConfigureModel(GraphBuiltInConfigureModel):
    """One nn.Sequential: the layer path."""

    def configure_model(self) -> None:
        if self.encoder is None:
            self.encoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    def forward(self, x):
        return self.encoder(x)


@pytest.mark.parametrize("module_class", [GraphBuiltInConfigureModel, SequentialBuiltInConfigureModel])
def test_pretrained_weights_load_into_either_path(tmp_path, module_class):
    reference = module_class()
    reference.configure_model()
    torch.save(reference.state_dict(), tmp_path / "weights.pt")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=PipeDreamStrategy(schedule="1f1b", pretrained=tmp_path / "weights.pt"))
    module = module_class()
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.0)  # weights stay as loaded
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4))
    held = trainer.strategy._pipeline.stage.state_dict()
    for name, value in reference.state_dict().items():
        stage_name = name.removeprefix("encoder.") if module_class is SequentialBuiltInConfigureModel else name
        torch.testing.assert_close(held[stage_name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("module_class", [GraphBuiltInConfigureModel, SequentialBuiltInConfigureModel])
def test_pretrained_with_a_model_built_on_real_weights_is_refused(tmp_path, module_class):
    module = module_class()
    module.configure_model()
    torch.save(module.state_dict(), tmp_path / "weights.pt")
    module.configure_model = lambda: None  # built already, with real weights
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=PipeDreamStrategy(schedule="1f1b", pretrained=tmp_path / "weights.pt"))
    with pytest.raises(ValueError, match=r"pretrained=...\) loads each stage's weights into a model built on the "
                                         r"meta device, but \w+BuiltInConfigureModel was built with real weights"):
        trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)),
                                                        batch_size=4))
