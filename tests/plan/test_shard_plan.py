"""Sharded replicas in the plan: the memory model's terms by hand, and the auto planner's choice between whole and
sharded replicas under a memory limit (shard='auto'), its words, the Plan's shard and the refusals."""

from __future__ import annotations

import json

import pytest

from lightning_pipedream.plan.auto import NoPlanFitsError, auto_plan
from lightning_pipedream.plan.memory import StageBytes, predict_memory, stage_bytes
from lightning_pipedream.plan.partition import Plan, PlanFormatError
from lightning_pipedream.plan.profile import LayerProfile, Profile
from lightning_pipedream.plan.shards import check_shard_choice, gathered_bytes, shard_modes
from lightning_pipedream.plan.topology import Topology


def two_stages() -> list[StageBytes]:
    """Two stages of 3000 parameter bytes in units of 2000 and 1000, 400 bytes kept per batch, nothing on top."""
    stage = StageBytes(parameters=3000, input=0, layers=400, output=0, grad_working=0, grad_temps=0,
                       largest_parameter=2000, layer_parameters=(2000.0, 1000.0))
    return [stage, stage]


def test_whole_replicas_hold_the_all_reduce_s_copy_of_the_gradients():
    one, two = (predict_memory(two_stages(), "1f1b", 4, replicas=r, optimizer="momentum") for r in ([1, 1], [2, 2]))
    assert [m.sync_working for m in one] == [0, 0] and [m.sync_working for m in two] == [3000, 3000]
    # momentum: weights 3000, gradients 3000, state 3000; the update's temporary (2000) is below the copy (3000)
    assert two[0].predicted_peak_bytes == 9000 + 3000
    assert "sync_working" not in one[0].to_json() and two[0].to_json()["sync_working"] == 3000


@pytest.mark.parametrize(("schedule", "shard", "gathered"), [
    ("1f1b", "full", 3000),     # the two largest units: the one in its backward and the one gathered ahead
    ("gpipe", "full", 3000),
    ("1f1b", "grad_op", 5000),  # a forward after a backward: the whole stage gathered, and one unit's flat buffer
    ("gpipe", "grad_op", 3000),  # every forward before the first backward: its backwards gather unit by unit
])
def test_a_sharded_stage_holds_its_shards_whole_gradients_and_the_gathered_weights(schedule, shard, gathered):
    m = predict_memory(two_stages(), schedule, 4, replicas=[2, 2], optimizer="momentum", shard=shard)[1]
    assert (m.parameters, m.gradients, m.optimizer_state) == (1500, 1500, 1500)
    assert (m.whole_gradients, m.gathered, m.update_working) == (3000, gathered, 1000)
    held = m.activations  # the last stage: 1f1b holds one micro-batch of 400 / 4, gpipe all four
    assert held == (100 if schedule == "1f1b" else 400)
    # within a step: 4500 of shards, the gradients whole (1500 more than their shard) and the gathered weights
    assert m.predicted_peak_bytes == 4500 + 1500 + gathered + held
    assert m.to_json()["shard"] == shard


def test_one_micro_batch_reduce_scatters_each_unit_s_gradients_as_its_backward_ends():
    m = predict_memory(two_stages(), "1f1b", 1, replicas=[2, 2], optimizer="momentum", shard="full")[0]
    assert m.whole_gradients == 2000  # the largest unit's, never the stage's


def test_gathered_bytes_of_a_stage_with_one_unit():
    assert gathered_bytes("full", [0.0, 700.0, 0.0], 700.0) == 700.0
    assert gathered_bytes(None, [700.0], 700.0) == 0.0


