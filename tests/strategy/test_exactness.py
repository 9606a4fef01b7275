"""Trainer(strategy=PipeDreamStrategy(schedule="pipedream")) follows PipeDream's rule exactly, Lightning features on.

Each test trains tests/scripts/rule_trainer.py in a subprocess on 2 or 3 processes and compares every
parameter of the consolidated checkpoint with an independent single-process implementation of the
rule (tests/helpers/pipedream_reference.py), to 1e-5.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from pipedream_reference import Minibatch, PipeDreamRule
from rule_trainer import ResumableBatches, RuleMLP, batches, make_optimizer, make_scheduler
from script_runs import run_script

from lightning_pipedream import PipeDreamStrategy

# Starts several processes: not in the fast suite. The module's three launches (every run of RUNS) are one fixture,
# set up within its first test: that test may take as long as the launches' own limits (3 x 400 s), not pytest's 240.
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1200)]

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "rule_trainer.py"


def run(out: Path, options: dict, timeout: float = 180, expect_ok: bool = True) -> subprocess.CompletedProcess:
    return run_script(SCRIPT, out, options, timeout, expect_ok)


def reference(
    *, balance: list[int], model: dict | None = None, epochs: list[list[int]], accumulate: int = 1,
    drain_after: tuple[int, ...] = (), clip_norm: float | None = None, clip_value: float | None = None,
    vertical_sync: bool = False, frozen_first_layer_epochs: tuple[int, ...] = (), num_batches: int = 6,
    stashing: bool = True, per_step: int = 1,
) -> dict[str, torch.Tensor]:
    """The rule's weights after training on ``epochs`` (each a list of batch indices), draining at each
    epoch's end and after the given numbers of batches into an epoch. ``per_step``: the Trainer's steps each
    took that many of these batches as minibatches (minibatches_per_batch), so a step-wise scheduler changes
    the rate every ``per_step`` minibatches."""
    model = model or {}
    L.seed_everything(0, verbose=False)
    module = RuleMLP(**model)
    kind, lr = model.get("optimizer", "sgd"), model.get("lr", 0.2)
    data = batches(num_batches)
    closes = [[(i + 1) % accumulate == 0 or i == len(epoch) - 1 for i in range(len(epoch))] for epoch in epochs]
    rates = _learning_rates(kind, lr, model.get("scheduler"), [c for epoch in closes for c in epoch][::per_step])
    rates = [rates[t // per_step] for t in range(sum(len(epoch) for epoch in epochs))]
    rule = PipeDreamRule(
        module.layers, balance, lambda params: make_optimizer(kind, lr, params), torch.nn.functional.mse_loss,
        lambda t: {"lr": rates[t]}, accumulate=accumulate, clip_norm=clip_norm, clip_value=clip_value,
        vertical_sync=vertical_sync, stashing=stashing,
    )
    t = 0
    for e, epoch in enumerate(epochs):
        for p in module.layers[0].parameters():
            p.requires_grad_(e not in frozen_first_layer_epochs)
        segment: list[Minibatch] = []
        for i, b in enumerate(epoch):
            segment.append(Minibatch(t, *data[b], closes_group=closes[e][i]))
            t += 1
            if i + 1 in drain_after or i == len(epoch) - 1:
                rule.segment(segment)
                segment = []
    return rule.state_dict("layers.", [str(i) for i in range(len(module.layers))])


def _learning_rates(kind: str, lr: float, scheduler: str | None, closes: list[bool]) -> list[float]:
    """The rate each minibatch is admitted with: the scheduler steps after each minibatch that closes a group."""
    optimizer = make_optimizer(kind, lr, [torch.nn.Parameter(torch.zeros(1))])
    sched = make_scheduler(scheduler, optimizer) if scheduler else None
    rates = []
    for close in closes:
        rates.append(optimizer.param_groups[0]["lr"])
        if close and sched is not None:
            optimizer.step()
            sched.step()
    return rates


def assert_weights(out: Path, want: dict[str, torch.Tensor], name: str = "final.ckpt") -> None:
    got = torch.load(out / name, weights_only=False, map_location="cpu")["state_dict"]
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def result(out: Path) -> dict[str, Any]:
    return json.loads((out / "result.json").read_text())


def assert_validations_saw_their_checkpoints(out: Path, logged: dict[str, float]) -> None:
    """Each checkpoint of ``logged`` (its file name and the validation loss logged at its step), loaded on one device,
    has that loss on the validation batches: each validation saw the model of its step."""
    val = batches(2, seed=9)
    for name, value in logged.items():
        model = RuleMLP.load_from_checkpoint(out / name, map_location="cpu")
        with torch.no_grad():
            losses = [torch.nn.functional.mse_loss(model(x), y) for x, y in val]
        assert float(sum(losses) / len(losses)) == pytest.approx(value, rel=1e-5), name


TWO_EPOCHS = [list(range(6)), list(range(6))]
TWO, THREE = [4, 3], [3, 2, 2]  # balances of 2 and 3 stages
SCHEDULED = {"optimizer": "momentum", "lr": 0.1, "scheduler": "step"}
RESUMED = {"optimizer": "momentum", "lr": 0.05, "scheduler": "step"}
MID_EPOCH_CHECKPOINTS = {"every_n_train_steps": 2, "save_top_k": -1, "filename": "{step}"}


def pipedream(balance: list[int], **options: Any) -> dict[str, Any]:
    return {"devices": len(balance), "strategy": {"schedule": "pipedream", "balance": balance, **options}}


def accumulated(balance: list[int], clip: str | None) -> dict[str, Any]:
    # 5 batches with accumulate_grad_batches=2: groups {0,1}, {2,3}, {4} (Lightning steps at the epoch's end).
    trainer: dict[str, Any] = {"accumulate_grad_batches": 2}
    if clip is not None:
        trainer.update(gradient_clip_val=CLIP_VALUES[clip], gradient_clip_algorithm=clip)
    options = {**pipedream(balance), "model": SCHEDULED, "batches": 5, "trainer": trainer}
    if clip is None:
        options["unfreeze_at_epoch"] = 1  # and the first layer frozen in the first epoch
    return options


CLIP_VALUES = {"value": 0.01, "norm": 0.05}
# Every successful training the tests compare, by name. The runs of one process count share one launch of
# rule_trainer.py (--runs): starting the processes costs more than these trainings. "{runs}": their folder.
RUNS: dict[str, dict[str, Any]] = {
    "2-sgd-steplr": {**pipedream(TWO), "model": {"optimizer": "sgd", "scheduler": "step"}},
    "3-adam-lambdalr": {**pipedream(THREE), "model": {"optimizer": "adam", "lr": 0.01, "scheduler": "lambda"}},
    "3-momentum-vertical-sync": {**pipedream(THREE, vertical_sync=True),
                                 "model": {"optimizer": "momentum", "lr": 0.05, "scheduler": "step"}},
    "no-stashing": pipedream(TWO, weight_stashing=False),
    "accumulate-2": accumulated(TWO, None),
    "accumulate-value-2": accumulated(TWO, "value"),
    "accumulate-norm-3": accumulated(THREE, "norm"),
    "max-steps-3": {**pipedream(THREE), "trainer": {"max_steps": 8}},
    "few-batches-3": {**pipedream(THREE), "batches": 2},
    "stop-callback": {**pipedream(TWO), "stop_at": 3},  # should_stop set by a callback after 3 batches
    # EarlyStopping on val_loss in "max" mode: the second validation (after batch 4) does not improve
    "stop-early-stopping": {**pipedream(TWO), "early_stopping": {"monitor": "val_loss", "mode": "max", "patience": 0},
                            "trainer": {"val_check_interval": 2, "limit_val_batches": 2}},
    "bf16": {**pipedream(TWO), "trainer": {"precision": "bf16-mixed", "val_check_interval": 2, "limit_val_batches": 1,
                                           "gradient_clip_val": 0.05}},
    "checkpoints-whole": {**pipedream(TWO), "model": RESUMED, "checkpoint": MID_EPOCH_CHECKPOINTS},
    "checkpoints-resumed": {**pipedream(TWO), "model": RESUMED, "checkpoint": MID_EPOCH_CHECKPOINTS,
                            "resume": "{runs}/checkpoints-whole/step=2.ckpt"},
    # Two data-parallel pipelines of 2 stages: each reads half of every batch; a stage's replicas sum their
    # gradients (each loss counting 1/2), so the rule applies to the whole batches.
    "data-parallel": {**pipedream(TWO, stages=2), "devices": 4, "pipelines": 2, "model": SCHEDULED},
    "validation": {**pipedream(TWO), "trainer": {"val_check_interval": 2, "limit_val_batches": 2},
                   "checkpoint": {"monitor": "val_loss", "save_top_k": -1, "filename": "{step}"}},
    # on_divergence='flush': a normal run is left alone; a planted blow-up (batch 3's loss x 1e4) is caught when its
    # loss reaches every rank (step 4), and the run goes back to the weights of the last drain (the start) and on
    # under 1f1b from batch 5
    "guard-normal-3": pipedream(THREE, on_divergence="flush"),
    "guard-blow-up-2": {**pipedream(TWO, on_divergence="flush"), "model": {"blow_up_at": 3}},
    # minibatches_per_batch: each Trainer batch is 3 (2) of the rule's minibatches, each with its own update;
    # the scheduler steps once per Trainer step; validation in the middle of the epoch drains between steps. With
    # two data-parallel pipelines each reads half of every merged batch: its minibatch j is half of the rule's j.
    "3-per-batch-2x2": {**pipedream(TWO, stages=2, minibatches_per_batch=3), "devices": 4, "pipelines": 2,
                        "model": SCHEDULED, "merge": 3},
    # 7 batches of 8 merged by 4: Trainer batches of 32 and 24 rows, the second cut into 4 minibatches of 6
    "4-per-batch-ragged": {**pipedream(TWO, minibatches_per_batch=4), "merge": 4, "batches": 7},
    "2-per-batch-3-vertical-sync": {**pipedream(THREE, minibatches_per_batch=2, vertical_sync=True),
                                    "model": {"optimizer": "adam", "lr": 0.01}, "merge": 2,
                                    "trainer": {"val_check_interval": 2, "limit_val_batches": 1}},
}


# The newer schedules (issue 13) through the Trainer: one epoch of NEWER_BATCHES each, in the same launches.
NEWER_BATCHES = 4


def newer(schedule: str, balance: list[int], devices: int, **options: Any) -> dict[str, Any]:
    return {"devices": devices, "strategy": {"schedule": schedule, "balance": balance, **options},
            "trainer": {"max_epochs": 1}, "batches": NEWER_BATCHES}


INTERLEAVED_BALANCE = {2: [2, 2, 2, 1], 3: [2, 1, 1, 1, 1, 1]}  # 2 model chunks per process
for _p in (2, 3):
    for _m in (2, 4, 8):
        RUNS[f"zb-h1-{_p}x{_m}"] = newer("zb-h1", TWO if _p == 2 else THREE, _p, chunks=_m)
        RUNS[f"interleaved-{_p}x{_m}"] = newer("interleaved", INTERLEAVED_BALANCE[_p], _p, chunks=_m, virtual_stages=2)
    RUNS[f"2bw-{_p}x4"] = newer("2bw", TWO if _p == 2 else THREE, _p, chunks=4)
RUNS["1f1b-recompute-2x4"] = newer("1f1b", TWO, 2, chunks=4, recompute=True)
RUNS["1f1b-recompute-first-2x4"] = newer("1f1b", TWO, 2, chunks=4, recompute=[True, False])  # stage 0 only
# Validation over model chunks (the interleaved layout's forwards only), after batches 2 and 4.
RUNS["interleaved-validation-2x4"] = {
    **newer("interleaved", INTERLEAVED_BALANCE[2], 2, chunks=4, virtual_stages=2),
    "trainer": {"max_epochs": 1, "val_check_interval": 2, "limit_val_batches": 2},
    "checkpoint": {"monitor": "val_loss", "save_top_k": -1, "filename": "{step}"},
}
RUNS["2bw-recompute-2x4"] = newer("2bw", TWO, 2, chunks=4, recompute=True)
# Two epochs with momentum, a per-step StepLR and logging on (each epoch ends in a drain for 2bw).
for _name, _schedule, _p, _balance, _options in (
    ("zb-h1", "zb-h1", 2, TWO, {}),
    ("interleaved", "interleaved", 3, INTERLEAVED_BALANCE[3], {"virtual_stages": 2}),
    ("2bw", "2bw", 3, THREE, {}),
):
    RUNS[f"{_name}-two-epochs-{_p}x4"] = {**newer(_schedule, _balance, _p, chunks=4, **_options),
                                          "model": SCHEDULED, "trainer": {"max_epochs": 2}}

# The V schedules (issue 43): two chunks per process in a V, the loss on rank 0. Two epochs with momentum, a per-step
# StepLR, clipping by the whole model's norm, validation (and checkpoints) every 2 batches; then a checkpoint of the
# zb-v run, taken in the middle of its first epoch, resumes under 1f1b (the single-device form takes any layout).
V_CLIP = 0.05
for _schedule in ("zb-v", "dualpipev"):
    RUNS[f"{_schedule}-two-epochs-2x4"] = {
        **newer(_schedule, INTERLEAVED_BALANCE[2], 2, chunks=4), "model": SCHEDULED,
        "trainer": {"max_epochs": 2, "gradient_clip_val": V_CLIP, "val_check_interval": 2, "limit_val_batches": 2},
        "checkpoint": {"monitor": "val_loss", "save_top_k": -1, "filename": "{step}"}}
# Three processes (6 chunks): one epoch each, dualpipev at its least micro-batches (2 x 3).
RUNS["zb-v-3x4"] = newer("zb-v", INTERLEAVED_BALANCE[3], 3, chunks=4)
RUNS["dualpipev-3x6"] = newer("dualpipev", INTERLEAVED_BALANCE[3], 3, chunks=6)
# Four processes (8 chunks of an 11-layer Sequential, one or two layers each): two epochs with momentum, a per-step
# StepLR and clipping by the norm; dualpipev at its least micro-batches (2 x 4).
V4 = {"model": {**SCHEDULED, "deeper": 2}, "trainer": {"max_epochs": 2, "gradient_clip_val": V_CLIP}}
V4_BALANCE = [2, 2, 2, 1, 1, 1, 1, 1]
for _schedule in ("zb-v", "dualpipev"):
    RUNS[f"{_schedule}-two-epochs-4x8"] = {**newer(_schedule, V4_BALANCE, 4, chunks=8), **V4}
RUNS["zb-v-resumed-under-1f1b-2"] = {**newer("1f1b", TWO, 2, chunks=2), "model": SCHEDULED,
                                     "trainer": {"max_epochs": 2, "gradient_clip_val": V_CLIP},
                                     "resume": "{runs}/zb-v-two-epochs-2x4/step=2.ckpt"}

# 16-mixed under a flushed schedule: one loss scale, grown every 2 steps; stage 0's gradient overflows at step 2, and
# every stage must skip that step and back off the scale together (the reference: one device, same plugin).
FP16 = {"model": {"overflow_at": 2}, "fp16": {"init_scale": 1024.0, "growth_interval": 2}, "trainer": {"max_epochs": 1},
        "batches": 6}
RUNS["fp16-1f1b-2"] = {**FP16, "devices": 2, "strategy": {"schedule": "1f1b", "balance": TWO}}
RUNS["fp16-zb-h1-3"] = {**FP16, "devices": 3, "strategy": {"schedule": "zb-h1", "balance": THREE}}

# Two data-parallel pipelines of 2 stages whose stage replicas shard weights, gradients and optimizer state (FSDP2):
# equal to one device on whole batches (momentum, a step-wise scheduler, clipping by the global norm, validation in
# the middle of each epoch); a checkpoint written sharded resumes sharded, on one pipeline (2x1) and on one device.
SHARDED = {"devices": 4, "pipelines": 2, "model": SCHEDULED, "checkpoint": MID_EPOCH_CHECKPOINTS,
           "trainer": {"gradient_clip_val": 0.05, "val_check_interval": 3, "limit_val_batches": 1}}
RUNS["shard-full-1f1b-2x2"] = {**SHARDED, "strategy": {"schedule": "1f1b", "balance": TWO, "stages": 2, "chunks": 2,
                                                       "shard": "full"}}
RUNS["shard-grad_op-gpipe-2x2"] = {**SHARDED, "strategy": {"schedule": "gpipe", "balance": TWO, "stages": 2,
                                                           "chunks": 2, "shard": "grad_op"}}
# Pure FSDP, which the planner may choose: one stage on 4 processes, its replicas sharded.
RUNS["shard-full-1f1b-1x4"] = {**{k: v for k, v in SHARDED.items() if k != "checkpoint"}, "pipelines": 4,
                               "strategy": {"schedule": "1f1b", "balance": [7], "stages": 1, "chunks": 2,
                                            "shard": "full"}}
# Sharded stages that recompute their forward in the backward (FSDP2 gathers the weights again for the replay).
RUNS["shard-full-1f1b-recompute-2x2"] = {**{k: v for k, v in SHARDED.items() if k != "checkpoint"},
                                         "strategy": {**RUNS["shard-full-1f1b-2x2"]["strategy"], "recompute": True}}
# Interleaved data-parallel pipelines, whole and sharded (each model chunk sharded as a root of its own).
RUNS["interleaved-dp-2x2"] = {**newer("interleaved", INTERLEAVED_BALANCE[2], 4, chunks=2, virtual_stages=2, stages=2),
                              "pipelines": 2}
RUNS["shard-full-interleaved-2x2"] = {**{k: v for k, v in SHARDED.items() if k != "checkpoint"},
                                      "strategy": {"schedule": "interleaved", "balance": INTERLEAVED_BALANCE[2],
                                                   "stages": 2, "chunks": 2, "virtual_stages": 2, "shard": "full"}}
# Zero bubble with shards: the split backward keeps each stage's weights gathered through the step and reduce-scatters
# after its last weight half (here with accumulate_grad_batches=2: the reduce-scattered shards add up over 2 steps);
# under bf16-mixed the weight halves' bf16 gradients add up in float32.
RUNS["shard-full-zb-h1-accumulate-2x2"] = {
    **{k: v for k, v in SHARDED.items() if k != "checkpoint"}, "batches": 5,
    "trainer": {**SHARDED["trainer"], "accumulate_grad_batches": 2},
    "strategy": {"schedule": "zb-h1", "balance": TWO, "stages": 2, "chunks": 4, "shard": "full"}}
RUNS["shard-bf16-zb-h1-2x2"] = {**{k: v for k, v in SHARDED.items() if k != "checkpoint"},
                                "trainer": {**SHARDED["trainer"], "precision": "bf16-mixed"},
                                "strategy": {"schedule": "zb-h1", "balance": TWO, "stages": 2, "chunks": 2,
                                             "shard": "grad_op"}}
RUNS["shard-resumed-2x2"] = {**RUNS["shard-full-1f1b-2x2"], "resume": "{runs}/shard-full-1f1b-2x2/step=2.ckpt"}
RUNS["shard-resumed-2x1"] = {"devices": 2, "model": SCHEDULED, "trainer": {"gradient_clip_val": 0.05},
                             "strategy": {"schedule": "1f1b", "balance": TWO, "chunks": 2},
                             "resume": "{runs}/shard-full-1f1b-2x2/step=2.ckpt"}

# bf16-mixed with shards: FSDP2's policy gathers each stage's weights in bf16 (float32 shards, gradient sums and
# optimizer state) under Lightning's autocast; compared with one device under bf16-mixed fed the same micro-batches.
# 16-mixed with shards: an overflow in one unit of stage 0's first layer sits in one replica's shard alone; every rank
# must skip that step and keep one device's scale (the max over the pipeline, then over the stage's replicas).
RUNS["fp16-shard-1f1b-2x2"] = {**FP16, "model": {"overflow_unit_at": 2}, "devices": 4, "pipelines": 2,
                               "strategy": {"schedule": "1f1b", "balance": TWO, "stages": 2, "chunks": 2,
                                            "shard": "full"}}
RUNS["shard-bf16-1f1b-2x2"] = {**{k: v for k, v in SHARDED.items() if k != "checkpoint"},
                               "trainer": {**SHARDED["trainer"], "precision": "bf16-mixed"},
                               "strategy": {"schedule": "1f1b", "balance": TWO, "stages": 2, "chunks": 2, "shard": "full"},
                               "record_weight_dtypes": True}

# These runs take the transport that NCCL needs (each direction of a link on a process group of its own) over gloo,
# so that real processes run the code GPUs run; the others take the CPU default (shared memory).
DIRECTIONAL = ["3-momentum-vertical-sync", "data-parallel", "validation", "guard-blow-up-2", "bf16", "checkpoints-whole",
               "3-per-batch-2x2", "2-per-batch-3-vertical-sync", "zb-h1-2x4", "zb-h1-3x8", "interleaved-2x8",
               "interleaved-3x4", "2bw-3x4", "interleaved-validation-2x4", "zb-h1-two-epochs-2x4",
               "interleaved-two-epochs-3x4", "2bw-two-epochs-3x4", "1f1b-recompute-first-2x4", "fp16-zb-h1-3",
               "zb-v-two-epochs-2x4", "dualpipev-two-epochs-2x4"]
for _name in DIRECTIONAL[1:]:
    RUNS[_name]["transport"] = "directional"  # LIGHTNING_PIPEDREAM_TRANSPORT
RUNS[DIRECTIONAL[0]]["strategy"]["transport"] = "directional"  # PipeDreamStrategy(transport=...)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Train every run of RUNS; returns each one's folder."""
    base = tmp_path_factory.mktemp("rule")
    for devices in (4, 3, 2):  # the 2-process runs resume from a 4-process one's checkpoint
        group = [[str(base / name), json.loads(json.dumps(options).replace("{runs}", str(base)))]
                 for name, options in RUNS.items() if options["devices"] == devices]
        (base / f"runs{devices}.json").write_text(json.dumps(group))
        run(base, {"--runs": str(base / f"runs{devices}.json")}, timeout=400)
    return {name: base / name for name in RUNS}


