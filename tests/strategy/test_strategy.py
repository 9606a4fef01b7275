"""Trainer(strategy=PipeDreamStrategy): equivalence with one device, logging, checkpoints, resume, launch, errors.

Multi-process Trainers run ``tests/scripts/tiny.py`` in a subprocess (Lightning's launcher re-runs
``sys.argv``, which inside pytest would re-run pytest) with a timeout, and the tests read what it wrote.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import lightning as L
import pytest
import torch
from fault_runs import start_group
from lightning.fabric.utilities.exceptions import MisconfigurationException
from pipedream_reference import RoundRobinRule
from script_runs import free_port, run_script, script_env
from tiny import TinyClassifier, data
from torch import nn

from lightning_pipedream import PipeDreamStrategy
from lightning_pipedream.schedule.actions import Op
from lightning_pipedream.schedule.timeline import from_chrome_trace
from lightning_pipedream.strategy.setup.calls import find_layers

pytestmark = pytest.mark.multiprocess  # starts several processes: not in the fast suite

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tiny.py"



def run_tiny(out: Path, options: dict, timeout: float = 240, expect_ok: bool = True) -> subprocess.CompletedProcess:
    return run_script(SCRIPT, out, options, timeout, expect_ok)  # on a port of this pytest worker's own


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=False, map_location="cpu")["state_dict"]


def assert_same_weights(got: Path, want: Path, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    a, b = weights(got), weights(want)
    assert list(a) == list(b)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")


def rank_info(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


# Every successful training the tests below compare, by name. They run in a few launches of tiny.py (one per
# process count, runs one after the other in the same processes), because starting the processes costs more
# than these trainings. "{runs}" stands for the folder that holds every run's folder.
RESUME = {"batch_size": 60, "max_steps": 4, "checkpoint_every_epoch": True}  # 4 epochs of one batch
CLIP = {"max_steps": 2, "batch_size": 6, "trainer": {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}}
UNEVEN = {"max_steps": 3, "batch_size": 12, "trainer": {"accumulate_grad_batches": 2}}
EVALUATE = {"evaluate_only": True, "predict": True, "limit_val_batches": 2}
SAMPLER = {"max_steps": 7, "batch_size": 12}
DEEP = {"model": {"hidden": 2}}  # 4 Linear layers: enough for 4 stages
RUNS: dict[str, dict] = {
    "reference": {},  # single-device training, 3 steps: what the pipelines must reproduce
    "one_device_pipedream": {"devices": 1, "strategy": {"schedule": "pipedream"}},
    "resume_single": RESUME,
    "clip_single": CLIP,
    "uneven_single": UNEVEN,
    "evaluate_single": EVALUATE,
    "sampler_single": {**SAMPLER, "sampler_of_one_replica": True},
    "gpipe": {"devices": 2, "strategy": {"schedule": "gpipe", "chunks": 4, "balance": [3, 2]}},
    "1f1b": {"devices": 2, "strategy": {"schedule": "1f1b", "chunks": 4, "balance": [3, 2]}},
    # Trainer(strategy="pipedream") by name; the partition comes from profiling.
    # pipedream's steps in the middle of an epoch make no collective call: the loss travels point to point.
    "pipedream_async": {"devices": 2, "max_steps": 8, "count_collectives": True,
                        "strategy": {"schedule": "pipedream", "balance": [3, 2]}},
    # Per-stage construction: the layers built in configure_model (on the meta device under the strategy).
    "meta_pipe": {"devices": 2, "model": {"build_in_configure_model": True, "width": 32},
                  "strategy": {"schedule": "1f1b", "chunks": 2}},
    "meta_one_stage": {"devices": 1, "model": {"build_in_configure_model": True, "width": 32},
                       "strategy": {"schedule": "1f1b", "chunks": 2}},
    "pipedream_by_name": {"devices": 2, "strategy": "pipedream", "monitor": "val_acc", "predict": True, "test": True,
                          "limit_val_batches": 2, "trainer": {"max_epochs": 4, "max_steps": -1}},
    "resume_pipe": {**RESUME, "devices": 2, "strategy": {"schedule": "1f1b", "chunks": 4}},
    # trainer.validate() first: configure_optimizers (which reads the training data) is left for the fit, whose
    # checkpoints hold the optimizer state in single-device form as without the validate.
    "validated_first_pipe": {**RESUME, "devices": 2, "validate_first": True, "limit_val_batches": 1,
                             "model": {"reads_training_data": True}, "strategy": {"schedule": "1f1b", "chunks": 4}},
    "resumed_from_pipe_on_2": {**RESUME, "devices": 2, "resume": "{runs}/resume_pipe/epoch=1-step=2.ckpt",
                               "strategy": {"schedule": "1f1b", "chunks": 4}},
    "resumed_from_single_on_2": {**RESUME, "devices": 2, "resume": "{runs}/resume_single/epoch=1-step=2.ckpt",
                                 "strategy": {"schedule": "1f1b", "chunks": 4}},
    "clip_pipe": {**CLIP, "devices": 2, "strategy": {"schedule": "gpipe", "chunks": 3, "plan": "{runs}/plan.json"}},
    "evaluate_pipe": {**EVALUATE, "devices": 2, "strategy": {"schedule": "1f1b", "chunks": 3}},
    "sampler_pipe": {**SAMPLER, "devices": 2, "shuffle": True, "trainer": {"use_distributed_sampler": True},
                     "strategy": {"schedule": "1f1b", "chunks": 2}},
    "resumed_from_pipe_on_3": {**RESUME, "devices": 3, "resume": "{runs}/resume_pipe/epoch=1-step=2.ckpt",
                               "strategy": {"schedule": "1f1b", "chunks": 4}},
    # Two data-parallel pipelines of 2 stages on 4 processes, Lightning's sampler giving each pipeline its shard;
    # the reference trains on the union of the shards (the same shuffled order, batches of 2 x 6).
    "dp_gpipe": {"devices": 4, "batch_size": 6, "max_steps": 7, "limit_val_batches": 2,
                 "trainer": {"use_distributed_sampler": True}, "strategy": {"schedule": "gpipe", "chunks": 2,
                                                                          "stages": 2, "balance": [3, 2]}},
    "dp_1f1b": {"devices": 4, "batch_size": 6, "max_steps": 7, "trainer": {"use_distributed_sampler": True},
                "strategy": {"schedule": "1f1b", "chunks": 3, "stages": 2, "balance": [3, 2]}},
    "dp_single": {"batch_size": 12, "max_steps": 7, "limit_val_batches": 2, "sampler_of_one_replica": True},
    # A 2 x 2 checkpoint resumed on 2 x 1, 3 x 1 and 4 x 1 (one batch per epoch, as for the resume tests above).
    "dp_resume_pipe": {**RESUME, **DEEP, "batch_size": 30, "devices": 4, "trainer": {"use_distributed_sampler": True},
                       "strategy": {"schedule": "gpipe", "chunks": 2, "stages": 2}},
    "dp_resume_single": {**RESUME, **DEEP, "sampler_of_one_replica": True},
    "dp_resumed_on_2": {**RESUME, **DEEP, "devices": 2, "sampler_of_one_replica": True,
                        "resume": "{runs}/dp_resume_pipe/epoch=1-step=2.ckpt", "strategy": {"schedule": "gpipe",
                                                                                        "chunks": 2}},
    "dp_resumed_on_4": {**RESUME, **DEEP, "devices": 4, "sampler_of_one_replica": True,
                        "resume": "{runs}/dp_resume_pipe/epoch=1-step=2.ckpt", "strategy": {"schedule": "1f1b",
                                                                                        "chunks": 2}},
    "dp_resumed_on_3": {**RESUME, **DEEP, "devices": 3, "sampler_of_one_replica": True,
                        "resume": "{runs}/dp_resume_pipe/epoch=1-step=2.ckpt", "strategy": {"schedule": "1f1b",
                                                                                        "chunks": 2}},
    # A 2-1 plan on 3 processes (PipeDream's 1F1B-RR): stage 0's two replicas take the batch's halves round robin.
    "rr_gpipe": {"devices": 3, "strategy": {"schedule": "gpipe", "chunks": 2, "plan": "{runs}/plan21.json"}},
    "rr_1f1b": {"devices": 3, "strategy": {"schedule": "1f1b", "chunks": 1, "replicas": [2, 1], "balance": [3, 2]}},
    # The automatic path with replication allowed: whatever the planner picks (2 stages, or 1 stage x 2), 1f1b
    # on the same batches equals one device.
    "auto_replicated": {"devices": 2, "strategy": {"schedule": "1f1b", "chunks": 2, "straight": False}},
    # schedule="auto" with exact=True: whatever the planner picks (split, replicas, schedule, micro-batches,
    # recompute) equals one device.
    "auto_exact": {"devices": 2, "strategy": {"schedule": "auto", "exact": True}},
    "rr_pipedream": {"devices": 3, "model": {"scheduler": False},
                     "strategy": {"schedule": "pipedream", "replicas": [2, 1], "balance": [3, 2]}},
    # The last stage replicated (a 1-2 plan): each replica computes the loss of the micro-batches it owns.
    "rr_last_gpipe": {"devices": 3, "strategy": {"schedule": "gpipe", "chunks": 2, "replicas": [1, 2],
                                                 "balance": [3, 2]}},
    "rr_last_pipedream": {"devices": 3, "model": {"scheduler": False},
                          "strategy": {"schedule": "pipedream", "replicas": [1, 2], "balance": [3, 2]}},
    "rr_evaluate": {**EVALUATE, "devices": 3, "strategy": {"schedule": "1f1b", "chunks": 3, "replicas": [2, 1],
                                                            "balance": [3, 2]}},
    # 5 chunks of a batch of 12 are uneven (3, 3, 2, 2, 2); each rank writes its trace.
    "uneven_pipe": {**UNEVEN, "devices": 3, "strategy": {"schedule": "gpipe", "chunks": 5, "balance": [2, 2, 1],
                                                          "trace": "traces"}},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Train every run of RUNS; returns each one's folder."""
    from lightning_pipedream.plan.partition import Plan, StagePlan

    base = tmp_path_factory.mktemp("runs")
    Plan([StagePlan(["0", "1"]), StagePlan(["2", "3", "4"])], schedule="gpipe", chunks=3).save(base / "plan.json")
    # With stage times (per replica, as the partitioner writes them), so that the fit's end explains the run against it.
    Plan([StagePlan(["0", "1", "2"], replicas=2, compute_s=1e-3, forward_s=3e-4, allreduce_s=2e-4),
          StagePlan(["3", "4"], compute_s=1e-3, forward_s=3e-4)], schedule="gpipe", chunks=2,
         time_per_minibatch=1.2e-3).save(base / "plan21.json")
    for devices in (1, 4, 2, 3):  # in this order: a resumed run reads the checkpoint of a run before it
        group = [[str(base / name), json.loads(json.dumps(options).replace("{runs}", str(base)))]
                 for name, options in RUNS.items() if options.get("devices", 1) == devices]
        (base / f"runs{devices}.json").write_text(json.dumps(group))
        run_script(SCRIPT, base, {"--runs": str(base / f"runs{devices}.json")}, 400)
    return {name: base / name for name in RUNS}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_flushed_schedules_match_single_device(runs, schedule):
    reference, pipe = runs["reference"], runs[schedule]
    assert_same_weights(pipe / "final.ckpt", reference / "final.ckpt")
    assert rank_info(pipe, 0)["losses"] == pytest.approx(rank_info(reference, 0)["losses"], rel=1e-5)
    # Each rank holds only its stage: parameters, optimizer parameters and optimizer state.
    full = rank_info(reference, 0)["parameters"]
    shares = [rank_info(pipe, r) for r in (0, 1)]
    assert [s["parameters"] for s in shares] == [8 * 16 + 16 + 16 * 16 + 16, 16 * 4 + 4]  # balance [3, 2]
    assert sum(s["parameters"] for s in shares) == full
    for s in shares:
        assert s["optimizer_parameters"] == s["parameters"] == s["optimizer_state_tensors"]