@pytest.mark.parametrize(("schedule", "replicas", "words"), [
    ("1f1b", [2, 1], r"shard='full' with schedule='1f1b' and replicas \[2, 1\]: sharding runs equal replicas \(at "
                     r"least 2\) of a flushed schedule \(gpipe, 1f1b, interleaved, zb-h1\). Give replicas=\[d\] \* "
                     r"stages with one of those schedules, or shard=None."),
    ("pipedream", [2, 2], r"shard='full' with schedule='pipedream' and replicas \[2, 2\]: sharding runs equal"),
    ("2bw", [2, 2], r"shard='full' with schedule='2bw' and replicas \[2, 2\]: sharding runs equal"),
])
def test_what_cannot_shard_is_refused_by_the_model(schedule, replicas, words):
    with pytest.raises(ValueError, match=words):
        predict_memory(two_stages(), schedule, 2, replicas=replicas, shard="full")


def test_shard_choices_are_checked_with_the_words():
    assert shard_modes("auto") == (None, "grad_op", "full") and shard_modes("none") == (None,)
    assert check_shard_choice("full") == "full"
    with pytest.raises(ValueError, match=r"shard='half' is not a choice: use None or 'none' \(replicas keep whole "
                                         r"copies\), 'grad_op' .* or 'auto' \(the planner weighs replicating"):
        check_shard_choice("half")


# ---- the planner: one stage (its two layers cannot be cut apart) on two workers, so the replicas whole or sharded


def one_stage_profile() -> Profile:
    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 100, 1000, grad_working_bytes=0, grad_temp_bytes=0, pending_bytes=0,
                           largest_parameter_bytes=1000) for i in range(2)]
    return Profile(layers, no_cut_after=[0])


SLOW = Topology.flat(2, 1000.0)  # 1000 B/s: gathering the stage's 2000 bytes over 2 replicas takes 1 s


def plan(limit, shard="auto", **kwargs):
    return auto_plan(one_stage_profile(), SLOW, limit, exact=True, optimizer="momentum", max_chunks=4,
                     schedules=["1f1b"], shard=shard, **kwargs)


def test_with_room_for_both_whole_replicas_win_they_avoid_the_all_gathers():
    # whole: 6000 of weights, gradients and state, and the all-reduce's copy (2000): 8000
    result = plan(9000)
    assert result.chosen.shard is None and result.plan.shard is None and result.chosen.peak_bytes == 8000
    assert result.shard_note is not None and result.shard_note.startswith(
        "whole replicas: both fit, and replicas avoid the all-gathers; the best sharded plan, 1f1b, 1 stage (2), "
        "1 micro-batch, sharded (grad_op) over 2 replicas, takes +0.0%")
    assert "shard" not in result.strategy_arguments() and "shard" not in result.plan.to_json()


def test_a_limit_whole_replicas_exceed_flips_the_choice_to_shards_and_says_why():
    # Sharded, one micro-batch: 3000 of shards, 2000 of gathered units, 200 of activations: 5200. grad_op gathers
    # once per micro-batch and reduce-scatters once: 1 s + 1 s, what the all-reduce takes; full gathers for its
    # backward too. So grad_op.
    result = plan(6000)
    c = result.chosen
    assert (c.shard, c.chunks, c.replicas, c.peak_bytes) == ("grad_op", 1, (2,), 5200)
    assert result.plan.shard == "grad_op"
    assert result.shard_note == ("sharded (grad_op): with whole replicas this configuration needs 7.81 KiB on its "
                                 "fullest worker, over the limit of 5.86 KiB; sharded it needs 5.08 KiB")
    assert result.strategy_arguments() == {"schedule": "1f1b", "chunks": 1, "balance": [2], "replicas": [2],
                                           "shard": "grad_op"}
    text = result.describe()
    assert "1f1b, 1 stage (2), 1 micro-batch, sharded (grad_op) over 2 replicas" in text
    assert "whole in step" in text and result.shard_note in text
    assert "run it with PipeDreamStrategy(schedule='1f1b', chunks=1, balance=[2], replicas=[2], shard='grad_op')" in text
    saved = json.loads(json.dumps(result.plan.to_json()))
    assert saved["shard"] == "grad_op" and Plan.from_json(saved).shard == "grad_op"


