"""A run that a kill interrupts and torchrun restarts: `torchrun ... restart_trainer.py OUT JSON_OPTIONS`.

Options: schedule ("1f1b" or "pipedream"), checkpoint ("full", "sharded" or "sharded-async"), max_steps, ckpt_path
("last"), plain_loader (a torch DataLoader instead of the StatefulDataLoader), time_interval (ModelCheckpoint's
train_time_interval, in seconds, instead of steps) with clock_skew ({"rank", "rate", "offset"}: that rank's clock
as ModelCheckpoint reads it runs ``rate`` times as fast, ``offset`` s ahead), step_sleep (seconds each training
batch waits at its start on every rank: a floor on the run's length, so a time-based save falls in it on any machine),
every (ModelCheckpoint's
every_n_train_steps), elastic (as many stages as torchrun gives processes: devices and num_nodes from its
environment, no balance, the plan made anew at every start), and kill: the keyword arguments of
lightning_pipedream.testing.faults.Kill ({"rank": r, "step": s, "during": "step" | "transfer" | "save"}, and
"world": w to kill only in an attempt of w processes), or a list of them, killed in order, each once a run (for
"save" under "sharded-async": once the rank's data is written in the background thread, training going on).

Every attempt fits with ``ckpt_path="last"`` and a torchdata StatefulDataLoader (shuffled), so the resumed run reads
the rest of the interrupted epoch. At the end, each rank writes ``final_rank{r}.pt``: its stage's weights, its
optimizer's state and the global step, for the test to compare with an uninterrupted run's. Each attempt appends
one line to ``attempts_rank{r}.txt``: the restart count, the global step it resumed at and the world size; each step
a line to ``batches_rank{r}.txt`` (attempt, global step, batch index, targets).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import model_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))  # the libraries the tests share
from script_runs import exit_without_final_collections, refuse_unused, trainer_args  # noqa: E402
from tiny import SequentialClassifier, data, mlp  # noqa: E402
from torch.utils.data import DataLoader, RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_pipedream import PipeDreamStrategy
from lightning_pipedream.testing import faults

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
class Kill(faults.Kill, L.Callback):
    """lightning_pipedream.testing.faults.Kill as a Lightning callback."""


class Model(SequentialClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.layers = mlp(16, 2)

    def configure_optimizers(self) -> Any:  # momentum: optimizer state that a resume must restore
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class SkewedClock:
    """``time`` as ModelCheckpoint reads it on this rank: a monotonic clock ``rate`` times as fast, ``offset`` s
    ahead (another machine's clock); everything else is the time module's."""

    def __init__(self, rate: float, offset: float) -> None:
        self.rate, self.offset, self.start = rate, offset, time.monotonic()

    def monotonic(self) -> float:
        return self.start + self.offset + (time.monotonic() - self.start) * self.rate

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class RecordSaves(L.Callback):
    """The global step of every checkpoint this rank took part in (``saves_rank{r}.txt``)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        with open(os.path.join(self.out, f"saves_rank{trainer.global_rank}.txt"), "a") as f:
            f.write(f"{trainer.global_step}\n")


class SlowSteps(L.Callback):
    """Each training batch waits ``seconds`` first: the run lasts at least that times its steps, however fast."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, *args: Any) -> None:
        time.sleep(self.seconds)


class Record(L.Callback):
    """Each attempt's start (``attempts_rank{r}.txt``) and each rank's end state (``final_rank{r}.pt``)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with open(os.path.join(self.out, f"attempts_rank{trainer.global_rank}.txt"), "a") as f:
            f.write(f"{ATTEMPT} {trainer.global_step} {trainer.world_size}\n")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        with open(os.path.join(self.out, f"batches_rank{trainer.global_rank}.txt"), "a") as f:
            f.write(f"{ATTEMPT} {trainer.global_step} {batch_idx} {batch[1].tolist()}\n")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        raw = getattr(optimizer, "_optimizer", optimizer)
        state = {"weights": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                 "optimizer": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                               for i, s in enumerate(raw.state[p] for g in raw.param_groups for p in g["params"])},
                 "global_step": trainer.global_step, "world_size": trainer.world_size,
                 # by parameter name too: a run that ends on another layout holds other stages
                 "named_optimizer": {name: {k: v.clone() if isinstance(v, torch.Tensor) else v
                                            for k, v in raw.state[p].items()}
                                     for name, p in pl_module.named_parameters() if p in raw.state}}
        torch.save(state, os.path.join(self.out, f"final_rank{trainer.global_rank}.pt"))