def test_pipedream_with_logging_monitoring_checkpoint_and_predict(runs):
    out = runs["pipedream_by_name"]
    metrics = json.loads((out / "metrics.json").read_text())
    # Logged on the last stage, seen by rank 0's callbacks: EarlyStopping stopped after 2 epochs.
    assert {"train_loss", "val_acc", "val_loss", "test_loss"} <= set(metrics)
    assert metrics["epoch"] == 2 and metrics["global_step"] == 10
    best = sorted(out.glob("epoch=*.ckpt"))
    assert len(best) == 1
    # The consolidated checkpoint loads without the strategy and predicts what the pipeline predicted.
    model = TinyClassifier.load_from_checkpoint(out / "final.ckpt", map_location="cpu")
    x = torch.stack([data(24)[i][0] for i in range(24)])
    assert model(x).argmax(-1).tolist() == metrics["predictions"]
    assert rank_info(out, 0)["parameters"] + rank_info(out, 1)["parameters"] == 484


def test_pipedream_steps_make_no_collective_call_and_log_each_minibatch_when_it_finishes(runs):
    out = runs["pipedream_async"]
    per_step = [json.loads((out / f"collectives_rank{r}.json").read_text()) for r in (0, 1)]
    # 8 steps: an epoch of 5 batches (the last drains) and 3 of the next. Step 0 counts the setup too;
    # Lightning's per-batch SIGTERM broadcast is not issued: rank 0's flag travels point to point (issue #52).
    assert [len(steps) for steps in per_step] == [8, 8]
    for steps in per_step:
        assert steps[1:4] == [[], [], []] and steps[6] == [], steps
        # the drains at the epoch's end and at the last step: every stage's staleness, for the logs
        assert steps[4] == steps[7] == ["all_gather/2"], steps
        assert steps[5] == ["all_gather/2"], steps  # an epoch's first batch: did every stage get the same one?
    # Every rank logs the same value at the same step: minibatch t's loss at step t + 1 (stages - 1 late);
    # at the epoch's end the drain delivers what is left.
    losses = [rank_info(out, r)["losses"] for r in (0, 1)]
    assert losses[0] == losses[1]
    assert losses[0][0] is None and None not in losses[0][1:5]
    assert losses[0][1] == pytest.approx(rank_info(runs["reference"], 0)["losses"][0], rel=1e-6)  # both at W(0)


