"""The newer schedules (2bw, interleaved, zb-h1): exhaustive validation, their shapes and bubbles, the validator's words."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_pipedream.schedule.actions import Action, Op, Schedule
from lightning_pipedream.schedule.builders import build_schedule, check_schedule_options
from lightning_pipedream.schedule.check import ScheduleError, render_grid, validate
from lightning_pipedream.schedule.simulate import simulate

MAX_STAGES, MAX_CHUNKS, MAX_VIRTUAL = 8, 32, 4


def _edit(schedule: Schedule, rank: int, change) -> Schedule:
    ranks = list(schedule.actions)
    ranks[rank] = tuple(change(list(ranks[rank])))
    return replace(schedule, actions=tuple(ranks))


def _compute(actions) -> list[str]:
    return [str(a) for a in actions if a.op.is_compute or a.op is Op.OPTIMIZER_STEP]


# ------------------------------------------------------------------------------------------
# Every size.


def test_every_new_builder_and_size_is_valid():
    """Every size is validated; the shapes are checked on each, the timings on a sample (the simulator is slower).

    About 10 s on an idle 2-core machine (three times that on a busy one); pytest's timeout catches a validator or
    builder gone quadratic."""
    count = 0
    for p in range(1, MAX_STAGES + 1):
        for m in range(1, MAX_CHUNKS + 1):
            zb = build_schedule("zb-h1", p, m)
            validate(zb)
            _check_zero_bubble(zb, p, m, timed=m <= 16)
            validate(build_schedule("2bw", p, m, minibatches=3))
            count += 2
            for v in range(1, MAX_VIRTUAL + 1):
                s = build_schedule("interleaved", p, m, virtual_stages=v)
                if v > 1:  # v = 1 is 1f1b's actions (checked below), validated in test_schedule_check.py
                    validate(s)
                _check_interleaved(s, p, m, v, timed=m % p == 0 and m <= 16)
                count += 1
    assert count == MAX_STAGES * MAX_CHUNKS * (2 + MAX_VIRTUAL)


def _check_zero_bubble(s: Schedule, p: int, m: int, timed: bool) -> None:
    for actions in s.actions:
        order = _compute(actions)
        assert [a for a in order if a[0] == "B"] == [f"B{i}" for i in range(m)]
        assert [a for a in order if a[0] == "W"] == [f"W{i}" for i in range(m)]
        assert order[-1] == "O" and order.count("O") == 1
    if not timed:
        return
    # Equal F, B and W: with m >= p ZB-H1's bubble is (p-1)(F+B-W) = p-1 units of a 3m + p - 1 step,
    # 2(p-1) less than 1F1B's; every stage keeps at most p micro-batches (1F1B's stage 0 does),
    # counted from F to W.
    result = simulate(s, 1.0, 2.0)
    one_f_one_b = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
    assert max(result.peak_activations) == min(p, m)
    assert result.makespan <= one_f_one_b.makespan
    if m >= p:
        assert result.makespan == 3 * m + p - 1 == one_f_one_b.makespan - 2 * (p - 1)
        assert result.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))


def _check_interleaved(s: Schedule, p: int, m: int, v: int, timed: bool) -> None:
    assert (s.num_ranks, s.num_stages, s.virtual_stages) == (p, p * v, v)
    if v == 1:
        assert s.actions == build_schedule("1f1b", p, m).actions
    for rank, actions in enumerate(s.actions):
        assert {a.stage for a in actions} == set(range(rank, p * v, p))  # chunks r, r + p, ...
    if timed:
        # Each chunk is 1/v of a stage: the ideal step is m (F+B) = 3m, the bubble (p-1)(F+B)/v.
        result = simulate(s, 1.0 / v, 2.0 / v)
        assert result.makespan == pytest.approx(3 * m + 3 * (p - 1) / v)
        assert result.bubble_fraction == pytest.approx(((p - 1) / v) / (m + (p - 1) / v))


def test_two_bw_updates_once_per_minibatch_and_keeps_the_pipeline_full():
    for p in range(1, MAX_STAGES + 1):
        for m in range(1, 12):
            s = build_schedule("2bw", p, m, minibatches=6)
            assert s.steps() == 6 + (p > 1)  # 6 steps, then the drain (none with one stage)
            for actions in s.actions:
                order = _compute(actions)
                assert order.count("O") == 6
                backwards = [int(a[1:]) for a in order if a[0] == "B"]
                assert backwards == list(range(6 * m))
                updates = [i for i, a in enumerate(order) if a == "O"]
                assert all(order[i - 1] == f"B{(k + 1) * m - 1}" for k, i in enumerate(updates))
            if m >= p - 1:  # the weights minibatch t needs (t-1) are always made in time: no bubble
                assert simulate(s, 1.0, 2.0).step_time == pytest.approx(3 * m)


# ------------------------------------------------------------------------------------------
# Hand-checked grids.

ZB_H1_3x3 = """\
slot  rank 0  rank 1  rank 2
   0  F0      .       .
   1  F1      F0      .
   2  F2      F1      F0
   3  .       .       B0
   4  .       B0      F1
   5  B0      F2      B1
   6  W0      B1      F2
   7  B1      W0      B2
   8  W1      B2      W0
   9  B2      W1      W1
  10  W2+O    W2+O    W2+O"""

INTERLEAVED_2x2_V2 = """\
slot  rank 0    rank 1
   0  F0s0      .
   1  F1s0      F0s1
   2  F0s2      F1s1
   3  F1s2      F0s3
   4  .         B0s3
   5  B0s2      F1s3
   6  .         B1s3
   7  B1s2      B0s1
   8  B0s0      B1s1+O+O
   9  B1s0+O+O  ."""


def test_grids_match_hand_drawn_tables():
    assert render_grid(build_schedule("zb-h1", 3, 3)) == ZB_H1_3x3
    assert render_grid(build_schedule("interleaved", 2, 2, virtual_stages=2)) == INTERLEAVED_2x2_V2


# ------------------------------------------------------------------------------------------
# Broken schedules and bad options: the validator and the builders say what is wrong.


def test_weight_gradient_misplaced_or_missing():
    s = build_schedule("zb-h1", 2, 2)
    w0 = next(i for i, a in enumerate(s.actions[0]) if a.op is Op.BACKWARD_WEIGHT)
    early = _edit(s, 0, lambda acts: [acts[w0]] + acts[:w0] + acts[w0 + 1:])
    with pytest.raises(ScheduleError, match=r"rank 0, action 0 \(W0\): computes the weight gradient of micro-batch 0 "
                                            r"before its backward \(B0\) ran"):
        validate(early)
    missing = _edit(s, 0, lambda acts: acts[:w0] + acts[w0 + 1:])
    with pytest.raises(ScheduleError, match="never runs the weight gradient of micro-batch 0 on stage 0"):
        validate(missing)
    late = _edit(s, 1, lambda acts: [a for a in acts if a.op is not Op.OPTIMIZER_STEP] + [Action(Op.OPTIMIZER_STEP, 1)])
    validate(late)  # the update may come after every W ...
    stepped = _edit(s, 1, lambda acts: acts[:-2] + [acts[-1], acts[-2]])
    with pytest.raises(ScheduleError, match="optimizer step of stage 1 before 1 of the backwards of training step 0"):
        validate(stepped)  # ... but not before one


def test_two_bw_update_and_version_rules():
    s = build_schedule("2bw", 2, 2, minibatches=3)
    # Stage 0 runs the forward of micro-batch 4 (minibatch 2) before its first update: the version it needs
    # (1) does not exist yet.
    f4 = next(i for i, a in enumerate(s.actions[0]) if a.op is Op.FORWARD and a.microbatch == 4)
    early = _edit(s, 0, lambda acts: acts[:2] + acts[f4:f4 + 2] + acts[2:f4] + acts[f4 + 2:])
    with pytest.raises(ScheduleError, match=r"rank 0, action 2 \(F4\): forward of micro-batch 4 \(minibatch 2\) before "
                                            "update 1 of stage 0: 2bw runs minibatch t on weight version t-1"):
        validate(early)
    hasty = _edit(s, 1, lambda acts: [Action(Op.OPTIMIZER_STEP, 1)] + acts)
    with pytest.raises(ScheduleError, match=r"update 0 of stage 1 after 0 of the 2 backwards of minibatch 0"):
        validate(hasty)


def test_interleaved_links_are_fifo():
    # Rank 0 sends rank 1 both activations (stage 0 to 1) and gradients (stage 2 to 1) on one link: rank 1
    # receives the gradient of micro-batch 0 and then an activation, in the order rank 0 sent them.
    s = build_schedule("interleaved", 2, 5, virtual_stages=2)
    assert [str(a) for a in s.actions[1][21:23]] == ["RG0@0", "RA3@0"]
    swapped = _edit(s, 1, lambda acts: acts[:21] + [acts[22], acts[21]] + acts[23:])
    with pytest.raises(ScheduleError, match=r"rank 1, action 21 \(RA3@0\): expects the output of stage 0 micro-batch 3, but "
                                            "the message arriving next from rank 0 is the input gradient of stage 2"):
        validate(swapped)


def test_new_options_are_checked_with_words_that_say_how_to_fix_them():
    with pytest.raises(ValueError, match="virtual_stages=2 applies to schedule='interleaved' only"):
        check_schedule_options("1f1b", 4, virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages must be an integer >= 1, got 0: it is the number of model"):
        build_schedule("interleaved", 2, 4, virtual_stages=0)
    with pytest.raises(ValueError, match=r"recompute must be True, False or one of them per model stage \(e.g. \[True, False\]: stage 0 only\), got 'yes'"):
        check_schedule_options("gpipe", 2, recompute="yes")
    with pytest.raises(ValueError, match=r"build_schedule\('2bw', ...\) needs minibatches=N"):
        build_schedule("2bw", 2, 4)
    for name in ("2bw", "interleaved", "zb-h1"):
        kwargs = {"minibatches": 2} if name == "2bw" else {}
        with pytest.raises(ValueError, match=f"schedule='{name}' does not support replicated stages yet"):
            build_schedule(name, 2, 2, replicas=[2, 1], **kwargs)


def test_simulator_splits_the_backward_and_replays_forwards():
    s = build_schedule("zb-h1", 2, 2)
    even = simulate(s, 1.0, 2.0)
    assert {e.end - e.start for e in even.events if e.action.op is Op.BACKWARD_WEIGHT} == {1.0}
    heavy = simulate(s, 1.0, 2.0, weight_s=1.5)
    assert {e.end - e.start for e in heavy.events if e.action.op is Op.BACKWARD} == {0.5}
    with pytest.raises(ValueError, match=r"weight_s \[3.0, 3.0\] must not exceed backward_s \[2.0, 2.0\]"):
        simulate(s, 1.0, 2.0, weight_s=3.0)
    replay = simulate(build_schedule("1f1b", 2, 4), 1.0, 2.0, recompute=True)
    assert replay.makespan == simulate(build_schedule("1f1b", 2, 4), 1.0, 3.0).makespan


def test_the_plans_cost_model_knows_the_new_schedules():
    from lightning_pipedream.plan.partition import Plan, StagePlan

    def plan(schedule: str, **extra) -> Plan:
        stages = [StagePlan([f"layer{s}"], compute_s=3.0, forward_s=1.0) for s in range(4)]
        return Plan(stages, schedule=schedule, chunks=8, extra=extra)

    # Per minibatch of 8 micro-batches, each stage 1 s forward and 2 s backward per minibatch:
    one_f_one_b = plan("1f1b").simulated_time_per_minibatch()
    assert one_f_one_b == pytest.approx(3 + 3 * 3 / 8)  # the work, plus (p-1)(F+B) per micro-batch
    assert plan("zb-h1").simulated_time_per_minibatch() == pytest.approx(3 + 3 / 8)  # (p-1)(F+B-W), W = B/2
    assert plan("interleaved", virtual_stages=2).simulated_time_per_minibatch() == pytest.approx(3 + 3 * 3 / 16)
    assert plan("2bw").simulated_time_per_minibatch() == pytest.approx(3)  # no flush: no bubble
    assert plan("1f1b", recompute=True).simulated_time_per_minibatch() == pytest.approx(4 + 3 * 4 / 8)


def test_inference_over_model_chunks():
    from lightning_pipedream.schedule.builders import inference

    for p in range(1, 5):
        for m in range(1, 9):
            for v in range(1, 4):
                s = inference(p, m, virtual_stages=v)
                validate(s)
                assert s.num_stages == p * v and not any(a.op is Op.BACKWARD for rank in s.actions for a in rank)