@pytest.mark.parametrize("name,extra", [
    ("2-sgd-steplr", {}), ("3-adam-lambdalr", {}), ("3-momentum-vertical-sync", {"vertical_sync": True}),
])
def test_two_epochs_follow_the_rule(runs, name, extra):
    options = RUNS[name]
    want = reference(balance=options["strategy"]["balance"], model=options["model"], epochs=TWO_EPOCHS, **extra)
    assert_weights(runs[name], want)
    assert result(runs[name])["global_step"] == 12


@pytest.mark.parametrize("name,per_step,extra", [
    ("3-per-batch-2x2", 3, {}), ("2-per-batch-3-vertical-sync", 2, {"vertical_sync": True, "drain_after": (4,)}),
])
def test_several_minibatches_per_batch_follow_the_rule(runs, name, per_step, extra):
    """Each Trainer batch of ``per_step`` minibatches trains as that many PipeDream steps (one update each)."""
    options = RUNS[name]
    want = reference(balance=options["strategy"]["balance"], model=options["model"], epochs=TWO_EPOCHS,
                     per_step=per_step, **extra)
    assert_weights(runs[name], want)
    got = result(runs[name])
    assert got["global_step"] == 12 // per_step  # a step is a batch: max_steps and schedulers count batches
    assert 0 < got["metrics"]["train_loss"] < 10