def test_layers_built_in_configure_model_exist_only_on_their_stage(runs):
    # Under the strategy configure_model builds on the meta device: no rank allocated any weight then, and
    # each holds only its stage's afterwards (balanced by parameter bytes: nothing can be profiled on meta).
    shares = [rank_info(runs["meta_pipe"], r) for r in (0, 1)]
    assert [s["built_bytes"] for s in shares] == [0, 0]
    stage_bytes = [4 * (8 * 32 + 32), 4 * (32 * 32 + 32 + 32 * 4 + 4)]  # [Linear(8, 32), Tanh] and the rest
    assert [s["parameter_bytes"] for s in shares] == stage_bytes
    # Each layer's weights come from a seed of its name, so 2 stages train exactly like 1 stage.
    assert rank_info(runs["meta_one_stage"], 0)["parameter_bytes"] == sum(stage_bytes)
    assert_same_weights(runs["meta_pipe"] / "final.ckpt", runs["meta_one_stage"] / "final.ckpt")


@pytest.mark.parametrize("resumed", ["resumed_from_pipe_on_2", "resumed_from_pipe_on_3", "resumed_from_single_on_2"])
def test_resume_equals_uninterrupted(runs, resumed):
    # One batch per epoch keeps the data the same whatever Lightning does to resume a data loader, so the
    # comparison isolates the checkpoint: weights, momentum and LR-scheduler state.
    single = runs["resume_single"]
    assert_same_weights(runs["resume_pipe"] / "final.ckpt", single / "final.ckpt")
    assert_same_weights(runs[resumed] / "final.ckpt", single / "final.ckpt")
    assert rank_info(runs[resumed], 0)["losses"] == pytest.approx(rank_info(single, 0)["losses"][2:], rel=1e-5)


