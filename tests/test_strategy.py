"""Trainer(strategy=PipeDreamStrategy): equivalence with one device, logging, checkpoints, resume, launch, errors.

Multi-process Trainers run ``tests/scripts/tiny.py`` in a subprocess (Lightning's launcher re-runs
``sys.argv``, which inside pytest would re-run pytest) with a timeout, and the tests read what it wrote.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from tiny import TinyClassifier, data
from torch import nn

from lightning_pipedream import PipeDreamStrategy
from lightning_pipedream.lightning_adapter import find_layers
from lightning_pipedream.schedule.actions import Op
from lightning_pipedream.schedule.timeline import from_chrome_trace

SCRIPT = Path(__file__).parent / "scripts" / "tiny.py"



def run_tiny(out: Path, options: dict, timeout: float = 240, expect_ok: bool = True) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), json.dumps(options)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=out,
    )
    if expect_ok:
        assert proc.returncode == 0, f"tiny.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=False, map_location="cpu")["state_dict"]


def assert_same_weights(got: Path, want: Path, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    a, b = weights(got), weights(want)
    assert list(a) == list(b)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")


def rank_info(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """Single-device training, 3 steps: what the pipelines must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    run_tiny(out, {})
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_flushed_schedules_match_single_device(tmp_path, reference, schedule):
    run_tiny(tmp_path, {"devices": 2, "strategy": {"schedule": schedule, "chunks": 4, "balance": [3, 2]}})
    assert_same_weights(tmp_path / "final.ckpt", reference / "final.ckpt")
    assert rank_info(tmp_path, 0)["losses"] == pytest.approx(rank_info(reference, 0)["losses"], rel=1e-5)
    # Each rank holds only its stage: parameters, optimizer parameters and optimizer state.
    full = rank_info(reference, 0)["parameters"]
    shares = [rank_info(tmp_path, r) for r in (0, 1)]
    assert [s["parameters"] for s in shares] == [8 * 16 + 16 + 16 * 16 + 16, 16 * 4 + 4]  # balance [3, 2]
    assert sum(s["parameters"] for s in shares) == full
    for s in shares:
        assert s["optimizer_parameters"] == s["parameters"] == s["optimizer_state_tensors"]


def test_pipedream_with_logging_monitoring_checkpoint_and_predict(tmp_path):
    # Trainer(strategy="pipedream") by name; the partition comes from profiling.
    run_tiny(tmp_path, {
        "devices": 2, "strategy": "pipedream", "monitor": "val_acc", "predict": True, "test": True,
        "limit_val_batches": 2, "trainer": {"max_epochs": 4, "max_steps": -1},
    })
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    # Logged on the last stage, seen by rank 0's callbacks: EarlyStopping stopped after 2 epochs.
    assert {"train_loss", "val_acc", "val_loss", "test_loss"} <= set(metrics)
    assert metrics["epoch"] == 2 and metrics["global_step"] == 10
    best = sorted(tmp_path.glob("epoch=*.ckpt"))
    assert len(best) == 1
    # The consolidated checkpoint loads without the strategy and predicts what the pipeline predicted.
    model = TinyClassifier.load_from_checkpoint(tmp_path / "final.ckpt", map_location="cpu")
    x = torch.stack([data(24)[i][0] for i in range(24)])
    assert model(x).argmax(-1).tolist() == metrics["predictions"]
    assert rank_info(tmp_path, 0)["parameters"] + rank_info(tmp_path, 1)["parameters"] == 484


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """4 steps (4 epochs of one batch) on one device and on 2 stages, both checkpointing every epoch.

    One batch per epoch keeps the data the same whatever Lightning does to resume a data loader, so
    the comparison isolates the checkpoint: weights, momentum and LR-scheduler state.
    """
    base = tmp_path_factory.mktemp("resume")
    common = {"batch_size": 60, "max_steps": 4, "checkpoint_every_epoch": True}
    run_tiny(base / "single", common)
    run_tiny(base / "pipe", {**common, "devices": 2, "strategy": {"schedule": "1f1b", "chunks": 4}})
    return base, common


