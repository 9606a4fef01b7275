"""A training batch enters the strategy class once and leaves it once: while ``training_step`` runs (forwards,
backwards, the precision plugin's optimizer step, clipping, the summary, the logs), no other method the class defines
is called; the step's work lives in ``Training`` and ``TrainingStep``."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipedream import PipeDreamStrategy
from lightning_pipedream.strategy.training.training import Training


class Logged(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Route:
    """Wraps every method ``PipeDreamStrategy`` itself defines; records those entered inside ``training_step``."""

    def __init__(self, strategy: PipeDreamStrategy) -> None:
        self.depth = 0
        self.inside: list[str] = []
        self.steps = 0
        for name, member in vars(PipeDreamStrategy).items():
            if inspect.isfunction(member) and name != "__init__":
                setattr(strategy, name, self._watch(name, getattr(strategy, name)))

    def _watch(self, name: str, method: Any) -> Any:
        @functools.wraps(method)
        def watched(*args: Any, **kwargs: Any) -> Any:
            if name == "training_step":
                self.steps += 1
            elif self.depth:
                self.inside.append(name)
            self.depth += name == "training_step"
            try:
                return method(*args, **kwargs)
            finally:
                self.depth -= name == "training_step"
        return watched


def _fit(module: L.LightningModule, tmp_path) -> tuple[PipeDreamStrategy, Route, L.Trainer]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(24, 4), torch.randint(0, 2, (24,)))
    strategy = PipeDreamStrategy(schedule="1f1b", chunks=2)
    route = Route(strategy)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, gradient_clip_val=0.5,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(data, batch_size=6))
    return strategy, route, trainer


def test_a_training_batch_enters_the_strategy_once_and_leaves_it_once(tmp_path):
    strategy, route, trainer = _fit(Logged(), tmp_path)
    assert route.steps == 8
    assert route.inside == [], f"the step came back into the strategy class through {sorted(set(route.inside))}"
    assert isinstance(strategy._training, Training)
    assert trainer.callback_metrics["train_loss"].isfinite()


class CallsBack(Logged):
    """A planted detour: the step calls back into the strategy."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trainer.strategy.drain()
        return super().training_step(batch, batch_idx)


def test_the_route_check_sees_a_planted_detour(tmp_path):
    _, route, _ = _fit(CallsBack(), tmp_path)
    assert set(route.inside) == {"drain"} and len(route.inside) >= route.steps == 8