def test_validate_before_the_first_fit_leaves_configure_optimizers_to_the_fit(runs):
    # Its configure_optimizers reads trainer.estimated_stepping_batches, which needs the training data: validate() ran
    # without it, so it never called configure_optimizers; the fit after it trains and checkpoints as one device.
    out, single = runs["validated_first_pipe"], runs["resume_single"]
    assert_same_weights(out / "final.ckpt", single / "final.ckpt")
    got, want = (torch.load(run / "epoch=1-step=2.ckpt", weights_only=False)["optimizer_states"] for run in (out, single))
    assert [sorted(s["state"]) for s in got] == [sorted(s["state"]) for s in want] == [list(range(6))]
    for a, b in zip(got, want, strict=True):
        for i in b["state"]:
            torch.testing.assert_close(a["state"][i], b["state"][i], rtol=1e-5, atol=1e-6)


def test_clipping_accumulation_and_plan_file_match_single_device(runs):
    assert_same_weights(runs["clip_pipe"] / "final.ckpt", runs["clip_single"] / "final.ckpt")
    assert rank_info(runs["clip_pipe"], 0)["parameters"] == 8 * 16 + 16  # stage 0 holds layers 0 and 1


def test_gpipe_on_three_stages_with_uneven_chunks_and_plain_accumulation(runs):
    # No clipping: the 1/k scaling of accumulate_grad_batches alone decides the result.
    pipe = runs["uneven_pipe"]
    assert_same_weights(pipe / "final.ckpt", runs["uneven_single"] / "final.ckpt")
    trace = from_chrome_trace(json.loads((pipe / "traces" / "pipeline_trace.json").read_text()))  # rank 0 merged it
    for rank in range(3):
        ops = [e.action.op for e in trace if e.rank == rank]
        # One epoch of 5 batches (3 steps: groups of 2, 2 and the epoch's last 1), 5 chunks each.
        assert ops.count(Op.FORWARD) == ops.count(Op.BACKWARD) == 5 * 5
        assert ops.count(Op.OPTIMIZER_STEP) == 5