def test_sharding_is_timed_with_its_gathers():
    whole, sharded = plan(None, shard=None).chosen, plan(6000).chosen
    full = plan(6000, shard="full").chosen
    # A step of two minibatches, one per replica: 6 s of compute and 2 s of all-reduce, or 1 s of gather in the
    # forward and 1 s of reduce-scatter; full gathers once more for the backward. Per minibatch, half the step.
    assert whole.time_per_minibatch == pytest.approx(4.0) and sharded.time_per_minibatch == pytest.approx(4.0)
    assert full.shard == "full" and full.time_per_minibatch == pytest.approx(4.5)


def test_a_limit_that_fits_neither_names_the_least_either_needs():
    with pytest.raises(NoPlanFitsError) as refused:
        plan(5000)
    assert str(refused.value) == (
        "No configuration of the 2 layers on 2 workers (any split, replicas whole or sharded, exact schedule, "
        "micro-batches and recompute) keeps every worker within memory_limit=5000 bytes (4.88 KiB): the least any "
        "needs is 5200 bytes (5.08 KiB) per worker, with 1f1b, 1 stage (2), 1 micro-batch, sharded (grad_op) over 2 "
        "replicas. Raise the limit to at least 5200 bytes, or add workers.")
    assert refused.value.smallest_limit == 5200


def test_without_sharding_the_refusal_says_that_shards_would_fit():
    with pytest.raises(NoPlanFitsError, match=r"the least any needs is 8000 bytes .* or add workers; or shard the "
                                              r"replicas: 1f1b, 1 stage \(2\), 1 micro-batch, sharded \(full\) over 2 "
                                              r"replicas needs 5200 bytes \(shard='auto' lets the planner weigh it\)."):
        plan(6000, shard=None)


def test_a_forced_shard_with_nothing_to_shard_is_refused():
    with pytest.raises(ValueError, match=r"shard='full' shards equal replicas \(at least 2 per stage\) of a flushed "
                                         r"schedule \(gpipe, 1f1b, interleaved, zb-h1\), and no configuration of 1f1b "
                                         r"on 1 workers has them. Allow one of those schedules, give at least 2 "
                                         r"workers, or use shard='auto'"):
        auto_plan(one_stage_profile(), Topology.flat(1, 1000.0), None, schedules=["1f1b"], shard="full")


def test_four_workers_shard_two_stages_over_two_replicas():
    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 100, 1000, grad_working_bytes=0, grad_temp_bytes=0, pending_bytes=0,
                           largest_parameter_bytes=1000) for i in range(4)]
    profile = Profile(layers, no_cut_after=[0, 2])  # two stages at most: l0-l1 and l2-l3
    # whole replicas need 8000 bytes on 2 x 2, 16000 on 1 x 4; sharded, 5300 and 5400
    result = auto_plan(profile, Topology.flat(4, 1000.0), 5300, exact=True, optimizer="momentum", max_chunks=4,
                       schedules=["1f1b"], shard="auto")
    assert result.chosen.replicas == (2, 2) and result.chosen.shard == "grad_op"
    expected = predict_memory(stage_bytes(profile, [2, 2]), "1f1b", result.chosen.chunks, replicas=[2, 2],
                              optimizer="momentum", shard=result.chosen.shard)
    assert list(result.chosen.memory) == expected  # the planner's tables allowed what the model predicts
    assert result.strategy_arguments()["replicas"] == [2, 2]


def test_a_plan_s_shard_is_checked_when_read():
    plan_json = {"stages": [{"layers": ["a"], "replicas": 2}], "shard": "half"}
    with pytest.raises(PlanFormatError, match=r"The plan has shard='half'; use 'grad_op', 'full' or null \(whole "
                                              r"replicas\)."):
        Plan.from_json(plan_json)