def main() -> None:
    out, options = sys.argv[1], json.loads(sys.argv[2])
    os.makedirs(out, exist_ok=True)
    warnings.filterwarnings("default", message="Resuming in the middle")  # the strategy's, for the test to read
    os.environ.setdefault("LIGHTNING_PIPEDREAM_FLIGHT_RECORDER", os.path.join(out, "flight"))
    L.seed_everything(0, verbose=False)
    schedule = options.pop("schedule", "1f1b")
    kill = options.pop("kill", None)
    interval = options.pop("time_interval", None)  # ModelCheckpoint(train_time_interval=...) instead of steps
    if interval is None:
        saving = L.pytorch.callbacks.ModelCheckpoint(dirpath=os.path.join(out, "checkpoints"), save_last=True,
                                                     every_n_train_steps=options.pop("every", 8))
    else:
        saving = L.pytorch.callbacks.ModelCheckpoint(dirpath=os.path.join(out, "checkpoints"), save_top_k=-1,
                                                     train_time_interval=timedelta(seconds=interval))
    skew = options.pop("clock_skew", None)  # {"rank": r, "rate": x, "offset": s}: rank r's clock differs
    if skew is not None and int(os.environ.get("RANK", 0)) == skew["rank"]:
        model_checkpoint.time = SkewedClock(skew["rate"], skew["offset"])  # type: ignore[attr-defined]
    callbacks: list[L.Callback] = [saving, Record(out), RecordSaves(out)]
    if "step_sleep" in options:
        callbacks.append(SlowSteps(options.pop("step_sleep")))
    for index, one in enumerate([kill] if isinstance(kill, dict) else kill or []):
        callbacks.append(Kill(out, **one, index=index))
    elastic = options.pop("elastic", False)  # as many stages as torchrun gives processes, planned anew each start
    world, local = (int(os.environ.get(k, 1)) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    layout = {"devices": local, "num_nodes": world // local} if elastic else {"devices": options.pop("devices", 2)}
    # Shuffled by Lightning's sampler (seeded, a new order each epoch); the loader resumes mid-epoch.
    dataset = data(60)  # 15 batches an epoch: no checkpoint at an epoch's last batch (see docs/strategy.md)
    plain = options.pop("plain_loader", False)  # a torch DataLoader: it cannot resume mid-epoch
    loader = (DataLoader if plain else StatefulDataLoader)(dataset, batch_size=4, sampler=RandomSampler(dataset))
    trainer = L.Trainer(**trainer_args(
        **layout, max_steps=options.pop("max_steps", 40), callbacks=callbacks, enable_checkpointing=True,
        strategy=PipeDreamStrategy(schedule=schedule, chunks=1 if schedule == "pipedream" else 2,
                                   balance=None if elastic else [4, 3],
                                   checkpoint=options.pop("checkpoint", "full")),
    ))
    ckpt_path = options.pop("ckpt_path", "last")
    refuse_unused(options)
    trainer.fit(Model(), loader, ckpt_path=ckpt_path)


if __name__ == "__main__":
    exit_without_final_collections()
    if sys.argv[1] == "--runs":  # several runs one after the other in the same processes (the references)
        for out, options in json.load(open(sys.argv[2])):
            sys.argv[1:] = [out, json.dumps(options)]
            main()
    else:
        main()