def test_validate_and_predict_without_fitting_equal_one_device(runs):
    got, want = (json.loads((runs[name] / "metrics.json").read_text()) for name in ("evaluate_pipe", "evaluate_single"))
    assert got["predictions"] == want["predictions"]
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
    assert got["val_acc"] == pytest.approx(want["val_acc"], rel=1e-6)


def test_lightning_default_sampler_shuffles_alike_on_every_stage(runs):
    # Lightning's own sampler (use_distributed_sampler=True, shuffled, reshuffled each epoch): every stage
    # sees the same batches, which are those of a sampler with one replica (the data-parallel degree).
    assert_same_weights(runs["sampler_pipe"] / "final.ckpt", runs["sampler_single"] / "final.ckpt")


@pytest.mark.parametrize("name", ["dp_gpipe", "dp_1f1b"])
def test_data_parallel_pipelines_equal_one_device_on_the_union_of_their_shards(runs, name):
    assert_same_weights(runs[name] / "final.ckpt", runs["dp_single"] / "final.ckpt")
    # The logged loss is the mean over the pipelines, which is the union's loss.
    assert rank_info(runs[name], 0)["losses"] == pytest.approx(rank_info(runs["dp_single"], 0)["losses"], rel=1e-5)
    # Stage-major ranks: stage s of pipeline k is rank 2s + k; a stage's gradients are all-reduced over exactly
    # its replicas, and each pipeline's point-to-point traffic stays in its own group.
    groups = [rank_info(runs[name], r)["groups"] for r in range(4)]
    assert [g["replica"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["pipeline"] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_data_parallel_validation_averages_the_shards(runs):
    got, want = (json.loads((runs[n] / "metrics.json").read_text()) for n in ("dp_gpipe", "dp_single"))
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)


@pytest.mark.parametrize("resumed", ["dp_resumed_on_2", "dp_resumed_on_3", "dp_resumed_on_4"])
def test_a_data_parallel_checkpoint_resumes_on_other_shapes(runs, resumed):
    # The 2 x 2 checkpoint after 2 epochs, resumed by one pipeline of 2, 3 and 4 stages on the union batches.
    assert_same_weights(runs["dp_resume_pipe"] / "final.ckpt", runs["dp_resume_single"] / "final.ckpt")
    assert_same_weights(runs[resumed] / "final.ckpt", runs["dp_resume_single"] / "final.ckpt")


@pytest.mark.parametrize("name", ["rr_gpipe", "rr_1f1b", "rr_last_gpipe"])
def test_a_plan_with_unequal_replicas_equals_one_device(runs, name):
    assert_same_weights(runs[name] / "final.ckpt", runs["reference"] / "final.ckpt")
    assert rank_info(runs[name], 0)["losses"] == pytest.approx(rank_info(runs["reference"], 0)["losses"], rel=1e-5)
    groups = [rank_info(runs[name], r)["groups"]["replica"] for r in range(3)]
    # a replicated stage's replicas all-reduce together; a stage with one replica has no group
    assert groups == ([None, [1, 2], [1, 2]] if name == "rr_last_gpipe" else [[0, 1], [0, 1], None])
    assert [rank_info(runs[name], r)["losses"] for r in (1, 2)] == [rank_info(runs[name], 0)["losses"]] * 2
    if name == "rr_gpipe":  # the plan file has stage times: rank 0 explained the fit against it, replicas included
        _check_replicated_explanation(json.loads((runs[name] / "explanation.json").read_text()))


def _check_replicated_explanation(explanation: dict) -> None:
    """The 2-1 plan's explanation: stage 0's two replicas averaged (their range kept), each step holding 2 of the
    plan's minibatches (a plan file without its profile: the run's minibatch, one input replica's half of the batch),
    the plan's all-reduce in the update, and the parts adding up to the gap."""
    parts = explanation["parts_s"]
    assert sum(parts.values()) == pytest.approx(explanation["gap_s"], rel=1e-9, abs=1e-12)
    assert explanation["measured_s"] - explanation["predicted_s"] == pytest.approx(explanation["gap_s"])
    assert explanation["minibatches_per_step"] == 2
    zero, one = explanation["stages"]
    assert (zero["replicas"], one["replicas"]) == (2, 1)
    assert zero["step_min"] <= zero["step"] <= zero["step_max"] and one["step_min"] == one["step_max"] == one["step"]
    assert (zero["predicted_allreduce"], one["predicted_allreduce"]) == (2e-4, 0.0)
    ref = explanation["stages"][explanation["reference_stage"]]
    assert parts["update"] == pytest.approx(ref["update"] - ref["predicted_allreduce"])
    assert all(s["compute"] > 0 and s["step"] > 0 for s in explanation["stages"])


def round_robin_reference(replicas: list[int], minibatch: int) -> tuple[TinyClassifier, RoundRobinRule]:
    """The tiny classifier (balance [3, 2]) trained by PipeDream's 1F1B-RR rule on minibatches of the 36 samples."""
    L.seed_everything(0, verbose=False)
    model = TinyClassifier(scheduler=False)
    rule = RoundRobinRule(model.layers, [3, 2], replicas, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                          nn.functional.cross_entropy)
    x, y = data().tensors
    rule.segment([(x[i:i + minibatch], y[i:i + minibatch]) for i in range(0, 36, minibatch)])
    return model, rule


def test_pipedream_with_unequal_replicas_follows_the_round_robin_rule(runs):
    # PipeDream's 1F1B-RR on 3 processes: each batch's two halves are minibatches 2t and 2t + 1, taken by stage
    # 0's replicas in turn (their updates average the pair); stage 1 takes both, updating after each.
    model, rule = round_robin_reference([2, 1], minibatch=6)  # 3 steps of 12, then the last step drains
    assert_close_to(weights(runs["rr_pipedream"] / "final.ckpt"), model.state_dict())
    # The last step logs its own minibatches' mean loss (the drain delivers it); every rank logged alike.
    losses = [rank_info(runs["rr_pipedream"], r)["losses"] for r in range(3)]
    assert losses[0] == losses[1] == losses[2]
    assert losses[0][-1] == pytest.approx(sum(rule.losses[4:]) / 2, rel=1e-5)


def test_pipedream_with_a_replicated_last_stage_follows_the_round_robin_rule(runs):
    # A 1-2 plan: each batch is one minibatch; the last stage's replicas take them in turn and average each pair.
    model, rule = round_robin_reference([1, 2], minibatch=12)
    assert_close_to(weights(runs["rr_last_pipedream"] / "final.ckpt"), model.state_dict())
    losses = [rank_info(runs["rr_last_pipedream"], r)["losses"] for r in range(3)]
    assert losses[0] == losses[1] == losses[2]
    assert losses[0][-1] == pytest.approx(rule.losses[-1], rel=1e-5)


def assert_close_to(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_the_automatic_plan_may_replicate_and_still_equals_one_device(runs):
    assert_same_weights(runs["auto_replicated"] / "final.ckpt", runs["reference"] / "final.ckpt")
    planned = [rank_info(runs["auto_replicated"], r)["plan_replicas"] for r in (0, 1)]
    assert planned[0] == planned[1] and planned[0] in ([1, 1], [2])  # a straight pipeline or data parallelism


def test_schedule_auto_exact_equals_one_device_and_every_rank_runs_the_same_choice(runs):
    assert_same_weights(runs["auto_exact"] / "final.ckpt", runs["reference"] / "final.ckpt")
    assert rank_info(runs["auto_exact"], 0)["losses"] == pytest.approx(rank_info(runs["reference"], 0)["losses"],
                                                                        rel=1e-5)
    ranks = [rank_info(runs["auto_exact"], r) for r in (0, 1)]
    assert ranks[0]["options"] == ranks[1]["options"] and ranks[0]["balance"] == ranks[1]["balance"]
    assert ranks[0]["options"]["schedule"] in ("gpipe", "1f1b", "zb-h1", "interleaved", "zb-v", "dualpipev")
    assert ranks[0]["plan_replicas"] == ranks[1]["plan_replicas"]


def test_schedule_auto_takes_no_choice_it_makes():
    with pytest.raises(ValueError, match=r"schedule='auto'\) lets the planner choose the schedule, split, replicas, "
                                         r"micro-batches and recompute, but \['balance', 'chunks'\] already decide"):
        PipeDreamStrategy(schedule="auto", balance=[3, 2], chunks=4)
    with pytest.raises(ValueError, match=r"memory_limit= and exact= apply to schedule='auto'"):
        PipeDreamStrategy(schedule="1f1b", memory_limit=1e9)
    with pytest.raises(ValueError, match=r"memory_limit is -1; give bytes per process > 0"):
        PipeDreamStrategy(schedule="auto", memory_limit=-1)


def test_straight_false_leaves_the_choice_to_the_planner():
    with pytest.raises(ValueError, match=r"straight=False\) lets the planner choose stages and replicas, but "
                                         r"\['balance', 'replicas'\] already decide them"):
        PipeDreamStrategy(straight=False, balance=[3, 2], replicas=[2, 1])


def test_the_planner_topology_comes_from_the_cluster():
    from lightning_pipedream.plan.topology import Topology

    assert Topology.of_cluster(4, 1, 1e10).levels == ((4, 1e10),)
    assert Topology.of_cluster(4, 2, [1e10, 1.25e9]).levels == ((4, 1e10), (2, 1.25e9))
    with pytest.raises(ValueError, match=r"give one number .* or two \(\[within a node, between nodes\]\)"):
        Topology.of_cluster(4, 2, [1e10, 1e9, 1e8])


def test_a_plan_with_unequal_replicas_validates_and_predicts_like_one_device(runs):
    # The first replica of each stage evaluates; every rank gets the logs and the predictions.
    got, want = (json.loads((runs[n] / "metrics.json").read_text()) for n in ("rr_evaluate", "evaluate_single"))
    assert got["predictions"] == want["predictions"]
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)


def test_stages_that_see_different_batches_are_stopped(tmp_path):
    # An unseeded shuffle per rank: stage 0's inputs would not belong to the last stage's labels.
    proc = run_tiny(tmp_path, {"devices": 2, "shuffle_per_rank": True, "strategy": {"schedule": "1f1b"},
                               "trainer": {"use_distributed_sampler": False}}, expect_ok=False)
    assert "The pipeline stages received different training batches" in proc.stderr


def test_one_device_is_a_single_stage_run(runs):
    # One stage has nothing in flight: PipeDream's rule reduces to plain training.
    assert_same_weights(runs["one_device_pipedream"] / "final.ckpt", runs["reference"] / "final.ckpt")


def torchrun_two_nodes(out: Path, options: dict, per_node: int) -> None:
    """Two torchrun "nodes" on loopback, ``per_node`` processes each, running tiny.py with ``options`` (each agent a
    fork of this worker's warm zygote, and so are the workers it starts: tests/helpers/zygote.py)."""
    port = free_port()
    env = script_env()
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        env.pop(name, None)  # torchrun's to set, not this worker's
    agents, logs = [], [out / f"torchrun_node{node}.txt" for node in (0, 1)]
    for node, log in enumerate(logs):
        with log.open("w") as err:
            agents.append(start_group(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                 f"--nproc_per_node={per_node}", "--master_addr=127.0.0.1", f"--master_port={port}", str(SCRIPT),
                 str(out), json.dumps(options)], out, env, err))
    deadline = time.monotonic() + 240
    try:
        while any(a.live() for a in agents) and time.monotonic() < deadline:
            for a in agents:
                a.poll()
            time.sleep(0.2)
        left = [pid for a in agents for pid in a.live()]
    finally:
        for a in agents:
            if a.live():
                a.kill_group()
            a.wait()
    assert not left, f"torchrun's processes left after 240 s: {left}\n" + "\n".join(log.read_text()[-3000:] for log in logs)
    for a, log in zip(agents, logs):
        assert a.returncode == 0, log.read_text()[-4000:]


