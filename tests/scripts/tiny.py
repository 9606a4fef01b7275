"""A tiny LightningModule trained by the strategy tests in a subprocess: `python tiny.py OUT_DIR JSON_OPTIONS`.

Its parts serve the other Trainer scripts beside it too (hang_trainer.py, setup_fault_trainer.py): the base
``SequentialClassifier``, its layers (``mlp``) and its data (``data``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torchmetrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))  # the libraries the tests share
from script_runs import main_runs, refuse_unused, trainer_args, write_json  # noqa: E402
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipedream  # noqa: F401  (registers the strategy names)
from lightning_pipedream import PipeDreamStrategy


class SequentialClassifier(L.LightningModule):
    """Layers in one nn.Sequential (``self.layers``), cross-entropy over 4 classes, plain SGD (lr 0.1): the model of
    the fault scripts, and TinyClassifier's base. A subclass builds ``self.layers``."""

    layers: nn.Sequential | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def loss(self, batch: tuple) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def mlp(width: int = 16, hidden: int = 1) -> nn.Sequential:
    """8 inputs, ``hidden`` blocks of Linear(width, width) and Tanh, 4 outputs."""
    blocks = [layer for _ in range(hidden) for layer in (nn.Linear(width, width), nn.Tanh())]
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), *blocks, nn.Linear(width, 4))


class TinyClassifier(SequentialClassifier):
    def __init__(self, width: int = 16, lr: float = 0.1, single_layer: bool = False, scheduler: bool = True,
                 build_in_configure_model: bool = False, hidden: int = 1, optimizer: str = "momentum",
                 reads_training_data: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.layers = None if build_in_configure_model else self._build()
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)
        self.built_bytes = None  # bytes of real (not meta) parameters right after configure_model built the layers

    def _build(self) -> nn.Sequential:
        if self.hparams.single_layer:
            return nn.Sequential(nn.Linear(8, 4))
        return mlp(self.hparams.width, self.hparams.hidden)

    def configure_model(self):
        if self.layers is None:  # Lightning calls this before every fit/validate/...: build once
            self.layers = self._build()
            self.built_bytes = sum(p.numel() * p.element_size() for p in self.parameters() if not p.is_meta)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", self.val_acc)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch))

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        if self.hparams.reads_training_data:  # as a one-cycle scheduler's total_steps does; the value is not used
            assert self.trainer.estimated_stepping_batches > 0
        if self.hparams.optimizer == "adam":
            opt: torch.optim.Optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        if not self.hparams.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": sched}


def data(n: int = 60) -> TensorDataset:
    """``n`` samples of 8 features labelled by the largest of the first 4, the same on every rank and in every run."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].argmax(-1)).long()
    return TensorDataset(x, y)


class OnThirdCall(nn.Module):
    """A layer that passes its input on, but for its third forward (``third``): in the middle of training."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.third(x) if self.calls == 3 else x

    def third(self, x):
        raise NotImplementedError


class FailOnThirdCall(OnThirdCall):
    """Raises on its third forward: a stage failing in the middle of training."""

    def third(self, x):
        raise ValueError("boom on the third forward")


class NaNOnThirdCall(OnThirdCall):
    """Its third forward outputs NaN: a numerical blow-up in the middle of training."""

    def third(self, x):
        return x * float("nan")


class LossRecorder(L.Callback):
    """Writes every step's logged training loss (rank 0) and this rank's share of the model."""

    def __init__(self, out: str) -> None:
        self.out, self.losses = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.callback_metrics.get("train_loss")  # pipedream logs minibatch t at step t + stages - 1
        self.losses.append(None if loss is None else float(loss))

    def on_train_end(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        share = {
            "parameters": sum(p.numel() for p in pl_module.parameters()),
            "optimizer_parameters": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
            "optimizer_state_tensors": sum(
                v.numel() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
            ),
            "losses": self.losses,
            "built_bytes": pl_module.built_bytes,
            "plan_replicas": [st.replicas for st in plan.stages] if (plan := getattr(trainer.strategy, "plan", None))
            else None,
            # What the strategy ran (schedule="auto" decides it in setup).
            "options": {k: getattr(getattr(trainer.strategy, "options", None), k, None)
                        for k in ("schedule", "chunks", "recompute", "virtual_stages")},
            "balance": getattr(trainer.strategy, "balance", None),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in pl_module.parameters() if not p.is_meta),
            # The process groups of data-parallel pipelines: which ranks each rank all-reduces and pipelines with.
            "groups": {name: _members(getattr(getattr(trainer.strategy, "process_groups", None), field, None))
                       for name, field in (("replica", "replicas"), ("pipeline", "pipeline"))},
        }
        write_json(os.path.join(self.out, f"rank{trainer.global_rank}.json"), share)


COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "barrier", "monitored_barrier", "gather", "scatter", "all_to_all",
               "all_to_all_single", "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")


class CollectiveCounter(L.Callback):
    """Counts torch.distributed collective calls (and their groups' sizes) from one batch's end to the next's:
    Lightning's loop between batches, the data, the strategy's training step and the hooks."""

    def __init__(self, out: str) -> None:
        self.out, self.calls, self.per_step = out, [], []
        for module in (torch.distributed, torch.distributed.distributed_c10d):
            for name in COLLECTIVES:
                setattr(module, name, self._counted(name, getattr(torch.distributed.distributed_c10d, name)))

    def _counted(self, name, function):
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            size = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1
            self.calls.append(f"{name}/{size}")
            return function(*args, **kwargs)
        return counted

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.per_step.append(self.calls)
        self.calls = []

    def on_train_end(self, trainer, pl_module):
        write_json(os.path.join(self.out, f"collectives_rank{trainer.global_rank}.json"), self.per_step)


def _members(group) -> list[int] | None:
    return None if group is None else sorted(torch.distributed.get_process_group_ranks(group))


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


class KilledInSecondSave(L.Callback):
    """Saves the sharded checkpoint ``last.ckpt`` at the end of epoch 0 (and the same state as ``first.ckpt``, for the
    test to compare with), and again at the end of epoch 1, where rank ``rank`` writes its data files, says so
    (``marker``) and waits to be killed: the test kills every process while the new checkpoint is half written."""

    def __init__(self, out: str, rank: int, marker: str) -> None:
        self.out, self.rank, self.marker = out, rank, marker

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        last = os.path.join(self.out, "last.ckpt")
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(last)
            trainer.save_checkpoint(os.path.join(self.out, "first.ckpt"))
        elif trainer.current_epoch == 1:
            if trainer.global_rank == self.rank:
                self._stop_after_writing()
            trainer.save_checkpoint(last)

    def _stop_after_writing(self) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        write_data, marker = FileSystemWriter.write_data, self.marker

        def written_then_stopped(writer: Any, plan: Any, planner: Any) -> Any:
            done = write_data(writer, plan, planner)
            done.wait()  # this rank's files are on disk; the other ranks wait for it to finish the save
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)  # killed here by the test (its own limit ends it otherwise)
            return done

        FileSystemWriter.write_data = written_then_stopped  # type: ignore[method-assign]


def measure_saves(trainer: L.Trainer, out: str) -> None:
    """Each rank's resident peak raised by a sharded save, then by a full one (one file, written stage by stage),
    with the whole model's bytes and this rank's stage's (its weights and optimizer state): rank{r}_saves.json."""
    import torch.distributed.checkpoint  # noqa: F401  (its import is not the save's memory)

    checkpoints = trainer.strategy.checkpoints
    checkpoints.mode = "sharded"
    trainer.save_checkpoint(os.path.join(out, "warm.ckpt"))  # first-call costs (planner caches, gloo buffers)
    growth = {}
    for mode in ("sharded", "full"):
        checkpoints.mode = mode
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS: the peak from here on
        before = _status_bytes("VmRSS")
        trainer.save_checkpoint(os.path.join(out, f"{mode}.ckpt"))
        growth[mode] = _status_bytes("VmHWM") - before
    module, optimizer = trainer.strategy.lightning_module, trainer.optimizers[0]
    own = [p for p in module.parameters() if not p.is_meta and p.device.type != "meta"]
    own = [p for p in own if any(p is q for g in optimizer.param_groups for q in g["params"])]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    write_json(os.path.join(out, f"rank{trainer.global_rank}_saves.json"),
               {**growth, "model_bytes": checkpoints.model_bytes,
                "stage_bytes": sum(t.numel() * t.element_size() for t in [*own, *state])})