def test_a_smaller_last_batch_is_cut_into_as_many_near_equal_minibatches(runs):
    L.seed_everything(0, verbose=False)
    module = RuleMLP()
    data = batches(7)
    last = tuple(torch.cat(column) for column in zip(*data[4:]))
    minibatches = data[:4] + [tuple(t.tensor_split(4)[j] for t in last) for j in range(4)]
    rule = PipeDreamRule(module.layers, TWO, lambda params: make_optimizer("sgd", 0.2, params),
                         torch.nn.functional.mse_loss, lambda t: {"lr": 0.2})
    for epoch in range(2):
        rule.segment([Minibatch(8 * epoch + i, *mb) for i, mb in enumerate(minibatches)])
    assert_weights(runs["4-per-batch-ragged"], rule.state_dict("layers.", [str(i) for i in range(len(module.layers))]))
    assert result(runs["4-per-batch-ragged"])["global_step"] == 4


def test_without_weight_stashing_the_backward_uses_the_newest_weights(runs):
    # The paper's ablation: each stage's backward runs at its live weights on the activations its forward kept.
    want = reference(balance=TWO, epochs=TWO_EPOCHS, stashing=False)
    assert_weights(runs["no-stashing"], want)
    stashed = reference(balance=TWO, epochs=TWO_EPOCHS)
    assert max((want[k] - stashed[k]).abs().max().item() for k in want) > 1e-4  # the two rules differ here


