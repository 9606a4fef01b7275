"""Collectives during a pipelined fit (issue #52): tied weights under pipedream and 2bw over 100+ batches with
clipping, sync_dist logging and mid-epoch validation follow their rules; collectives from hooks run; a SIGTERM stops
every rank at the same step; a rank blocked in a collective ends every rank, naming it.

The runs train tests/scripts/collective_trainer.py in a subprocess (one launch per process count for the runs that
end normally, one per failing run); the weights are compared with independent single-process implementations of the
rules (tests/helpers/pipedream_reference.py for pipedream, the 2BW rule below), to 1e-5. Whether a rank was told by
its peer or timed out is read from its words, never from how long it took.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from collective_trainer import BATCH, LR, dataset, made_model
from pipedream_reference import Minibatch, PipeDreamRule
from script_runs import run_script

from lightning_pipedream.strategy.reporting.collectives import before_collective, inside_step

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "collective_trainer.py"
HANG_LIMIT = 300.0  # an outer limit only a hang reaches (several times a slow run)
BATCHES, VAL_EVERY, CLIP = 104, 40, 0.05
DRAINS = (40, 80)  # mid-epoch validation drains the pipeline after these many batches
BALANCES = {2: [3, 2], 3: [2, 2, 1]}  # the tie: stage 0 and the last stage (3 processes: stage 1 holds no copy)
TIE_NAMES = {2: [(0, "0.weight"), (1, "1.weight")], 3: [(0, "0.weight"), (2, "0.weight")]}  # in each stage


def ruled(schedule: str, devices: int) -> dict[str, Any]:
    return {"schedule": schedule, "devices": devices, "balance": BALANCES[devices], "clip": CLIP,
            "val_every": VAL_EVERY, **({"chunks": 2} if schedule == "2bw" else {})}


RUNS: dict[str, dict[str, Any]] = {
    **{f"{schedule}-{devices}": ruled(schedule, devices) for schedule in ("pipedream", "2bw") for devices in (2, 3)},
    "hooks-2": {"schedule": "pipedream", "devices": 2, "balance": [3, 2], "hooks": True},
    "sigterm-3": {"schedule": "pipedream", "devices": 3, "balance": [2, 2, 1], "sigterm_at": 40},  # last: it exits
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("collectives")
    for devices in (2, 3):
        group = [[str(base / name), options] for name, options in RUNS.items() if options["devices"] == devices]
        (base / f"runs{devices}.json").write_text(json.dumps(group))
        run_script(SCRIPT, base, {"--runs": str(base / f"runs{devices}.json")}, timeout=HANG_LIMIT)
    return {name: base / name for name in RUNS}


def seen(out: Path, rank: int) -> dict[str, Any]:
    return json.loads((out / f"rank{rank}.json").read_text())


def assert_weights(out: Path, want: dict[str, torch.Tensor]) -> None:
    got = torch.load(out / "final.ckpt", weights_only=False, map_location="cpu")["state_dict"]
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def minibatches() -> list[Minibatch]:
    data = dataset(BATCHES)
    return [Minibatch(t, data.tensors[0][t * BATCH:(t + 1) * BATCH], data.tensors[1][t * BATCH:(t + 1) * BATCH])
            for t in range(BATCHES)]


def segments() -> list[list[Minibatch]]:
    """The minibatches between drains (validation's, then the epoch's end)."""
    mbs, cuts = minibatches(), (0, *DRAINS, BATCHES)
    return [mbs[a:b] for a, b in zip(cuts, cuts[1:])]


def pipedream_rule(devices: int) -> dict[str, torch.Tensor]:
    """PipeDream's rule with the tie as copies whose gradients are summed at each holder's update."""
    model = made_model()
    layers = model.layers
    layers[4].weight = torch.nn.Parameter(layers[0].weight.detach().clone())  # each holder's own copy
    rule = PipeDreamRule(layers, BALANCES[devices], lambda p: torch.optim.SGD(p, lr=LR), torch.nn.functional.mse_loss,
                         lambda t: {"lr": LR}, clip_value=CLIP, ties=[TIE_NAMES[devices]])
    for segment in segments():
        rule.segment(segment)
    return rule.state_dict("layers.", [str(i) for i in range(len(layers))])


def two_bw_rule() -> dict[str, torch.Tensor]:
    """PipeDream-2BW's rule on the tied model in one process: W(t+1) = W(t) - lr * clip(grad f_t(W(t-1))), with
    W(-1) = W(t) after each drain; one tied Parameter gets both uses' gradients, as the stages' summed copies do."""
    model = made_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for segment in segments():
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        for mb in segment:
            params = {k: w.clone().requires_grad_() for k, w in before.items()}
            loss = torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (mb.inputs,)), mb.targets)
            grads = torch.autograd.grad(loss, list(params.values()))
            before = {k: p.detach().clone() for k, p in model.named_parameters()}
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clamp(-CLIP, CLIP)
            optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("devices", [2, 3])
def test_tied_weights_under_pipedream_with_clipping_and_mid_epoch_validation_follow_the_rule(runs, devices):
    out = runs[f"pipedream-{devices}"]
    assert_weights(out, pipedream_rule(devices))
    assert all(seen(out, r)["last_batch"] == BATCHES - 1 for r in range(devices))


@pytest.mark.parametrize("devices", [2, 3])
def test_tied_weights_under_2bw_with_clipping_and_mid_epoch_validation_follow_the_rule(runs, devices):
    out = runs[f"2bw-{devices}"]
    want = two_bw_rule()
    assert_weights(out, want)
    synchronous = made_model()  # not trivially equal to synchronous training
    assert max((want[k] - v).abs().max().item() for k, v in synchronous.state_dict().items()) > 1e-3


def test_collectives_from_hooks_run_under_pipedream_and_reduce_over_every_rank(runs):
    out = runs["hooks-2"]
    for rank in (0, 1):  # self.all_gather every 10 batches: every rank's value, at the same batches
        assert seen(out, rank)["gathered"] == [[0.0, 1.0]] * 11
        assert seen(out, rank)["last_batch"] == BATCHES - 1
    assert seen(out, 0)["logged"] == [0.5] * 5  # self.log(sync_dist=True) of 0 and 1: the mean over the ranks


def test_a_sigterm_stops_every_rank_at_the_same_step_past_lightnings_old_check(runs):
    out = runs["sigterm-3"]
    ends = [seen(out, rank) for rank in range(3)]
    assert {e["ended"] for e in ends} == {"SIGTERMException"}, ends
    stops = {json.dumps(e["stopped_at"]) for e in ends}
    assert len(stops) == 1, ends  # the same batch and step on every rank
    assert 40 <= ends[0]["stopped_at"]["batch"] < BATCHES - 1  # past batch 32 (the old hang), before the end


def fail(tmp_path: Path, options: dict[str, Any], env: dict[str, str] | None = None) -> str:
    import os

    os.environ.update(env or {})
    try:
        proc = run_script(SCRIPT, tmp_path, {"--runs": _one(tmp_path, options)}, timeout=HANG_LIMIT, expect_ok=False)
    finally:
        for key in env or {}:
            os.environ.pop(key, None)
    assert proc.returncode != 0, proc.stderr[-4000:]
    assert (tmp_path / "run" / "fault_time").exists(), f"the run ended before its fault:\n{proc.stderr[-4000:]}"
    return proc.stderr


def _one(tmp_path: Path, options: dict[str, Any]) -> str:
    path = tmp_path / "runs.json"
    path.write_text(json.dumps([[str(tmp_path / "run"), options]]))
    return str(path)


def test_a_rank_blocked_in_the_ties_all_reduce_ends_every_rank_naming_it(tmp_path):
    # Rank 0 spins from step 30 (after its own all-reduce of that update): rank 1 waits in the tie's next all-reduce
    # and times out (10 s); rank 0 never waits (its timeout is 600 s) and can only have ended because it was told.
    # The launcher checks its child (rank 1) at torchrun's pace: rank 1 waits at its exit for rank 0 to say where
    # it was (at Lightning's 5 s pace that was a race, lost once in CI).
    err = fail(tmp_path, {"schedule": "pipedream", "devices": 2, "balance": [3, 2], "spin_at": 30, "timeout": 10,
                          "patient_rank": 0, "launcher_checks_every": 0.1})
    assert "PipelineTimeoutError: Pipeline timeout: rank 1, step " in err, err[-4000:]
    timed_out = err[err.index("PipelineTimeoutError: Pipeline timeout: rank 1"):].splitlines()[0]
    assert "the tied weight '4.weight''s all-reduce with rank 0 (stage 1) got no answer within" in timed_out, timed_out
    told = "lightning_pipedream: rank 0 (stage 0) ends its process: rank 1 (stage 1) stopped the run, naming this " \
           "rank as hung. Pipeline timeout: rank 1, step "
    assert told in err, err[-4000:]
    assert "all-reduce with rank 0" in err[err.index(told):].splitlines()[0]


def test_a_sigterm_ends_a_rank_stuck_in_a_collective_saying_where(tmp_path):
    # Both ranks would wait 600 s: only the SIGTERM (to rank 1, stuck in the tie's all-reduce) can end the run.
    err = fail(tmp_path, {"schedule": "pipedream", "devices": 2, "balance": [3, 2], "spin_at": 30,
                          "sigterm_peer_after": 3},
               env={"LIGHTNING_PIPEDREAM_SIGTERM_GRACE": "3"})
    stuck = "lightning_pipedream: rank 1 (stage 1) was asked to end (SIGTERM) while stuck in step "
    assert stuck in err, err[-4000:]
    line = err[err.index(stuck):].splitlines()[0]
    assert "the tied weight '4.weight''s all-reduce with rank 0 (stage 1) for " in line, line
    # Rank 0 (spinning, never waiting) ends because rank 1 did: Lightning's launcher ends its ranks when one exits, or
    # rank 0's watchdog obeys the stop request rank 1 left, whichever comes first.
    assert "Child process with PID" in err and "terminated with code 143" in err or (
        "rank 0 (stage 0) ends its process: rank 1 (stage 1) stopped the run. lightning_pipedream: rank 1 (stage 1) "
        "was asked to end (SIGTERM) while stuck") in err, err[-4000:]
    assert json.loads((tmp_path / "run" / "flight" / "rank1.json").read_text())["otherData"]["error"].startswith(stuck)


def test_a_collective_inside_a_pipelined_step_is_refused_in_words():
    with inside_step("training_step"), pytest.raises(RuntimeError) as caught:
        before_collective("Lightning's all-gather (self.all_gather)", True, lambda: None)
    assert str(caught.value).startswith(
        "Lightning's all-gather (self.all_gather) was called inside training_step under PipeDreamStrategy. Only the "
        "stage that computes the loss runs training_step")
    drained = []
    before_collective("Lightning's broadcast from rank 0", True, lambda: drained.append(True))  # outside: drains
    before_collective("Lightning's broadcast from rank 0", False, lambda: drained.append(False))  # synchronous: not
    assert drained == [True]