@pytest.mark.parametrize("source,devices", [("pipe", 2), ("pipe", 3), ("single", 2)])
def test_resume_equals_uninterrupted(tmp_path, resume_runs, source, devices):
    base, common = resume_runs
    single = base / "single"
    assert_same_weights(base / "pipe" / "final.ckpt", single / "final.ckpt")
    checkpoint = base / source / "epoch=1-step=2.ckpt"
    run_tiny(tmp_path, {**common, "devices": devices, "resume": str(checkpoint),
                        "strategy": {"schedule": "1f1b", "chunks": 4}})
    assert_same_weights(tmp_path / "final.ckpt", single / "final.ckpt")
    assert rank_info(tmp_path, 0)["losses"] == pytest.approx(rank_info(single, 0)["losses"][2:], rel=1e-5)


def test_clipping_accumulation_and_plan_file_match_single_device(tmp_path):
    from lightning_pipedream.plan.partition import Plan, StagePlan

    plan = tmp_path / "plan.json"
    Plan([StagePlan(["0", "1"]), StagePlan(["2", "3", "4"])], schedule="gpipe", chunks=3).save(plan)
    options = {"max_steps": 2, "batch_size": 6, "trainer": {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}}
    run_tiny(tmp_path / "single", options)
    run_tiny(tmp_path / "pipe", {**options, "devices": 2, "strategy": {"schedule": "gpipe", "chunks": 3,
                                                                      "plan": str(plan)}})
    assert_same_weights(tmp_path / "pipe" / "final.ckpt", tmp_path / "single" / "final.ckpt")
    assert rank_info(tmp_path / "pipe", 0)["parameters"] == 8 * 16 + 16  # stage 0 holds layers 0 and 1


def test_gpipe_on_three_stages_with_uneven_chunks_and_plain_accumulation(tmp_path):
    # No clipping: the 1/k scaling of accumulate_grad_batches alone decides the result. 5 chunks of a
    # batch of 12 are uneven (3, 3, 2, 2, 2); each rank writes its trace.
    options = {"max_steps": 3, "batch_size": 12, "trainer": {"accumulate_grad_batches": 2}}
    run_tiny(tmp_path / "single", options)
    run_tiny(tmp_path / "pipe", {**options, "devices": 3, "strategy": {"schedule": "gpipe", "chunks": 5,
                                                                      "balance": [2, 2, 1], "trace": "traces"}})
    assert_same_weights(tmp_path / "pipe" / "final.ckpt", tmp_path / "single" / "final.ckpt")
    for rank in range(3):
        trace = json.loads((tmp_path / "pipe" / "traces" / f"trace_rank{rank}.json").read_text())
        ops = [e.action.op for e in from_chrome_trace(trace)]
        # One epoch of 5 batches (3 steps: groups of 2, 2 and the epoch's last 1), 5 chunks each.
        assert ops.count(Op.FORWARD) == ops.count(Op.BACKWARD) == 5 * 5
        assert ops.count(Op.OPTIMIZER_STEP) == 5


def test_validate_and_predict_without_fitting_equal_one_device(tmp_path):
    options = {"evaluate_only": True, "predict": True, "limit_val_batches": 2}
    run_tiny(tmp_path / "single", options)
    run_tiny(tmp_path / "pipe", {**options, "devices": 2, "strategy": {"schedule": "1f1b", "chunks": 3}})
    got, want = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("pipe", "single"))
    assert got["predictions"] == want["predictions"]
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
    assert got["val_acc"] == pytest.approx(want["val_acc"], rel=1e-6)


def test_lightning_default_sampler_shuffles_alike_on_every_stage(tmp_path):
    # Lightning's own sampler (use_distributed_sampler=True, shuffled, reshuffled each epoch): every stage
    # sees the same batches, which are those of a sampler with one replica (the data-parallel degree).
    options = {"max_steps": 7, "batch_size": 12}
    run_tiny(tmp_path / "single", {**options, "sampler_of_one_replica": True})
    run_tiny(tmp_path / "pipe", {**options, "devices": 2, "shuffle": True, "trainer": {"use_distributed_sampler": True},
                                 "strategy": {"schedule": "1f1b", "chunks": 2}})
    assert_same_weights(tmp_path / "pipe" / "final.ckpt", tmp_path / "single" / "final.ckpt")


def test_stages_that_see_different_batches_are_stopped(tmp_path):
    # An unseeded shuffle per rank: stage 0's inputs would not belong to the last stage's labels.
    proc = run_tiny(tmp_path, {"devices": 2, "shuffle_per_rank": True, "strategy": {"schedule": "1f1b"},
                               "trainer": {"use_distributed_sampler": False}}, expect_ok=False)
    assert "The pipeline stages received different training batches" in proc.stderr