@pytest.mark.parametrize("name,balance,clip", [
    ("accumulate-2", TWO, None), ("accumulate-value-2", TWO, "value"), ("accumulate-norm-3", THREE, "norm"),
])
def test_accumulation_and_clipping_follow_the_rule(runs, name, balance, clip):
    clip_args = {f"clip_{clip}": CLIP_VALUES[clip]} if clip is not None else {}
    frozen = (0,) if clip is None else ()
    epochs = [list(range(5)), list(range(5))]
    assert_weights(runs[name], reference(balance=balance, model=SCHEDULED, epochs=epochs, accumulate=2,
                                         num_batches=5, frozen_first_layer_epochs=frozen, **clip_args))
    assert result(runs[name])["global_step"] == 6


def test_max_steps_in_the_middle_of_an_epoch(runs):
    assert_weights(runs["max-steps-3"], reference(balance=THREE, epochs=[list(range(6)), [0, 1]]))
    assert result(runs["max-steps-3"])["global_step"] == 8


def test_fewer_batches_than_stages(runs):
    assert_weights(runs["few-batches-3"], reference(balance=THREE, epochs=[[0, 1], [0, 1]], num_batches=2))


def test_stopping_in_the_middle_of_an_epoch(runs):
    assert_weights(runs["stop-callback"], reference(balance=TWO, epochs=[[0, 1, 2]]))
    assert result(runs["stop-callback"])["global_step"] == 3
    assert_weights(runs["stop-early-stopping"], reference(balance=TWO, epochs=[[0, 1, 2, 3]], drain_after=(2,)))
    assert result(runs["stop-early-stopping"])["global_step"] == 4