def measure_live(trainer: L.Trainer, out: str) -> None:
    """Per rank, the tensor bytes a sharded save added at its peak, then reading that checkpoint back (model and
    optimizer state, as a resume does), then a full save (which gathers): LiveTensorBytes counts every tensor an
    operator makes until it dies, above what this rank held before (its parameters, gradients and optimizer state,
    counted first: a view of them is not new memory). With this rank's own bytes and what its stage holds whole:
    rank{r}_live.json."""
    import torch.distributed.checkpoint  # noqa: F401  (its import is not the save's memory)
    from torch.distributed.tensor import DTensor

    from lightning_pipedream.plan.live_bytes import LiveTensorBytes
    from lightning_pipedream.runtime.stages.sharding import local_bytes

    strategy = trainer.strategy
    checkpoints, module, optimizer = strategy.checkpoints, strategy.lightning_module, trainer.optimizers[0]

    def held() -> list[torch.Tensor]:
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return [*module.parameters(), *(p.grad for p in module.parameters() if p.grad is not None), *state,
                *module.buffers()]

    def added(action) -> int:
        with LiveTensorBytes() as meter:
            meter.add_all(held())
            base = meter.live
            meter.reset_peak()
            action()
        return meter.peak - base

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def shards() -> dict[str, torch.Tensor]:  # this rank's pieces of its weights and Adam's state, by name
        names = {id(p): n for n, p in module.named_parameters()}
        out = {n: local(p).detach() for n, p in module.named_parameters()}
        out.update({f"{names[id(p)]}/{k}": local(v) for p, s in optimizer.state.items() for k, v in s.items()})
        return out

    def read_back() -> None:  # what a resume does once the stage exists
        loaded = strategy.load_checkpoint(os.path.join(out, "live-sharded.ckpt"))
        strategy.load_model_state_dict(loaded)
        checkpoints.after_setup(strategy._pipeline)
        strategy.load_optimizer_state_dict(loaded)

    checkpoints.mode = "sharded"
    trainer.save_checkpoint(os.path.join(out, "live-warm.ckpt"))  # first-call costs (planner caches, gloo buffers)
    result: dict[str, Any] = {
        "sharded_save": added(lambda: trainer.save_checkpoint(os.path.join(out, "live-sharded.ckpt")))}
    saved = {k: v.clone() for k, v in shards().items()}
    with torch.no_grad():
        for t in shards().values():  # what the read must bring back (zero: Adam's step count too)
            t.zero_()
    result["sharded_load"] = added(read_back)
    back = shards()
    result["read_back_exact"] = sorted(back) == sorted(saved) and all(torch.equal(back[k], v) for k, v in saved.items())
    result["read_back_nonzero"] = all(bool(v.any()) for v in saved.values() if v.numel())
    checkpoints.mode = "full"
    result["full_save"] = added(lambda: trainer.save_checkpoint(os.path.join(out, "live-full.ckpt")))
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    params = list(module.parameters())
    whole = sum(t.numel() * t.element_size() for t in [*params, *state])  # DTensor: its global shape
    result.update(own_bytes=local_bytes(params) + local_bytes(state), stage_bytes=whole,
                  sharded=any(isinstance(p, DTensor) for p in params))
    write_json(os.path.join(out, f"rank{trainer.global_rank}_live.json"), result)