def test_one_device_is_a_single_stage_run(tmp_path, reference):
    # One stage has nothing in flight: PipeDream's rule reduces to plain training.
    run_tiny(tmp_path, {"devices": 1, "strategy": {"schedule": "pipedream"}})
    assert_same_weights(tmp_path / "final.ckpt", reference / "final.ckpt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_under_torchrun(tmp_path, reference):
    port = free_port()
    options = json.dumps({"strategy": {"schedule": "1f1b", "chunks": 2}, "trainer": {"num_nodes": 2}})
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
             "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", str(SCRIPT),
             str(tmp_path), options],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-4000:]
    assert_same_weights(tmp_path / "final.ckpt", reference / "final.ckpt")


def test_more_stages_than_layers_fails_on_every_rank(tmp_path):
    proc = run_tiny(tmp_path, {"devices": 2, "model": {"single_layer": True}, "strategy": {"schedule": "1f1b"}},
                    expect_ok=False)
    assert proc.returncode != 0
    assert "The model has 1 layers but 2 stages were asked for; every stage needs at least one layer" in proc.stderr


def test_a_failing_stage_stops_every_rank_with_its_error(tmp_path):
    start = time.monotonic()
    proc = run_tiny(tmp_path, {"devices": 2, "fail_in_last_layer": True,
                               "strategy": {"schedule": "pipedream", "balance": [3, 3]}}, timeout=120, expect_ok=False)
    assert proc.returncode != 0 and time.monotonic() - start < 60
    assert "[rank1]: ValueError: boom on the third forward" in proc.stderr
    assert ("[rank0]: lightning_pipedream.runtime.transport.PeerFailedError: Pipeline stage 1 failed with "
            "ValueError: boom on the third forward (this rank, stage 0, stopped because of it)") in proc.stderr


def test_bad_strategy_arguments():
    with pytest.raises(ValueError, match="Unknown schedule 'zigzag'. Choose one of: gpipe, 1f1b, pipedream"):
        PipeDreamStrategy(schedule="zigzag")
    with pytest.raises(ValueError, match="chunks must be an integer >= 1, got 0"):
        PipeDreamStrategy(schedule="1f1b", chunks=0)
    with pytest.raises(ValueError, match="schedule='pipedream' runs each batch as one PipeDream minibatch"):
        PipeDreamStrategy(schedule="pipedream", chunks=4)
    with pytest.raises(ValueError, match="start_method='spawn'. is not supported: those launchers return only"):
        PipeDreamStrategy(start_method="spawn")


def test_gpu_requested_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    # Lightning's own check, before any strategy code runs.
    with pytest.raises(MisconfigurationException, match="No supported gpu backend found"):
        L.Trainer(accelerator="gpu", devices=2, strategy=PipeDreamStrategy())


class NoSequential(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(2, 2), nn.Linear(2, 2)


class TwoSequentials(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Softmax(-1))


class ParameterOutside(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 2))
        self.scale = nn.Parameter(torch.ones(1))


class SharedWeights(L.LightningModule):
    def __init__(self):
        super().__init__()
        a = nn.Linear(2, 2)
        self.layers = nn.Sequential(a, nn.Tanh(), a)


def test_modules_that_do_not_fit_the_contract():
    with pytest.raises(ValueError, match=r"needs the model's layers in one nn.Sequential attribute, e.g. "
                                         r"`self.layers = nn.Sequential\(...\)`.*NoSequential has none"):
        find_layers(NoSequential(), None)
    with pytest.raises(ValueError, match="several nn.Sequential attributes \\(encoder, decoder\\); name the one"):
        find_layers(TwoSequentials(), None)
    assert find_layers(TwoSequentials(), "encoder")[0] == "encoder"
    with pytest.raises(ValueError, match="has parameters outside self.decoder: encoder.0.weight"):
        find_layers(TwoSequentials(), "decoder")
    with pytest.raises(ValueError, match=r"layers='first'\): NoSequential.first is Linear, not an nn.Sequential"):
        find_layers(NoSequential(), "first")
    with pytest.raises(ValueError, match="has parameters outside self.layers: scale"):
        find_layers(ParameterOutside(), None)
    with pytest.raises(ValueError, match="Layers '0' and '2' of SharedWeights.layers share a parameter"):
        find_layers(SharedWeights(), None)