def test_bf16_with_clipping_and_mid_epoch_validation_follows_the_rule(runs):
    # bf16 autocast on CPU: the same rule, to bf16's precision (the reference runs in float32).
    want = reference(balance=TWO, epochs=TWO_EPOCHS, drain_after=(2, 4), clip_norm=0.05)
    got = torch.load(runs["bf16"] / "final.ckpt", weights_only=False, map_location="cpu")["state_dict"]
    L.seed_everything(0, verbose=False)
    initial = RuleMLP().state_dict()
    for key in want:
        moved = (want[key] - initial[key]).abs().max()
        error = (got[key] - want[key]).abs().max()
        assert error < 0.05 * moved + 2e-3, f"{key}: off by {error:.2e} after moving {moved:.2e}"


def test_checkpoint_in_the_middle_of_an_epoch_then_resume(runs):
    # A checkpoint drains the pipeline: the run equals the rule with drains after batches 2 and 4 of each epoch,
    # and resuming from the step-2 checkpoint continues exactly where it left.
    want = reference(balance=TWO, model=RESUMED, epochs=TWO_EPOCHS, drain_after=(2, 4))
    assert_weights(runs["checkpoints-whole"], want)
    assert_weights(runs["checkpoints-resumed"], want)


def test_data_parallel_pipelines_follow_the_rule_on_whole_batches(runs):
    assert_weights(runs["data-parallel"], reference(balance=TWO, model=SCHEDULED, epochs=TWO_EPOCHS))


def test_mid_epoch_validation_sees_the_checkpointed_model(runs):
    out = runs["validation"]
    assert_weights(out, reference(balance=TWO, epochs=TWO_EPOCHS, drain_after=(2, 4)))
    logged = result(out)["checkpoints"]
    assert sorted(logged) == [f"step={s}.ckpt" for s in (10, 12, 2, 4, 6, 8)]
    assert_validations_saw_their_checkpoints(out, logged)


@pytest.mark.parametrize("error", ["interrupt", "crash"])
def test_interrupted_mid_epoch_exits_and_keeps_the_last_good_checkpoint(tmp_path, error):
    proc = run(tmp_path, {"devices": 2, "strategy": {"schedule": "pipedream", "balance": [4, 3]},
                          "interrupt": {"batch": 3, "rank": 1, "error": error}, "on_exception_checkpoint": True,
                          "checkpoint": {"every_n_train_steps": 2, "save_top_k": -1, "filename": "{step}"}},
               timeout=120, expect_ok=False)  # a rank left waiting would fail the test at 120 s
    assert proc.returncode != 0
    assert "PipeDreamStrategy does not save a checkpoint after a pipeline step failed or was interrupted" in proc.stderr
    assert not (tmp_path / "on_exception.ckpt").exists()
    # The checkpoint of step 2 is whole: it equals the rule drained after 2 batches.
    want = reference(balance=[4, 3], epochs=[[0, 1]])
    assert_weights(tmp_path, want, "step=2.ckpt")


def test_a_kill_while_saving_keeps_the_previous_checkpoint(tmp_path):
    # Rank 0 is SIGKILLed halfway through writing the step-4 checkpoint over the step-2 one at the same path.
    latest = {"every_n_train_steps": 2, "save_top_k": 1, "filename": "latest", "enable_version_counter": False}
    common = {**pipedream(TWO), "model": RESUMED, "checkpoint": latest}
    proc = run(tmp_path / "killed", {**common, "kill_during_save": 2}, timeout=120, expect_ok=False)
    assert proc.returncode != 0
    assert_weights(tmp_path / "killed", reference(balance=TWO, model=RESUMED, epochs=[[0, 1]]), "latest.ckpt")
    # Resuming from it continues as the uninterrupted run (which drained at each checkpoint) does.
    run(tmp_path / "resumed", {**common, "resume": str(tmp_path / "killed" / "latest.ckpt")})
    assert_weights(tmp_path / "resumed", reference(balance=TWO, model=RESUMED, epochs=TWO_EPOCHS, drain_after=(2, 4)))


# ------------------------------------------------------------------ refused, with what to do instead
class Manual(RuleMLP):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class WithLBFGS(RuleMLP):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


class AddsParamGroup(L.Callback):
    """What BackboneFinetuning does when it unfreezes: a new parameter group in the middle of training."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            trainer.optimizers[0].add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})


def _fit_one_device(model: L.LightningModule, strategy: PipeDreamStrategy | None = None, **trainer_args: Any) -> None:
    strategy = strategy if strategy is not None else PipeDreamStrategy(schedule="pipedream")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, **trainer_args)
    trainer.fit(model, ResumableBatches(batches(4)))


def test_what_is_refused_says_what_to_use_instead():
    with pytest.raises(ValueError, match=r"uses manual optimization \(automatic_optimization=False\), which "
                                         r"PipeDreamStrategy does not support.*Use automatic optimization"):
        _fit_one_device(Manual())
    with pytest.raises(ValueError, match="does not support LBFGS .* Use an optimizer that steps once"):
        _fit_one_device(WithLBFGS())
    scaler = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="does not support precision='16-mixed' with a gradient scaler.*"
                                         "Use precision='bf16-mixed'"):
        _fit_one_device(RuleMLP(), plugins=[scaler])
    with pytest.raises(RuntimeError, match="The optimizer's parameter groups changed during training .*"
                                           "BackboneFinetuning.*unfreeze by setting requires_grad=True"):
        _fit_one_device(RuleMLP(), callbacks=[AddsParamGroup()])
    with pytest.raises(ValueError, match=r"PipeDreamStrategy\(minibatches_per_batch=2\) makes an update per "
                                         r"minibatch; accumulate_grad_batches=2 would add up several\. Use a larger "
                                         "batch with fewer minibatches_per_batch, or drop accumulate_grad_batches."):
        _fit_one_device(RuleMLP(), PipeDreamStrategy(minibatches_per_batch=2), accumulate_grad_batches=2)


def test_cpu_ranks_keep_freed_memory_unless_told_not_to(monkeypatch):
    from lightning_pipedream.runtime.execution import allocator

    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append("keep") or True)
    monkeypatch.setattr(allocator, "return_freed_memory", lambda: calls.append("return") or True)
    _fit_one_device(RuleMLP())
    assert calls == ["keep", "return"]  # from setup to teardown
    _fit_one_device(RuleMLP(), PipeDreamStrategy(schedule="pipedream", keep_freed_memory=False))
    assert calls == ["keep", "return"]


class Backwards(torch.utils.data.Sampler):
    """A custom order (what a language model's stream sampler gives): the dataset back to front."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))


class RecordsBatches(RuleMLP):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.seen.append(float(batch[0][0, 0]))


def test_a_custom_sampler_keeps_its_order():
    # Lightning wraps a custom sampler in a DistributedSamplerWrapper with shuffle=True, which permutes its order.
    x = torch.arange(6.0).repeat_interleave(4).reshape(6, 4)  # sample i's first input is i
    data = torch.utils.data.TensorDataset(x, torch.zeros(6, 1))
    model = RecordsBatches()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=PipeDreamStrategy(schedule="pipedream"), max_epochs=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=2, sampler=Backwards(6)))
    assert model.seen == [5.0, 3.0, 1.0] * 2