def test_two_pipelines_on_two_nodes_under_torchrun(tmp_path, runs):
    # 2 stages x 2 pipelines over 2 nodes of 2 processes: a stage's replicas share a node (stage-major ranks).
    torchrun_two_nodes(tmp_path, {**RUNS["dp_1f1b"], "devices": 2, "trainer": {"num_nodes": 2,
                                                                             "use_distributed_sampler": True}}, 2)
    assert_same_weights(tmp_path / "final.ckpt", runs["dp_single"] / "final.ckpt")


def test_more_stages_than_layers_is_refused():
    # Every rank makes this check before any collective (tests/runtime/test_engine.py sees it fail on every rank).
    from lightning_pipedream.plan.balance import check_stage_count

    with pytest.raises(ValueError, match=r"The model has 1 layers but 2 stages were asked for; every stage needs at "
                                         r"least one layer. Use at most 1 processes"):
        check_stage_count(1, 2)


def test_a_non_finite_output_stops_training_with_stage_layer_and_step_named(tmp_path):
    # Also the failing-stage path under pipedream: stage 1 raises, stage 0 names it and every rank stops in time
    # (a failing replicated stage under 1f1b is the test below).
    proc = run_tiny(tmp_path, {"devices": 2, "nan_in_last_layer": True,
                               "strategy": {"schedule": "pipedream", "balance": [3, 3], "check_finite": True}},
                    timeout=120, expect_ok=False)  # a rank left waiting would fail the test at 120 s
    assert proc.returncode != 0
    assert ("NonFiniteError: Stage 1: layer '5' (NaNOnThirdCall) produced nan in its output at training step 2 of "
            "epoch 0. Its inputs were finite.") in proc.stderr
    assert "[rank0]: lightning_pipedream.runtime.faults.errors.PeerFailedError: Pipeline stage 1 failed" in proc.stderr


