"""A Sequential whose first and last Linear share their weight (a tied embedding's shape), trained by a real Trainer
for the collective tests (issue #52): `python collective_trainer.py OUT_DIR JSON_OPTIONS` or `--runs RUNS.json`.

Options: schedule, chunks, devices, balance, batches, clip (gradient_clip_val, by value), val_every (validation
every that many batches), hooks (collectives in on_train_batch_end: self.all_gather, self.log(sync_dist=True)),
sigterm_at (rank 0 sends itself SIGTERM at that batch), spin_at (rank 0 spins in on_before_optimizer_step from that
step: its peer waits in the tie's all-reduce), sigterm_peer_after (with spin_at: rank 0 sends SIGTERM to rank 1
after that many seconds of spinning), timeout and patient_rank (that rank's timeout is 600 s), launcher_checks_every
(seconds between the checks of Lightning's launcher on its child processes: 5 s as shipped, 0.1 s is torchrun's
agent's pace, which ends every rank as soon as one exits). Each rank writes
rank<R>.json (what it saw) and the run writes final.ckpt (every weight, by the module's names).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))  # the libraries the tests share
from lightning.pytorch.utilities.exceptions import SIGTERMException  # noqa: E402
from script_runs import main_runs, refuse_unused, trainer_args, write_json  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_pipedream import PipeDreamStrategy  # noqa: E402

WIDTH, BATCH, LR = 8, 4, 0.05
LONG = 600.0


class TiedMLP(L.LightningModule):
    """Linear, Tanh, Linear, Tanh, Linear; the last Linear's weight is the first's (one Parameter, used twice)."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                                    nn.Linear(WIDTH, WIDTH))
        if tied:
            self.layers[4].weight = self.layers[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)  # as users write it: every rank logs the last stage's value
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def made_model(tied: bool = True) -> TiedMLP:
    L.seed_everything(0, verbose=False)
    return TiedMLP(tied)


def dataset(batches: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batches * BATCH, WIDTH, generator=g)
    return TensorDataset(x, torch.tanh(x.flip(1) * 0.7))


class Watch(L.Callback):
    """What this rank saw: the steps it ended, the collectives it ran from hooks, how its fit ended."""

    def __init__(self, out: Path, options: dict[str, Any]) -> None:
        self.out = out
        self.seen: dict[str, Any] = {"gathered": [], "logged": [], "last_batch": None, "ended": "normally", "losses": []}
        self.hooks = options.pop("hooks", False)
        self.sigterm_at = options.pop("sigterm_at", None)
        self.spin_at = options.pop("spin_at", None)
        self.sigterm_peer_after = options.pop("sigterm_peer_after", None)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.out / f"pid_rank{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_rank == 0 and batch_idx == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` or a cluster's preemption notice would

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_rank != 0 or self.spin_at is None or trainer.global_step < self.spin_at:
            return
        (self.out / "fault_time").write_text(str(time.time()))
        start = time.monotonic()
        while True:  # a livelock: its heartbeat goes on, its peer waits in the tie's all-reduce for it
            sum(range(1000))
            if self.sigterm_peer_after is not None and time.monotonic() - start > self.sigterm_peer_after:
                os.kill(int((self.out / "pid_rank1").read_text()), signal.SIGTERM)
                self.sigterm_peer_after = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.seen["last_batch"] = batch_idx
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.seen["losses"].append(float(loss))
        if self.hooks:  # collectives from a hook every rank runs: the strategy drains first under async schedules
            rank = float(trainer.global_rank)
            pl_module.log("rank_mean", rank, sync_dist=True, on_step=True, on_epoch=False)
            if batch_idx % 10 == 0:
                self.seen["gathered"].append(pl_module.all_gather(torch.tensor(rank)).tolist())
            if batch_idx % 25 == 0 and trainer.is_global_zero:
                self.seen["logged"].append(float(trainer.callback_metrics.get("rank_mean", float("nan"))))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.seen["ended"] = type(exception).__name__
        self.seen["stopped_at"] = {"batch": trainer.fit_loop.epoch_loop.batch_idx, "step": trainer.global_step}

    def write(self, rank: int) -> None:
        write_json(self.out / f"rank{rank}.json", self.seen)


def train(out_dir: str, options: dict[str, Any]) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["LIGHTNING_PIPEDREAM_FLIGHT_RECORDER"] = str(out / "flight")
    rank = int(os.environ.get("LOCAL_RANK", 0))
    batches = options.pop("batches", 104)
    timeout = options.pop("timeout", LONG)
    timeout = LONG if rank == options.pop("patient_rank", None) else timeout
    schedule = options.pop("schedule", "pipedream")
    checks_every = options.pop("launcher_checks_every", None)
    if checks_every is not None:
        from lightning.fabric.strategies.launchers import subprocess_script

        shipped = subprocess_script._ChildProcessObserver.__init__

        def observer(self: Any, main_pid: int, child_processes: list, sleep_period: int = 5) -> None:
            shipped(self, main_pid, child_processes, sleep_period=checks_every)

        subprocess_script._ChildProcessObserver.__init__ = observer
    watch = Watch(out, options)
    val_every = options.pop("val_every", None)
    clip = options.pop("clip", None)
    strategy = PipeDreamStrategy(schedule=schedule, chunks=options.pop("chunks", 1), balance=options.pop("balance"),
                                 timeout=timedelta(seconds=timeout))
    trainer = L.Trainer(**trainer_args(
        devices=options.pop("devices", 2), max_epochs=1, strategy=strategy, callbacks=[watch],
        val_check_interval=val_every, limit_val_batches=2 if val_every else 0, num_sanity_val_steps=0,
        gradient_clip_val=clip, gradient_clip_algorithm="value" if clip else None, log_every_n_steps=5,
        use_distributed_sampler=False,  # the batches in order (Lightning's sampler would shuffle them): the rules' order
    ))
    data = dataset(batches)
    model = made_model(options.pop("tied", True))
    refuse_unused(options)
    try:
        trainer.fit(model, DataLoader(data, batch_size=BATCH), DataLoader(data, batch_size=BATCH))
    except SIGTERMException:
        pass  # written down by Watch.on_exception on every rank
    watch.write(trainer.global_rank)
    own = {k: v for k, v in model.state_dict().items() if not v.is_meta}  # this rank's stage, its tied copy included
    torch.save(own, out / f"weights_rank{trainer.global_rank}.pt")
    if watch.seen["ended"] == "normally":
        trainer.save_checkpoint(out / "final.ckpt")


if __name__ == "__main__":
    main_runs(train)
