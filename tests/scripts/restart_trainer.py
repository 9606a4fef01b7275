"""A run that a kill interrupts and torchrun restarts: `torchrun ... restart_trainer.py OUT JSON_OPTIONS`.

Options: schedule ("1f1b" or "pipedream"), checkpoint ("full", "sharded" or "sharded-async"), max_steps, ckpt_path ("last"),
plain_loader (a torch DataLoader instead of the StatefulDataLoader), time_interval (ModelCheckpoint's
train_time_interval, in seconds, instead of steps) with clock_skew ({"rank", "rate", "offset"}: that rank's clock
as ModelCheckpoint reads it runs ``rate`` times as fast, ``offset`` s ahead), every (ModelCheckpoint's
every_n_train_steps), and kill: {"rank": r, "step": s, "during": "step" | "transfer" | "save"} (once a job: the kill
leaves the file ``killed``): SIGKILL, so no handler of this process runs:

- "step": rank r, right after training step s ended (``on_train_batch_end`` with global_step s);
- "transfer": rank r, in the middle of step s + 1, just after it posted a point-to-point send or receive;
- "save": rank r, in the middle of the checkpoint save at global step s (sharded: after its own share is written and
  before the directory is complete; sharded-async: the same, in the background thread, while training goes on;
  full: rank 0 only writes, halfway through the file).

Every attempt fits with ``ckpt_path="last"`` and a torchdata StatefulDataLoader (shuffled), so the resumed run reads
the rest of the interrupted epoch. At the end, each rank writes ``final_rank{r}.pt``: its stage's weights, its
optimizer's state and the global step, for the test to compare with an uninterrupted run's. Each attempt appends
one line to ``attempts_rank{r}.txt``: the restart count and the global step it resumed at; each step a line to
``batches_rank{r}.txt`` (attempt, global step, batch index, targets).
"""

from __future__ import annotations

import json
import os
import signal
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

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
OUT = "."  # the run's folder (main sets it)


KILLED = "killed"  # the file a kill leaves in the run's folder: one kill per job, whichever attempt counts what


def die() -> None:
    """SIGKILL this process: no handler, no flush, no goodbye to the peers (as the out-of-memory killer does)."""
    open(os.path.join(OUT, KILLED), "w").close()
    os.kill(os.getpid(), signal.SIGKILL)


class Model(SequentialClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.layers = mlp(16, 2)

    def configure_optimizers(self) -> Any:  # momentum: optimizer state that a resume must restore
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Kill(L.Callback):
    """Kills rank ``rank`` of the first attempt at step ``step`` (see the module's docstring for ``during``)."""

    def __init__(self, rank: int, step: int, during: str) -> None:
        self.rank, self.step, self.during = rank, step, during

    def _armed(self, trainer: L.Trainer) -> bool:
        return not os.path.exists(os.path.join(OUT, KILLED)) and trainer.global_rank == self.rank

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not self._armed(trainer) or trainer.global_step != self.step:
            return
        if self.during == "step":
            die()
        if self.during == "transfer":
            arm_transfer_kill()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.during == "save" and self._armed(trainer):
            arm_save_kill(trainer, self.step)


def arm_transfer_kill() -> None:
    """The next point-to-point operation this rank posts is its last: it dies once the operation is under way."""
    import torch.distributed as dist

    def posted_then_killed(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            work = original(*args, **kwargs)
            die()
            return work
        return call

    for name in ("isend", "irecv", "batch_isend_irecv"):
        setattr(dist, name, posted_then_killed(getattr(dist, name)))
        if hasattr(dist.distributed_c10d, name):
            setattr(dist.distributed_c10d, name, posted_then_killed(getattr(dist.distributed_c10d, name)))


def arm_save_kill(trainer: L.Trainer, step: int) -> None:
    """This rank dies inside the save at ``step``: sharded, once its own share is on disk (the directory not yet
    complete); full (rank 0 writes), halfway through writing the file."""
    from lightning_pipedream.strategy.checkpoints import sharded_checkpoint
    from lightning_pipedream.strategy.checkpoints.checkpoint import AtomicCheckpointIO

    write_named = sharded_checkpoint.write_named

    def write_then_die(named: Any, path: str) -> None:
        write_named(named, path)
        if trainer.global_step == step:
            die()

    sharded_checkpoint.write_named = write_then_die  # type: ignore[assignment]
    write_file = AtomicCheckpointIO._write

    def half_then_die(self: AtomicCheckpointIO, path: str, data: bytes) -> None:
        if trainer.global_step == step:
            write_file(self, path, data[: len(data) // 2])
            die()
        write_file(self, path, data)

    AtomicCheckpointIO._write = half_then_die  # type: ignore[method-assign]
    from lightning_pipedream.strategy.checkpoints import single_file

    fsync = single_file._fsync

    def written_then_die(path: str) -> None:  # the streamed single file: whole in its temporary, not yet in place
        if trainer.global_step == step:
            die()
        fsync(path)

    single_file._fsync = written_then_die  # type: ignore[assignment]
    from lightning_pipedream.strategy.checkpoints import async_save

    write_data = async_save._CompletingWriter.write_data

    def written_in_background_then_die(writer: Any, plan: Any, planner: Any) -> Any:
        done = write_data(writer, plan, planner)  # in the background: the step the save holds is in its name
        if f"step={step}.ckpt.tmp-" in os.path.basename(str(writer.path)):
            done.wait()
            die()
        return done

    async_save._CompletingWriter.write_data = written_in_background_then_die  # type: ignore[method-assign]


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


class Record(L.Callback):
    """Each attempt's start (``attempts_rank{r}.txt``) and each rank's end state (``final_rank{r}.pt``)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with open(os.path.join(self.out, f"attempts_rank{trainer.global_rank}.txt"), "a") as f:
            f.write(f"{ATTEMPT} {trainer.global_step}\n")

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
                 "global_step": trainer.global_step}
        torch.save(state, os.path.join(self.out, f"final_rank{trainer.global_rank}.pt"))


def main() -> None:
    global OUT
    out, options = sys.argv[1], json.loads(sys.argv[2])
    OUT = out
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
    if kill is not None:
        callbacks.append(Kill(kill["rank"], kill["step"], kill["during"]))
    # Shuffled by Lightning's sampler (seeded, a new order each epoch); the loader resumes mid-epoch.
    dataset = data(60)  # 15 batches an epoch: no checkpoint at an epoch's last batch (see docs/strategy.md)
    plain = options.pop("plain_loader", False)  # a torch DataLoader: it cannot resume mid-epoch
    loader = (DataLoader if plain else StatefulDataLoader)(dataset, batch_size=4, sampler=RandomSampler(dataset))
    trainer = L.Trainer(**trainer_args(
        devices=options.pop("devices", 2), max_steps=options.pop("max_steps", 40), callbacks=callbacks,
        enable_checkpointing=True,
        strategy=PipeDreamStrategy(schedule=schedule, chunks=1 if schedule == "pipedream" else 2, balance=[4, 3],
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