def test_non_finite_values_are_named():
    from lightning_pipedream.strategy.setup.checks import non_finite

    assert non_finite((torch.ones(2), {"a": torch.tensor([1.0, float("inf")])})) == "inf"
    assert non_finite([torch.tensor([float("nan"), float("-inf")]), torch.arange(3)]) == "inf and nan"
    assert non_finite(torch.ones(3)) == ""


def test_a_failing_replicated_stage_stops_every_rank_with_its_error(tmp_path):
    # 2 pipelines x 2 stages: the last stage (ranks 2 and 3) fails; its replicas and the first stage all stop.
    proc = run_tiny(tmp_path, {"devices": 4, "fail_in_last_layer": True, "trainer": {"use_distributed_sampler": True},
                               "strategy": {"schedule": "1f1b", "stages": 2, "balance": [3, 3]}},
                    timeout=120, expect_ok=False)  # a rank left waiting would fail the test at 120 s
    assert proc.returncode != 0
    assert "ValueError: boom on the third forward" in proc.stderr
    # A first-stage rank names the failure (the other may stop on its replica's closed connection first).
    assert any(f"[rank{rank}]: lightning_pipedream.runtime.faults.errors.PeerFailedError: Pipeline stage 1 failed" in
               proc.stderr for rank in (0, 1))


