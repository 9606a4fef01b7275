"""An MLP trained by a real Trainer (any strategy) for the exactness tests: `python rule_trainer.py OUT_DIR JSON_OPTIONS`.

The same model, data and hyperparameter tables are imported by the tests, which build the
single-process reference (tests/helpers/pipedream_reference.py) from them.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))  # the libraries the tests share
from lightning.pytorch.plugins.precision import MixedPrecision
from script_runs import main_runs, refuse_unused, trainer_args, write_json  # noqa: E402
from torch import nn

from lightning_pipedream import PipeDreamStrategy
from lightning_pipedream.runtime.communication.transport import TRANSPORT_ENV
from lightning_pipedream.strategy.checkpoints.checkpoint import AtomicCheckpointIO

INPUTS, WIDTH, OUTPUTS = 4, 8, 2


class RuleMLP(L.LightningModule):
    """7 layers (Linear/Tanh), MSE; SGD, SGD with momentum or Adam; optional per-step scheduler. ``deeper``: that
    many more (Linear, Tanh) pairs before the output layer (7 + 2 * deeper layers, for runs of many model chunks)."""

    def __init__(self, optimizer: str = "sgd", lr: float = 0.2, scheduler: str | None = None,
                 blow_up_at: int | None = None, overflow_at: int | None = None,
                 overflow_unit_at: int | None = None, deeper: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        more = [layer for _ in range(deeper) for layer in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]
        self.layers = nn.Sequential(
            nn.Linear(INPUTS, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
            nn.Linear(WIDTH, WIDTH), nn.Tanh(), *more, nn.Linear(WIDTH, OUTPUTS),
        )
        if overflow_at is not None:  # a planted overflow in the first layer's gradient only (stage 0's) at that step
            self.layers[0].weight.register_hook(self._overflow)
        if overflow_unit_at is not None:  # only the first layer's first output unit's: row 0 of its weight's gradient,
            self.layers[0].register_forward_hook(self._overflow_first_unit)  # which one sharded replica holds

    def _overflow(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf") if self.trainer.global_step == self.hparams.overflow_at else grad

    def _overflow_first_unit(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if self.trainer.global_step == self.hparams.overflow_unit_at and output.requires_grad:
            output.register_hook(lambda g: torch.cat([g[:, :1] * float("inf"), g[:, 1:]], dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.current_epoch == 0 and batch_idx == self.hparams.blow_up_at:
            loss = loss * 1e4  # a planted blow-up: this batch's gradient throws the weights far off
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer(self.hparams.optimizer, self.hparams.lr, list(self.parameters()))
        if self.hparams.scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": make_scheduler(self.hparams.scheduler, optimizer),
                                                         "interval": "step"}}


def make_optimizer(kind: str, lr: float, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(kind)


def make_scheduler(kind: str, optimizer: torch.optim.Optimizer) -> Any:
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    raise ValueError(kind)


def batches(count: int, size: int = 8, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(size, INPUTS, generator=g)
        out.append((x, torch.stack([x[:, 0] * x[:, 1], x[:, 2].sin()], dim=1)))
    return out


class ResumableBatches:
    """A fixed list of batches that Lightning can resume in the middle (it has state_dict/load_state_dict)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.position = 0  # batches of the current pass handed out so far
        self._resume_at = 0  # where the next pass starts: 0, or the position a checkpoint recorded

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        start, self._resume_at = self._resume_at, 0
        for i in range(start, len(self.items)):
            self.position = i + 1
            yield self.items[i]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self._resume_at = state["position"] % len(self.items)