def train(out: str, options: dict) -> None:
    """One training run in ``out`` (its working directory too): final.ckpt, rank{r}.json, metrics.json on rank 0."""
    os.makedirs(out, exist_ok=True)
    os.chdir(out)
    L.seed_everything(0, verbose=False)
    model = TinyClassifier(**options.pop("model", {}))
    if options.pop("nan_in_last_layer", False):
        model.layers.append(NaNOnThirdCall())
    if options.pop("fail_in_last_layer", False):
        model.layers.append(FailOnThirdCall())
    strategy = options.pop("strategy", None)
    if isinstance(strategy, dict):
        strategy = PipeDreamStrategy(**strategy)
    args = trainer_args(
        devices=options.pop("devices", 1), max_steps=options.pop("max_steps", 3),
        limit_val_batches=options.pop("limit_val_batches", 0), num_sanity_val_steps=0,
        # Lightning shuffles training data under multi-process strategies; compare like with like.
        use_distributed_sampler=False,
    )
    if strategy is not None:
        args["strategy"] = strategy
    callbacks = [LossRecorder(out)]
    if options.pop("count_collectives", False):
        callbacks.append(CollectiveCounter(out))
    if options.pop("checkpoint_every_epoch", False):
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=out, every_n_epochs=1, save_top_k=-1))
        args["enable_checkpointing"] = True
    if "killed_in_second_save" in options:  # {"rank": r, "marker": path}
        callbacks.append(KilledInSecondSave(out, **options.pop("killed_in_second_save")))
    if "monitor" in options:  # ModelCheckpoint and EarlyStopping on a metric logged by the last stage
        monitor = options.pop("monitor")
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=out, monitor=monitor, mode="max", save_top_k=1))
        callbacks.append(L.pytorch.callbacks.EarlyStopping(monitor=monitor, mode="max", patience=1, min_delta=1.0))
        args["enable_checkpointing"] = True
    args["callbacks"] = callbacks
    args.update(options.pop("trainer", {}))
    trainer = L.Trainer(**args)
    shuffle = options.pop("shuffle_per_rank", False)  # a deliberately wrong setup: each rank its own order
    generator = torch.Generator().manual_seed(int(os.environ.get("LOCAL_RANK", 0))) if shuffle else None
    batch_size = options.pop("batch_size", 12)
    train = DataLoader(data(), batch_size=batch_size, shuffle=shuffle, generator=generator)
    if options.pop("shuffle", False):  # Lightning's default: it puts a seeded DistributedSampler in
        train = DataLoader(data(), batch_size=batch_size, shuffle=True)
    if options.pop("sampler_of_one_replica", False):  # what that sampler is when there is one data-parallel rank
        sampler = torch.utils.data.DistributedSampler(data(), num_replicas=1, rank=0, shuffle=True, seed=0)
        train = DataLoader(data(), batch_size=batch_size, sampler=sampler)
    val = DataLoader(data(24), batch_size=12)
    if options.pop("evaluate_only", False):  # validate and predict a model that was never fitted here
        trainer.validate(model, val)
    else:
        if options.pop("validate_first", False):  # a user's first call, before any fit (no training data given)
            trainer.validate(model, val)
        trainer.fit(model, train, val, ckpt_path=options.pop("resume", None))
        trainer.save_checkpoint(os.path.join(out, "final.ckpt"))
        if options.pop("also_full", False):  # the same state as one file too (checkpoint="sharded" wrote final.ckpt)
            trainer.strategy.checkpoints.mode = "full"
            trainer.save_checkpoint(os.path.join(out, "final-full.ckpt"))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if options.pop("test", False):
        trainer.test(model, DataLoader(data(24), batch_size=12))
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    if options.pop("measure_saves", False):
        measure_saves(trainer, out)
    if options.pop("measure_live", False):
        measure_live(trainer, out)
    predictions = trainer.predict(model, DataLoader(data(24), batch_size=12)) if options.pop("predict", False) else None
    explanation = getattr(trainer.strategy, "explanation", None)  # the plan's prediction against the fit's figures
    if trainer.is_global_zero and explanation is not None:
        write_json(os.path.join(out, "explanation.json"), explanation.to_json())
    if trainer.is_global_zero:
        metrics["epoch"] = trainer.current_epoch
        metrics["global_step"] = trainer.global_step
        if predictions is not None:
            metrics["predictions"] = torch.cat(predictions).tolist()
        write_json(os.path.join(out, "metrics.json"), metrics)
    refuse_unused(options)


if __name__ == "__main__":
    main_runs(train)