class TwoOptimizers(RuleMLP):
    """One optimizer per half of the model (what a GAN or a per-part learning rate would do)."""

    def configure_optimizers(self):
        return [torch.optim.SGD(self.layers[:4].parameters(), lr=0.1),
                torch.optim.SGD(self.layers[4:].parameters(), lr=0.1)]


class TwoOptimizersManual(TwoOptimizers):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def test_several_optimizers_are_refused():
    # Lightning's own message points to manual optimization, which the strategy refuses: say what works instead.
    with pytest.raises(ValueError, match=r"configure_optimizers returns 2 optimizers; PipeDreamStrategy trains with "
                                         r"one .* Use one optimizer with a parameter group per part of the model"):
        _fit_one_device(TwoOptimizers())
    with pytest.raises(ValueError, match=r"uses manual optimization \(automatic_optimization=False\)"):
        _fit_one_device(TwoOptimizersManual())


# ------------------------------------------------------------------ the newer schedules (issue 13)
def one_device(num_batches: int = NEWER_BATCHES) -> dict[str, torch.Tensor]:
    """One epoch of plain SGD on one device (the pipeline rule with one stage is synchronous training)."""
    return reference(balance=[7], epochs=[list(range(num_batches))], num_batches=num_batches)


def two_bw_rule(num_batches: int = NEWER_BATCHES, epochs: int = 1, model: dict | None = None) -> dict[str, torch.Tensor]:
    """PipeDream-2BW's rule in one process: W(t+1) = W(t) - lr_t * grad f_t(W(t-1)) (through the optimizer, with
    the rate minibatch t was admitted with), W(-1) = W(0) after every drain (each epoch ends in one); every
    stage uses the same delay, so the stages need no separate treatment."""
    model = model or {}
    kind, lr = model.get("optimizer", "sgd"), model.get("lr", 0.2)
    L.seed_everything(0, verbose=False)
    module = RuleMLP(**model)
    optimizer = make_optimizer(kind, lr, list(module.parameters()))
    rates = _learning_rates(kind, lr, model.get("scheduler"), [True] * (num_batches * epochs))
    t = 0
    for _ in range(epochs):
        before = {k: p.detach().clone() for k, p in module.named_parameters()}  # after a drain: no delay yet
        for x, y in batches(num_batches):
            params = {k: w.clone().requires_grad_() for k, w in before.items()}
            loss = torch.nn.functional.mse_loss(torch.func.functional_call(module, params, (x,)), y)
            grads = torch.autograd.grad(loss, list(params.values()))
            before = {k: p.detach().clone() for k, p in module.named_parameters()}
            for group in optimizer.param_groups:
                group["lr"] = rates[t]
            for p, g in zip(module.parameters(), grads):
                p.grad = g
            optimizer.step()
            t += 1
    return module.state_dict()


@pytest.mark.parametrize("schedule", ["zb-h1", "interleaved"])
@pytest.mark.parametrize("stages", [2, 3])
def test_zero_bubble_and_interleaved_equal_one_device(runs, schedule, stages):
    want = one_device()
    for chunks in (2, 4, 8):
        assert_weights(runs[f"{schedule}-{stages}x{chunks}"], want)
        assert result(runs[f"{schedule}-{stages}x{chunks}"])["global_step"] == NEWER_BATCHES


@pytest.mark.parametrize("stages", [2, 3])
def test_two_bw_follows_its_rule(runs, stages):
    want = two_bw_rule()
    assert_weights(runs[f"2bw-{stages}x4"], want)
    assert max((want[k] - v).abs().max().item() for k, v in one_device().items()) > 1e-4  # not synchronous


def test_interleaved_validation_sees_the_model_of_its_step(runs):
    out = runs["interleaved-validation-2x4"]
    assert_weights(out, one_device())
    logged = result(out)["checkpoints"]
    assert sorted(logged) == ["step=2.ckpt", "step=4.ckpt"]
    assert_validations_saw_their_checkpoints(out, logged)


@pytest.mark.parametrize("name", ["zb-h1-two-epochs-2x4", "interleaved-two-epochs-3x4"])
def test_zero_bubble_and_interleaved_over_two_epochs_with_a_scheduler(runs, name):
    want = reference(balance=[7], model=SCHEDULED, epochs=[list(range(NEWER_BATCHES))] * 2,
                     num_batches=NEWER_BATCHES)
    assert_weights(runs[name], want)
    assert result(runs[name])["global_step"] == 2 * NEWER_BATCHES


def test_two_bw_over_two_epochs_with_a_scheduler(runs):
    assert_weights(runs["2bw-two-epochs-3x4"], two_bw_rule(epochs=2, model=SCHEDULED))
    assert result(runs["2bw-two-epochs-3x4"])["global_step"] == 2 * NEWER_BATCHES


def test_recompute_through_the_trainer(runs):
    assert_weights(runs["1f1b-recompute-2x4"], one_device())
    assert_weights(runs["1f1b-recompute-first-2x4"], one_device())
    assert_weights(runs["2bw-recompute-2x4"], two_bw_rule())