def test_a_stage_without_parameters_is_refused():
    from lightning_pipedream.strategy.setup.checks import check_stage_trains

    with pytest.raises(ValueError, match=r"Stage 1 of balance=\[2, 1, 2\] holds layers \['2'\], which have no trainable "
                                         r"parameters.*Choose a balance \(or fewer stages\)"):
        check_stage_trains(nn.Sequential(OrderedDict([("2", nn.Tanh())])), 1, [2, 1, 2])


def test_bad_strategy_arguments():
    with pytest.raises(ValueError, match="Unknown schedule 'zigzag'. Choose one of: gpipe, 1f1b, pipedream"):
        PipeDreamStrategy(schedule="zigzag")
    with pytest.raises(ValueError, match="chunks must be an integer >= 1, got 0"):
        PipeDreamStrategy(schedule="1f1b", chunks=0)
    with pytest.raises(ValueError, match="schedule='pipedream' runs each batch as one PipeDream minibatch"):
        PipeDreamStrategy(schedule="pipedream", chunks=4)
    with pytest.raises(ValueError, match="start_method='spawn'. is not supported: those launchers return only"):
        PipeDreamStrategy(start_method="spawn")
    with pytest.raises(ValueError, match=r"PipeDreamStrategy\(plan=...\) gives one layer range per process; "
                                         r"schedule='interleaved' with virtual_stages=2 needs processes x 2 of them. "
                                         r"Give balance= with that many layer counts, or drop plan="):
        PipeDreamStrategy(schedule="interleaved", virtual_stages=2, plan="plan.json")


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
