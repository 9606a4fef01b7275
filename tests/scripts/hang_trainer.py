"""A multi-process Trainer one of whose ranks goes wrong at a given batch: `python hang_trainer.py OUT JSON_OPTIONS`
(rank, at, how, schedule, chunks, devices, timeout, max_steps). how: stop (SIGSTOP), spin (a Python loop), raise (its
first layer raises), drift (its batches change from then on), fewer (it has fewer batches per epoch), shuffle (every
rank shuffles with the global random state, which dropout on one stage consumes)."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))  # the libraries the tests share
from script_runs import exit_without_final_collections, trainer_args  # noqa: E402
from tiny import SequentialClassifier, data, mlp  # noqa: E402
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipedream import PipeDreamStrategy


class Model(SequentialClassifier):
    def __init__(self, dropout: bool = False, blocks: int = 1) -> None:
        super().__init__()
        self.layers = mlp(16, blocks)
        if dropout:  # on the last stage only: the other stages' random state stays as it was
            self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.5),
                                        nn.Linear(16, 4))


class Fault(L.Callback):
    """At the start of batch ``at`` on rank ``rank``: stop this process (as a debugger or a frozen machine would),
    spin in a Python loop (a livelock), or make the rank's first layer raise in the batch's forward."""

    def __init__(self, rank: int, at: int, how: str, out: str) -> None:
        self.rank, self.at, self.how, self.out = rank, at, how, out

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.how == "drift" and trainer.global_rank == self.rank and batch_idx >= self.at:
            batch[0].add_(1.0)  # this rank's inputs are no longer the others'
        if trainer.global_rank != self.rank or trainer.global_step != self.at or self.how not in ("stop", "spin",
                                                                                                  "raise"):
            return
        with open(os.path.join(self.out, "fault_time"), "w") as f:  # when the fault began, for the test's clock
            f.write(str(time.time() + (0 if self.how == "raise" else 1.5)))
        if self.how == "raise":
            def fail(module: nn.Module, inputs: tuple) -> None:
                raise ValueError(f"bad input on rank {self.rank}")

            first = next(m for m in pl_module.layers if sum(p.numel() for p in m.parameters()))
            first.register_forward_pre_hook(fail)
            return
        time.sleep(1.5)  # its heartbeat (one a second) reports the last action first
        if self.how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        while self.how == "spin":
            sum(range(1000))

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        with open(os.path.join(self.out, f"ended_rank{trainer.global_rank}"), "w") as f:
            f.write(str(trainer.global_step - 1))  # the last step this rank finished


def main() -> None:
    out, options = sys.argv[1], json.loads(sys.argv[2])
    faulthandler.register(signal.SIGUSR1)  # the test dumps every thread's stack with it before killing a hang
    os.environ.setdefault("LIGHTNING_PIPEDREAM_FLIGHT_RECORDER", os.path.join(out, "flight"))
    how = options.get("how", "stop")
    dataset = data(64)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if how == "fewer" and rank == options.get("rank", 1):
        dataset = TensorDataset(*dataset[:60])
    L.seed_everything(0, verbose=False)
    loader = DataLoader(dataset, batch_size=4, shuffle=how == "shuffle")  # shuffle: no generator of its own
    schedule = options.get("schedule", "1f1b")
    trainer = L.Trainer(**trainer_args(
        devices=options.get("devices", 2), max_steps=options.get("max_steps", 12),
        use_distributed_sampler=how not in ("fewer", "shuffle"),
        callbacks=[Fault(options.get("rank", 1), options.get("at", 3), options.get("how", "stop"), out)],
        strategy=PipeDreamStrategy(schedule=schedule, chunks=options.get("chunks", 1 if schedule == "pipedream" else 2),
                                   timeout=timedelta(seconds=options.get("timeout", 10)),
                                   balance=options.get("balance"), virtual_stages=options.get("virtual_stages", 1)),
    ))
    trainer.fit(Model(dropout=how == "shuffle", blocks=options.get("blocks", 1)), loader)


if __name__ == "__main__":
    exit_without_final_collections()
    main()
