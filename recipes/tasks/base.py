"""The LightningModule shape the pipeline strategy expects: one `nn.Sequential` in `self.layers`, and
steps that call `self(x)` exactly once and reduce to a mean loss."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import nn

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


class RecipeTask(L.LightningModule):
    """Base of the four tasks. Subclasses name their quality metric and how to read it from logged values."""

    metric_name: str = "val_loss"
    metric_mode: str = "min"  # "max": higher is better

    def __init__(self, layers: nn.Sequential, optim: Mapping[str, Any]) -> None:
        super().__init__()
        self.layers = layers
        self.optim = dict(optim)

    @classmethod
    def from_data(cls, layers: nn.Sequential, optim: Mapping[str, Any], datamodule: Any,
                  **options: Any) -> RecipeTask:
        """Build the task for `layers`; subclasses take what they need from the data (e.g. the vocabulary) and the
        task config's own `options` (the language model's `samples`)."""
        if options:
            raise ValueError(f"task options {sorted(options)} are not known to {cls.__name__}; remove them from "
                             "the task config")
        return cls(layers, optim)

    def forward(self, x: Any) -> Any:
        return self.layers(x)

    def metric_from(self, logged: Mapping[str, Any]) -> float | None:
        """This task's quality metric from the epoch's logged values (None if it was not logged)."""
        value = logged.get(self.metric_name)
        return None if value is None else float(value)

    def held_out_metric(self, layers: nn.Sequential, datamodule: Any) -> float:
        """The task's quality metric of the whole model `layers` (in eval mode, one process) on the whole held-out
        set: the same number whatever strategy trained the weights (DDP would otherwise see half the set per rank)."""
        raise NotImplementedError

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.metric_mode == "max" else value <= target

    def configure_optimizers(self) -> Any:
        cfg = dict(self.optim)
        name = cfg.pop("name", "sgd")
        if name not in OPTIMIZERS:
            raise ValueError(f"optim.name={name!r} is not supported; choose one of: {', '.join(OPTIMIZERS)}")
        policy = cfg.pop("lr_policy", "constant")
        power = float(cfg.pop("lr_power", 1.0))
        optimizer = OPTIMIZERS[name](self.parameters(), **cfg)
        if policy == "constant":
            return optimizer
        if policy != "polynomial":
            raise ValueError(f"optim.lr_policy={policy!r} is not supported; choose constant or polynomial")
        total = max(1, int(self.trainer.estimated_stepping_batches))
        # PipeDream's 'polynomial' policy: lr * (1 - step / total) ** power
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / total) ** power)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class ClassificationTask(RecipeTask):
    """Image classification: cross-entropy, validation accuracy."""

    metric_name, metric_mode = "val_acc", "max"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("val_loss", loss)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())
        return loss

    @torch.no_grad()
    def held_out_metric(self, layers: nn.Sequential, datamodule: Any) -> float:
        """Accuracy over every validation sample."""
        correct = total = 0
        for x, y in datamodule.val_dataloader():
            correct += int((layers(x).argmax(-1) == y).sum())
            total += len(y)
        return correct / max(1, total)


@dataclass(frozen=True)
class SampleOptions:
    """The language model's samples (`task.samples` in conf/task/language_model.yaml): after each validation,
    continuations of `count` fixed prompts of `prompt` held-out tokens, `length` new tokens each; greedy, or sampled
    at `temperature` (> 0) from the `top_k` likeliest tokens with a generator seeded with `seed`."""

    count: int = 0
    prompt: int = 24
    length: int = 48
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or self.count < 0:
            raise ValueError(f"task.samples.count must be an integer >= 0 (0: no samples), got {self.count!r}")
        for key in ("prompt", "length"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"task.samples.{key} must be an integer >= 1, got {getattr(self, key)!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"task.samples.temperature must be >= 0 (0: greedy), got {self.temperature!r}")


class LanguageModelTask(RecipeTask):
    """Next-token prediction; the metric is perplexity, exp of the mean cross-entropy over the held-out text.

    Layers with a `reset_state()` (AWD-LSTM with `carry_state`) carry their hidden state from one training batch to
    the next (truncated backpropagation through time); it starts from zeros at each epoch, as in the AWD-LSTM code.

    With `samples` (:class:`SampleOptions`), :meth:`held_out_samples` continues fixed held-out prompts with
    ``lightning_pipedream.generate``: under a straight PipeDreamStrategy through the pipeline's decode ring (every
    rank its own stage, nothing gathered), otherwise on one device; the recipes print them and write them to
    `samples.txt` after each validation (recipes/results.py).
    """

    metric_name, metric_mode = "perplexity", "min"
    eval_streams = 10  # AWD-LSTM evaluates the validation text as 10 parallel streams

    def __init__(self, layers: nn.Sequential, optim: Mapping[str, Any], itos: Sequence[str] | None = None,
                 joiner: str = " ", samples: Mapping[str, Any] | None = None) -> None:
        super().__init__(layers, optim)
        self.itos = list(itos) if itos is not None else None
        self.joiner = joiner  # between tokens in the samples' text: "" for characters
        self.samples = SampleOptions(**dict(samples or {}))

    @classmethod
    def from_data(cls, layers: nn.Sequential, optim: Mapping[str, Any], datamodule: Any,
                  **options: Any) -> RecipeTask:
        vocab = getattr(datamodule, "vocab", None)
        joiner = "" if getattr(datamodule, "level", "word") == "char" else " "
        return cls(layers, optim, vocab.itos if vocab is not None else None, joiner, **options)

    def sample_prompts(self, datamodule: Any) -> torch.Tensor:
        """`samples.count` prompts of `samples.prompt` tokens, evenly spaced over the held-out text (the same ones
        at every validation and on every rank)."""
        inputs, targets = datamodule.val_set.tensors
        stream = torch.cat([inputs.flatten(), targets[-1, -1:]])
        size, count = self.samples.prompt, self.samples.count
        if len(stream) < size:
            raise ValueError(f"task.samples.prompt={size} is longer than the held-out text ({len(stream)} tokens)")
        starts = torch.linspace(0, len(stream) - size, count).long().tolist() if count > 1 else [0]
        return torch.stack([stream[s:s + size] for s in starts])

    @torch.no_grad()
    def held_out_samples(self, datamodule: Any, layers: nn.Module | None = None) -> list[tuple[str, str]]:
        """(prompt, continuation) text of each sample, decoded by ``lightning_pipedream.generate``: of this module
        (under PipeDreamStrategy every rank must call it: the pipeline's decode ring), or of the whole model `layers`
        in this process. Empty with `samples.count` 0."""
        from lightning_pipedream import generate

        options = self.samples
        if options.count == 0:
            return []
        prompts = self.sample_prompts(datamodule)
        sampling = options.temperature > 0
        model: nn.Module = self if layers is None else layers
        ids = generate(model, prompts, max_new_tokens=options.length, pad_token_id=0, eos_token_id=None,
                       do_sample=sampling, temperature=options.temperature if sampling else 1.0,
                       top_k=options.top_k, generator=torch.Generator().manual_seed(options.seed) if sampling else None,
                       forward=(lambda rows, tokens: self.layers(tokens)) if layers is None else None)
        return [(self.text(row[:options.prompt]), self.text(row[options.prompt:])) for row in ids.tolist()]

    def text(self, ids: Sequence[int]) -> str:
        """Tokens as text (ids themselves without a vocabulary)."""
        if self.itos is None:
            return " ".join(str(i) for i in ids)
        return self.joiner.join(self.itos[i] for i in ids)

    def on_train_epoch_start(self) -> None:
        # every rank resets the layers it holds (also dropping states left by the strategy's profiling forwards)
        reset_states(self.layers)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # every rank reads the batch: its rows are what micro-batches of stateful layers take in turn
        set_batch_rows(self.layers, int(batch[0].size(0)))

    @torch.no_grad()
    def held_out_metric(self, layers: nn.Sequential, datamodule: Any) -> float:
        """Perplexity of the held-out text read in order as `eval_streams` streams, the hidden state carried from
        each window to the next (AWD-LSTM's evaluate())."""
        inputs, targets = datamodule.val_set.tensors
        stream = torch.cat([inputs.flatten(), targets[-1, -1:]])
        streams = min(self.eval_streams, max(1, (len(stream) - 1) // inputs.size(1)))
        length = (len(stream) - 1) // streams
        x = stream[: streams * length].view(streams, length)
        y = stream[1 : streams * length + 1].view(streams, length)
        carrying = set_carry_in_eval(layers, True)
        reset_states(layers)
        total, count = 0.0, 0
        try:
            for start in range(0, length, inputs.size(1)):
                window = slice(start, start + inputs.size(1))
                logits = layers(x[:, window])
                total += float(nn.functional.cross_entropy(logits.flatten(0, 1), y[:, window].flatten(),
                                                           reduction="sum"))
                count += y[:, window].numel()
        finally:
            reset_states(layers)
            set_carry_in_eval(layers, carrying)
        return math.exp(min(total / max(1, count), 50.0))

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss)
        return loss

    def metric_from(self, logged: Mapping[str, Any]) -> float | None:
        value = logged.get("val_loss")
        return None if value is None else math.exp(min(float(value), 50.0))


def reset_states(layers: nn.Module) -> None:
    """Forget the hidden state that stateful layers carry between batches."""
    for module in layers.modules():
        if hasattr(module, "reset_state"):
            module.reset_state()


def set_batch_rows(layers: nn.Module, rows: int) -> None:
    """Tell stateful layers how many rows each whole batch has on this process (micro-batches take them in turn)."""
    for module in layers.modules():
        if hasattr(module, "set_rows"):
            module.set_rows(rows)


def set_carry_in_eval(layers: nn.Module, on: bool) -> bool:
    """Make stateful layers carry their state in eval mode too (held-out evaluation); returns the previous setting."""
    before = False
    for module in layers.modules():
        if hasattr(module, "carry_in_eval"):
            before, module.carry_in_eval = module.carry_in_eval, on
    return before