def test_the_divergence_guard_leaves_a_normal_run_alone_and_logs_each_stages_staleness(runs):
    assert_weights(runs["guard-normal-3"], reference(balance=THREE, epochs=TWO_EPOCHS))
    metrics = result(runs["guard-normal-3"])["metrics"]
    assert "pipeline/switched_to_1f1b" not in metrics
    # PipeDream's staleness, measured from the weight versions: stage s updates weights stages - 1 - s updates newer
    # than those its forward used (fewer while the pipeline fills: the means are lower)
    assert [metrics[f"pipeline/staleness_max_stage{s}"] for s in range(3)] == [2.0, 1.0, 0.0]
    assert 1.0 < metrics["pipeline/staleness_stage0"] < 2.0 and metrics["pipeline/staleness_stage2"] == 0.0


def test_staleness_of_vertical_sync_and_2bw(runs):
    vertical = result(runs["3-momentum-vertical-sync"])["metrics"]
    assert [vertical[f"pipeline/staleness_max_stage{s}"] for s in range(3)] == [2.0, 2.0, 2.0]  # stage 0's version
    two_bw = result(runs["2bw-two-epochs-3x4"])["metrics"]
    assert [two_bw[f"pipeline/staleness_max_stage{s}"] for s in range(3)] == [1.0, 1.0, 1.0]  # 2BW's delay of one
    flushed = result(runs["zb-h1-two-epochs-2x4"])["metrics"]
    assert not any(key.startswith("pipeline/staleness") for key in flushed)


def test_the_divergence_guard_goes_back_to_the_drained_weights_and_on_under_1f1b(runs):
    out = runs["guard-blow-up-2"]
    assert result(out)["metrics"]["pipeline/switched_to_1f1b"] == 1.0
    assert result(out)["global_step"] == 12
    # 1f1b equals one device: from the initial weights, batch 5 of the first epoch and the whole second one
    assert_weights(out, reference(balance=[7], epochs=[[5], list(range(6))]))


def test_the_directional_transport_ran_where_asked(runs):
    """The runs of DIRECTIONAL took the path NCCL takes; the others kept the CPU default."""
    for name in RUNS:
        result = json.loads((runs[name] / "result.json").read_text())
        assert result["directional"] == (name in DIRECTIONAL), name


@pytest.mark.parametrize(("name", "ranks"), [("fp16-1f1b-2", 2), ("fp16-zb-h1-3", 3)])
def test_fp16_stages_share_one_loss_scale_and_skip_an_overflow_together(runs, name, ranks, tmp_path):
    """precision='16-mixed' under a flushed schedule equals one device with the same plugin: an overflow in stage
    0's gradient alone makes every stage skip that step, and every rank ends with one device's loss scale."""
    from rule_trainer import train as train_once  # one device, in this process: Lightning's own 16-mixed

    train_once(str(tmp_path), {**json.loads(json.dumps(FP16)), "devices": 1})
    want = torch.load(tmp_path / "final.ckpt", weights_only=False, map_location="cpu")["state_dict"]
    assert_weights(runs[name], want)
    scales = [float((runs[name] / f"scale{r}.txt").read_text()) for r in range(ranks)]
    assert scales == [float((tmp_path / "scale0.txt").read_text())] * ranks
    # 6 steps from 1024, growing x2 every 2 good steps: 0, 1 good -> 2048; step 2 skipped -> 1024; 3, 4 -> 2048; 5
    assert scales[0] == 2048.0  # (without the overflow: 8192)


def test_sharded_data_parallel_pipelines_equal_one_device(runs):
    clipped = reference(balance=[7], epochs=TWO_EPOCHS, model=SCHEDULED, clip_norm=0.05)
    assert_weights(runs["shard-full-1f1b-2x2"], clipped)
    assert_weights(runs["shard-grad_op-gpipe-2x2"], reference(balance=[7], epochs=TWO_EPOCHS, model=SCHEDULED,
                                                             clip_norm=0.05))
    assert result(runs["shard-full-1f1b-2x2"])["global_step"] == 12
    assert_weights(runs["shard-full-1f1b-1x4"], clipped)  # one stage, 4 sharded replicas: FSDP alone
    assert_weights(runs["shard-full-1f1b-recompute-2x2"], clipped)
    assert_weights(runs["shard-full-interleaved-2x2"], clipped)  # 2 model chunks per process, each sharded
    # split backward: one reduce-scatter after the last weight half; 5 batches in updates of 2, 2 and 1, twice
    assert_weights(runs["shard-full-zb-h1-accumulate-2x2"],
                   reference(balance=[7], epochs=[list(range(5))] * 2, model=SCHEDULED, clip_norm=0.05, accumulate=2,
                             num_batches=5))


def test_interleaved_data_parallel_pipelines_equal_one_device(runs):
    assert_weights(runs["interleaved-dp-2x2"], one_device())


def test_a_sharded_checkpoint_resumes_sharded_on_one_pipeline_and_on_one_device(runs, tmp_path):
    from rule_trainer import train as train_once  # one device, in this process

    want = reference(balance=[7], epochs=TWO_EPOCHS, model=SCHEDULED, clip_norm=0.05)
    assert_weights(runs["shard-resumed-2x2"], want)
    assert_weights(runs["shard-resumed-2x1"], want)
    train_once(str(tmp_path), {"devices": 1, "model": SCHEDULED, "trainer": {"gradient_clip_val": 0.05},
                               "resume": str(runs["shard-full-1f1b-2x2"] / "step=2.ckpt")})
    assert_weights(tmp_path, want)


def one_device_on_micro_batches(precision: str | MixedPrecision, micro_batches: bool = True, *,
                                model: dict[str, Any] = SCHEDULED, epochs: int = 2,
                                clip: float | None = 0.05) -> dict[str, torch.Tensor]:
    """Lightning's own training on one device (no PipeDreamStrategy) with ``precision`` (a plugin for 16-mixed's
    scaler), as the sharded runs train (by default SCHEDULED, clipping at 0.05, two epochs): each batch fed as the
    2 x 2 pipelines cut it (pipeline k's rows k::2, in 2 micro-batches), its 4 pieces accumulated into one update
    (each piece's loss counting 1/4, as each micro-batch's does in the pipelines); or, with ``micro_batches=False``,
    whole batches."""
    items = batches(6)
    if micro_batches:
        items = [piece for x, y in items for k in range(2) for piece in zip(x[k::2].tensor_split(2),
                                                                          y[k::2].tensor_split(2))]
    L.seed_everything(0, verbose=False)
    trained = RuleMLP(**model)
    plugin = {"plugins": [precision]} if isinstance(precision, MixedPrecision) else {"precision": precision}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, gradient_clip_val=clip,
                        accumulate_grad_batches=4 if micro_batches else 1, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **plugin)
    trainer.fit(trained, ResumableBatches(items))
    assert trainer.global_step == 6 * epochs
    return trained.state_dict()