class KillDuringSave(AtomicCheckpointIO):
    """Dies (SIGKILL) halfway through writing its n-th checkpoint: a process killed while it saves."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.saves = n, 0

    def _write(self, path: str, data: bytes) -> None:
        self.saves += 1
        if self.saves == self.n:
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        super()._write(path, data)


class StopAt(L.Callback):
    """Asks the Trainer to stop after a given number of batches (a callback's should_stop, mid-epoch)."""

    def __init__(self, batches: int) -> None:
        self.batches, self.seen = batches, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1
        if self.seen == self.batches:
            trainer.should_stop = True


class InterruptAt(L.Callback):
    """Raises KeyboardInterrupt (or an error) on one rank at a given batch: a user pressing Ctrl+C, a crash."""

    def __init__(self, batch: int, rank: int, error: str) -> None:
        self.batch, self.rank, self.error = batch, rank, error

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch and trainer.global_rank == self.rank:
            raise KeyboardInterrupt() if self.error == "interrupt" else RuntimeError("crash in a callback")


class Unfreeze(L.Callback):
    """Freezes the first layer at the start and unfreezes it at a given epoch (requires_grad toggling)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        for p in pl_module.layers[0].parameters():
            p.requires_grad_(trainer.current_epoch >= self.epoch)


def train(out: str, options: dict[str, Any]) -> None:
    """One training run, written to ``out``: final.ckpt, and result.json on rank 0."""
    os.makedirs(out, exist_ok=True)
    L.seed_everything(0, verbose=False)
    model = RuleMLP(**options.pop("model", {}))
    weight_dtypes: set[str] = set()
    if options.pop("record_weight_dtypes", False):  # the dtype of each weight as its layer's forward sees it
        for layer in model.layers:
            if hasattr(layer, "weight"):  # a pre-hook runs after FSDP2's (prepended) gather: the gathered weight
                layer.register_forward_pre_hook(lambda layer, args: weight_dtypes.add(str(layer.weight.dtype)))
    strategy = options.pop("strategy", None)
    callbacks: list[L.Callback] = []
    if "stop_at" in options:
        callbacks.append(StopAt(options.pop("stop_at")))
    if "interrupt" in options:
        callbacks.append(InterruptAt(**options.pop("interrupt")))
    if "unfreeze_at_epoch" in options:
        callbacks.append(Unfreeze(options.pop("unfreeze_at_epoch")))
    if "early_stopping" in options:  # EarlyStopping keyword arguments
        callbacks.append(L.pytorch.callbacks.EarlyStopping(**options.pop("early_stopping")))
    if options.pop("on_exception_checkpoint", False):
        callbacks.append(L.pytorch.callbacks.OnExceptionCheckpoint(dirpath=out))
    checkpoint = None
    if "checkpoint" in options:  # ModelCheckpoint keyword arguments
        checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=out, **options.pop("checkpoint"))
        callbacks.append(checkpoint)
    args = trainer_args(
        devices=options.pop("devices", 1), max_epochs=2, enable_checkpointing=checkpoint is not None,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
    )
    if "fp16" in options:  # 16-mixed with a gradient scaler (GradScaler keyword arguments)
        scaler = torch.amp.GradScaler("cpu", **options.pop("fp16"))
        args["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    if strategy is not None:
        if "kill_during_save" in options:
            strategy = {**strategy, "checkpoint_io": KillDuringSave(options.pop("kill_during_save"))}
        args["strategy"] = PipeDreamStrategy(**strategy)
    args.update(options.pop("trainer", {}))
    trainer = L.Trainer(**args)
    items = batches(options.pop("batches", 6))
    merge = options.pop("merge", 1)  # every `merge` batches as one (for minibatches_per_batch=merge)
    items = [tuple(torch.cat(column) for column in zip(*items[i : i + merge])) for i in range(0, len(items), merge)]
    pipelines = options.pop("pipelines", 1)
    if pipelines > 1:  # data-parallel pipelines: pipeline k reads rows k, k + d, ... of every batch (its shard)
        shard = int(os.environ.get("LOCAL_RANK", 0)) % pipelines  # stage-major ranks: rank % d is the pipeline
        items = [(x[shard::pipelines], y[shard::pipelines]) for x, y in items]
    train = ResumableBatches(items)
    val = ResumableBatches(batches(2, seed=9))
    # "directional": the transport GPUs take (each direction of a link on a process group of its own), over gloo.
    # Set for every run, on every rank: the other ranks are started during the first run and inherit its environment.
    os.environ[TRANSPORT_ENV] = options.pop("transport", "auto")
    trainer.fit(model, train, val, ckpt_path=options.pop("resume", None))
    pipeline = getattr(trainer.strategy, "_pipeline", None)
    trainer.save_checkpoint(os.path.join(out, "final.ckpt"))
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:  # every rank's loss scale: they must agree
        with open(os.path.join(out, f"scale{trainer.global_rank}.txt"), "w") as f:
            f.write(str(scaler.get_scale()))
    if trainer.is_global_zero:
        result = {
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "checkpoints": {os.path.basename(k): float(v) for k, v in checkpoint.best_k_models.items()}
            if checkpoint is not None else {},
            "directional": bool(pipeline is not None and pipeline.engine.transport.directional),
            "weight_dtypes": sorted(weight_dtypes),  # rank 0's layers' (stage 0's), when recorded
        }
        write_json(os.path.join(out, "result.json"), result)
    refuse_unused(options)


if __name__ == "__main__":
    main_runs(train)
