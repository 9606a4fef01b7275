"""One rank of a two-process Trainer whose rank 0 fails in a step of setup, or that starts late:
`python setup_fault_trainer.py OUT JSON_OPTIONS`, started once per rank by the test (LOCAL_RANK, MASTER_PORT set).

Options: ``fault`` is where rank 0 fails: ``profile`` (a layer raises while rank 0 profiles the nn.Sequential),
``auto`` (the same under ``schedule="auto"``), ``capture`` (the forward raises while rank 0 captures a module that
is not one nn.Sequential), ``materialize`` (a layer of
rank 0's stage of a model built on the meta device fails to initialize), ``plan`` (rank 0's ``plan=`` file was made for another model), ``restore`` (rank 0's
checkpoint cannot be read), ``balance`` (every rank refuses ``balance=``), or ``none``; ``timeout`` is the pipeline's in seconds. Each rank writes the error it
stops with to ``error_rank<r>.txt``; rank 0 writes ``fault_time`` (seconds since the epoch) when its failure begins.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))  # the libraries the tests share
from script_runs import exit_without_final_collections, trainer_args  # noqa: E402
from tiny import SequentialClassifier, data  # noqa: E402
from torch import nn
from torch.utils.data import DataLoader

from lightning_pipedream import PipeDreamStrategy
from lightning_pipedream.plan.partition import partition
from lightning_pipedream.plan.profile import LayerProfile, Profile
from lightning_pipedream.plan.topology import Topology

RANK = int(os.environ.get("LOCAL_RANK", "0"))


def mark_fault(out: str) -> None:
    """Rank 0's clock for the test: its planted failure begins now (only the first mark counts)."""
    path = Path(out) / "fault_time"
    if RANK == 0 and not path.exists():
        path.write_text(str(time.time()))


def fail_on_rank_zero(out: str, where: str) -> None:
    """On rank 0 only: the planted failure, ``where`` it happens, its clock started."""
    if RANK == 0:
        mark_fault(out)
        raise ValueError(f"planted failure {where} on rank 0")


class FailsOnRankZero(nn.Module):
    """Raises on rank 0, whenever it runs (rank 0 alone profiles or captures the model)."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fail_on_rank_zero(self.out, "in a layer")
        return x


class FailsToInitialize(nn.Linear):
    """Its initialization fails on rank 0 once it has real storage (when rank 0 materializes its stage)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            fail_on_rank_zero(OUT[0], "initializing a layer")
        super().reset_parameters()


OUT = [""]  # the run's directory, for layers built before it is known


class Layers(SequentialClassifier):
    """Its layers are one nn.Sequential; ``faulty`` puts a layer in it that fails on rank 0; ``extra`` (a model of
    its own) adds a layer, so that a plan made for the others does not fit it."""

    def __init__(self, out: str, faulty: bool = False, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        middle = [FailsOnRankZero(out)] if faulty else []
        tail = [nn.Tanh(), nn.Linear(16, 16)] if extra else []
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), *middle, nn.Linear(16, 16), *tail, nn.Linear(16, 4))


class Branches(Layers):
    """Not one nn.Sequential: the strategy captures its forward call, on rank 0, to choose the split."""

    def __init__(self, out: str) -> None:
        L.LightningModule.__init__(self)
        torch.manual_seed(0)
        self.first, self.second, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fail_on_rank_zero(self.out, "in the forward call")
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))))


class BuiltPerStage(Layers):
    """Built in configure_model, on the meta device under the strategy: each rank materializes its own stage."""

    def __init__(self, out: str) -> None:
        L.LightningModule.__init__(self)
        self.layers = None

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = nn.Sequential(FailsToInitialize(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4))


class FaultClock(L.Callback):
    """For failures raised inside the strategy: rank 0's fault begins after its setup hook (an upper bound)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        mark_fault(self.out)


def write_plan(path: Path, names: list[str]) -> None:
    """A two-stage plan over layers ``names`` (the first two on stage 0)."""
    profile = Profile([LayerProfile(name, 1e-3, 2e-3, 64, 64 if i != 1 else 0) for i, name in enumerate(names)])
    plan = partition(profile, Topology.flat(2), "time")
    path.write_text(json.dumps(plan.to_json()))


def train(out: str, options: dict[str, Any]) -> None:
    fault = options.get("fault", "none")
    strategy_options: dict[str, Any] = {"schedule": options.get("schedule", "1f1b"), "chunks": 2}
    model: L.LightningModule = Layers(out, faulty=fault in ("profile", "auto"), extra=fault == "plan" and RANK == 0)
    ckpt_path = None
    if fault == "auto":
        strategy_options = {"schedule": "auto", "memory_limit": 1e9}
    elif fault == "capture":
        model = Branches(out)
    elif fault == "materialize":  # rank 0 fails to initialize its stage's first layer; rank 1's stage is fine
        OUT[0] = out
        model = BuiltPerStage(out)
    elif fault == "plan":  # every rank reads its plan= file; rank 0's model has a layer more than the plan
        plan = Path(out) / f"plan_rank{RANK}.json"
        write_plan(plan, list(Layers(out).layers._modules))
        strategy_options["plan"] = str(plan)
    elif fault == "restore" and RANK == 0:  # a damaged copy of the checkpoint on rank 0's disk; rank 1 has none
        ckpt_path = Path(out) / "damaged.ckpt"
        ckpt_path.write_bytes(b"PK\x03\x04 cut short")
    if fault == "balance":  # every rank refuses it (4 layers), at once
        strategy_options["balance"] = [3, 3]
    elif fault not in ("profile", "auto", "capture", "plan"):
        strategy_options["balance"] = [2, 2]
    loader = DataLoader(data(32), batch_size=4)
    trainer = L.Trainer(**trainer_args(
        devices=2, max_steps=options.get("max_steps", 3),
        callbacks=[FaultClock(out)] if fault in ("plan", "restore", "balance") else [],
        strategy=PipeDreamStrategy(timeout=timedelta(seconds=options.get("timeout", 10)), **strategy_options),
    ))
    try:
        trainer.fit(model, loader, ckpt_path=ckpt_path)
    except BaseException as err:
        (Path(out) / f"error_rank{RANK}.txt").write_text(f"{time.time()}\n{type(err).__name__}: {err}\n"
                                                         f"{traceback.format_exc()}")
        raise
    (Path(out) / f"trained_rank{RANK}").write_text(str(trainer.global_step))
    # What the pipeline's waits are bounded by: the default group's timeout (runtime/communication/transport.py waits that long).
    world = torch.distributed.distributed_c10d._get_default_group()
    (Path(out) / f"wait_timeout_rank{RANK}").write_text(
        str(world._get_backend(torch.device("cpu")).options._timeout.total_seconds()))


if __name__ == "__main__":
    exit_without_final_collections()
    train(sys.argv[1], json.loads(sys.argv[2]))
