"""Models that are not one nn.Sequential, trained by a Trainer: `python graph_trainer.py OUT_DIR JSON_OPTIONS`.

The LightningModule wraps one of the graph test families (tests/helpers/graph_models.py): an
nn.Transformer LM with two inputs, a ResNet, a GPT with tied embeddings, an LSTM LM with a tied decoder, and a
Hugging Face-style LM called as `self(input_ids, labels=labels).loss` whose output dataclass holds a cache.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))  # the libraries the tests share
from graph_models import batches, loss_fn, make, padded, tied_sequential_lstm  # noqa: E402
from script_runs import main_runs, refuse_unused, trainer_args, write_json  # noqa: E402

from lightning_pipedream import PipeDreamStrategy
from lightning_pipedream.runtime.stages.graph_stage import CapturedStage


class FamilyModule(L.LightningModule):
    def __init__(self, family: str, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model, _ = make(family)  # seeded: every process builds the same weights

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(*args)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        args, targets = batch
        loss = loss_fn(self(*args), targets)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        args, targets = batch
        self.log("val_loss", loss_fn(self(*args), targets))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class HFStyleModule(FamilyModule):
    """The usual Hugging Face training step: the model computes its own (token-mean) loss from the labels.
    ``skip_batch``: training_step returns None for that batch (Lightning's way to skip it); ``own_loss``: the step
    computes the token mean itself from the logits."""

    def __init__(self, family: str, lr: float = 0.1, skip_batch: int | None = None, scheduler: bool = False,
                 own_loss: bool = False) -> None:
        super().__init__(family, lr)
        self.save_hyperparameters()  # skip_batch, scheduler and own_loss too

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        return self.model(input_ids, labels=labels)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        (input_ids,), labels = batch
        if self.hparams.own_loss:  # the token mean computed here, from labels the strategy does not see as such
            logits = self(input_ids).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                                     ignore_index=-100)
        else:
            loss = self(input_ids, labels=labels).loss
        if batch_idx == self.hparams.skip_batch:
            return None
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (input_ids,), labels = batch
        self.log("val_loss", self(input_ids, labels=labels).loss)

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        if not self.hparams.scheduler:
            return optimizer
        # The rate halves every 2 steps: a scheduler stepped per optimizer step, which every rank must follow.
        step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": step, "interval": "step"}}


class TiedSequentialLM(FamilyModule):
    """The LSTM LM as one nn.Sequential whose embedding (first layer) and decoder (last) share their weight: the
    strategy splits it between layers, the tie across stages."""

    def __init__(self, family: str = "lstm", lr: float = 0.1) -> None:
        super(FamilyModule, self).__init__()
        self.save_hyperparameters()
        self.layers = tied_sequential_lstm()

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.layers(*args)


def labelled_tokens(batch: Any) -> torch.Tensor:
    """What a token-mean loss averages over: the labels that are not padding (-100)."""
    return (batch[1] != -100).sum()


def captured_stage(strategy: Any) -> CapturedStage | None:
    """The strategy's graph-path stage (this rank's captures), wherever the strategy keeps it."""
    graph_path = getattr(getattr(strategy, "_pipeline", None), "graph", None)  # StagePipeline.graph: GraphPath
    return getattr(graph_path, "graph", None)


class DataDependent(FamilyModule):
    """A forward whose Python control flow depends on the data: no graph can stand for it."""

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if args[0].float().mean() > 1000:  # a branch on a value
            return self.model(args[0].flip(1))
        return self.model(*args)


class Batches:
    """A fixed list of batches (a plain iterable: Lightning leaves it as it is)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


def train(out: str, options: dict[str, Any]) -> None:
    """One training run written to ``out``: final.ckpt, and metrics.json on rank 0."""
    os.makedirs(out, exist_ok=True)
    family = options.pop("family")
    torch.set_num_threads(1)  # the same kernels' reduction order in every run, whatever the process count
    module_class = {"untraceable": DataDependent, "hf": HFStyleModule, "tied_sequential": TiedSequentialLM}.get(
        options.pop("module", ""), FamilyModule)
    if options.pop("untraceable", False):
        module_class = DataDependent
    model = module_class(family, **options.pop("model", {}))
    epochs = options.pop("epochs", None)
    args = trainer_args(
        devices=options.pop("devices", 1), max_steps=options.pop("steps", 3 if not epochs else -1),
        max_epochs=epochs, num_sanity_val_steps=0, limit_val_batches=options.pop("limit_val_batches", 0),
        gradient_clip_val=options.pop("clip", None),
    )
    strategy = options.pop("strategy", None)
    if strategy is not None:
        if strategy.get("mean_over") == "labelled_tokens":
            strategy["mean_over"] = labelled_tokens
        args["strategy"] = PipeDreamStrategy(**strategy)
    trainer = L.Trainer(**args)
    # Batches of these sizes (the last ones may be smaller than chunks), or 3 of batch_size.
    sizes = options.pop("sizes", [options.pop("batch_size", 4)] * 3)
    val_sizes = options.pop("val_sizes", [sizes[0]])
    train_data = [b for n in sizes for b in batches(family, 1, n)] if len(set(sizes)) > 1 else batches(
        family, len(sizes), sizes[0])
    val_data = [batches(family, 1, n)[0] for n in val_sizes]
    if options.pop("padded", False):  # token-mean losses over unequal numbers of tokens per sample
        train_data, val_data = padded(train_data), padded(val_data, seed=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, Batches(train_data), Batches(val_data), ckpt_path=options.pop("resume", None))
    trainer.save_checkpoint(os.path.join(out, "final.ckpt"))
    if options.pop("also_full", False):  # the same state as one file too (checkpoint="sharded" wrote final.ckpt)
        trainer.strategy.checkpoints.mode = "full"
        trainer.save_checkpoint(os.path.join(out, "final-full.ckpt"))
    if trainer.is_global_zero:
        metrics: dict[str, Any] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        metrics["global_step"] = trainer.global_step
        graph = captured_stage(trainer.strategy)
        if graph is not None:  # the first capture of this run: its cost, and whether the cache served it
            metrics.update(capture_s=graph.capture_s, capture_cached=graph.cached, split_points=graph.split_points)
        metrics["warnings"] = sorted({str(w.message) for w in caught if "PipeDreamStrategy" in str(w.message)})
        write_json(os.path.join(out, "metrics.json"), metrics)
    refuse_unused(options)


if __name__ == "__main__":
    main_runs(train)