def test_bf16_mixed_with_shards_equals_one_device_under_bf16_mixed_on_the_same_micro_batches(runs):
    """Each micro-batch's gradient comes out of its bf16 matrix products rounded to bf16, then adds up in float32:
    one device with the same plugin equals the 2 x 2 sharded run when it computes the same pieces (measured: bit for
    bit); the tolerance tells it from one device on whole batches (1.8e-5 apart) and from float32 (2.5e-5)."""
    out = runs["shard-bf16-1f1b-2x2"]
    assert_weights(out, one_device_on_micro_batches("bf16-mixed"))
    assert result(out)["global_step"] == 12
    assert result(out)["weight_dtypes"] == ["torch.bfloat16"]  # FSDP2's gathered weights, not float32 cast per op
    got = torch.load(out / "final.ckpt", weights_only=False, map_location="cpu")["state_dict"]
    assert all(v.dtype == torch.float32 for v in got.values())  # the checkpoint holds the float32 master weights
    for other in (one_device_on_micro_batches("bf16-mixed", micro_batches=False),
                  one_device_on_micro_batches("32-true")):
        assert not all(torch.allclose(got[k], other[k], rtol=1e-5, atol=1e-6) for k in other)


def test_zero_bubble_with_bf16_shards_adds_the_weight_halves_gradients_in_float32(runs):
    """zb-h1's weight halves each leave a bf16 gradient on the gathered weights; folded into FSDP2's float32 sum after
    each, the run equals one device under bf16-mixed on the same micro-batches (measured: bit for bit)."""
    out = runs["shard-bf16-zb-h1-2x2"]
    assert_weights(out, one_device_on_micro_batches("bf16-mixed"))
    assert result(out)["global_step"] == 12


def test_shards_gather_in_bf16_under_bf16_mixed():
    from lightning_pipedream.strategy.setup.checks import sharded_param_dtype

    assert sharded_param_dtype("bf16-mixed", "full") == torch.bfloat16
    assert sharded_param_dtype("32-true", "full") is None and sharded_param_dtype("bf16-true", "grad_op") is None
    assert sharded_param_dtype("16-mixed", "grad_op") is None  # float32 shards under autocast and the scaler


def test_fp16_sharded_replicas_skip_an_overflow_in_one_shard_together(runs):
    """precision='16-mixed' with shard='full' on 2 x 2: an overflow in row 0 of stage 0's first weight's gradient,
    which only replica 0 holds after the reduce-scatter, makes every rank skip that step; the run equals one device
    with the same plugin fed the same micro-batches, and every rank ends with its scale."""
    options = RUNS["fp16-shard-1f1b-2x2"]
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **options["fp16"]))
    assert_weights(runs["fp16-shard-1f1b-2x2"],
                   one_device_on_micro_batches(plugin, model=options["model"], epochs=1, clip=None))
    scales = [float((runs["fp16-shard-1f1b-2x2"] / f"scale{r}.txt").read_text()) for r in range(4)]
    assert scales == [plugin.scaler.get_scale()] * 4 == [2048.0] * 4  # (with no step skipped: 8192)


# ------------------------------------------------------------------ the V schedules (issue 43)
def v_reference(epochs: list[list[int]]) -> dict[str, torch.Tensor]:
    return reference(balance=[7], model=SCHEDULED, epochs=epochs, num_batches=NEWER_BATCHES, clip_norm=V_CLIP)


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
def test_v_schedules_equal_one_device_with_the_loss_on_rank_0(runs, schedule):
    """Two chunks per process in a V: rank 0 holds the first and the last stage and computes the loss. The weights
    equal one device's over two epochs (momentum, StepLR, clipping by the norm); the logged train_loss is one device's
    loss of the last batch; every validation (every 2 batches) saw the model of its step."""
    out = runs[f"{schedule}-two-epochs-2x4"]
    epoch = list(range(NEWER_BATCHES))
    assert_weights(out, v_reference([epoch, epoch]))
    got = result(out)
    assert got["global_step"] == 2 * NEWER_BATCHES
    module = RuleMLP(**SCHEDULED)
    module.load_state_dict(v_reference([epoch, epoch[:-1]]))  # the weights the last batch met
    x, y = batches(NEWER_BATCHES)[-1]
    with torch.no_grad():
        assert got["metrics"]["train_loss"] == pytest.approx(float(torch.nn.functional.mse_loss(module(x), y)),
                                                             rel=1e-6)
    assert sorted(got["checkpoints"]) == [f"step={s}.ckpt" for s in (2, 4, 6, 8)]
    assert_validations_saw_their_checkpoints(out, got["checkpoints"])


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
def test_v_schedules_on_four_processes_equal_one_device(runs, schedule):
    """8 chunks in a V on 4 processes (rank r holds chunks r and 7 - r): two epochs with momentum, StepLR and clipping
    equal one device, and the logged train_loss is one device's loss of the last batch."""
    out, epoch = runs[f"{schedule}-two-epochs-4x8"], list(range(NEWER_BATCHES))
    model = V4["model"]
    want = reference(balance=[sum(V4_BALANCE)], model=model, epochs=[epoch, epoch], num_batches=NEWER_BATCHES,
                     clip_norm=V_CLIP)
    assert_weights(out, want)
    got = result(out)
    assert got["global_step"] == 2 * NEWER_BATCHES
    module = RuleMLP(**model)
    module.load_state_dict(reference(balance=[sum(V4_BALANCE)], model=model, epochs=[epoch, epoch[:-1]],
                                     num_batches=NEWER_BATCHES, clip_norm=V_CLIP))  # the weights the last batch met
    x, y = batches(NEWER_BATCHES)[-1]
    with torch.no_grad():
        assert got["metrics"]["train_loss"] == pytest.approx(float(torch.nn.functional.mse_loss(module(x), y)),
                                                             rel=1e-6)


@pytest.mark.parametrize("name", ["zb-v-3x4", "dualpipev-3x6"])
def test_v_schedules_on_three_processes_equal_one_device(runs, name):
    assert_weights(runs[name], one_device())


def test_a_zb_v_checkpoint_resumes_under_1f1b(runs):
    assert_weights(runs["zb-v-resumed-under-1f1b-2"], v_reference([list(range(NEWER_BATCHES))] * 2))
