"""The simulator against analytic formulas for step time, bubble and memory, with and without communication."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipedream.schedule.actions import Op
from lightning_pipedream.schedule.builders import build_schedule
from lightning_pipedream.schedule.check import ScheduleError
from lightning_pipedream.schedule.simulate import simulate

FLUSHED = ("gpipe", "1f1b")


@pytest.mark.parametrize("name", FLUSHED)
def test_flushed_equal_stages_match_analytic(name):
    tf, tb = 1.5, 2.25
    for p in range(1, 7):
        for m in range(1, 13):
            r = simulate(build_schedule(name, p, m), [tf] * p, [tb] * p)
            assert r.makespan == pytest.approx((m + p - 1) * (tf + tb))
            assert r.step_time == r.makespan and not r.steady_state
            assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_peak_activations():
    assert simulate(build_schedule("gpipe", 4, 8), 1, 2).peak_activations == [8, 8, 8, 8]
    assert simulate(build_schedule("1f1b", 4, 8), 1, 2).peak_activations == [4, 3, 2, 1]
    assert simulate(build_schedule("1f1b", 4, 2), 1, 2).peak_activations == [2, 2, 2, 1]
    assert simulate(build_schedule("pipedream", 4, minibatches=8), 1, 2).peak_activations == [4, 3, 2, 1]


def test_slowest_stage_sets_the_flushed_step():
    # The slow stage (3 + 2 s per micro-batch) does all its work between stage 0's first forward
    # and stage 0's last backward; it is at most as slow as every stage being that slow.
    r = simulate(build_schedule("1f1b", 3, 8), [1, 3, 1], [2, 2, 2])
    assert 1 + 8 * (3 + 2) + 2 <= r.makespan <= (8 + 3 - 1) * (3 + 2)
    assert r.makespan > simulate(build_schedule("1f1b", 3, 8), 1, 2).makespan


def test_pipedream_steady_state_equal_stages():
    r = simulate(build_schedule("pipedream", 4, minibatches=8), 1.0, 2.0)
    assert r.steady_state and r.step_time == pytest.approx(3.0)
    assert r.makespan == pytest.approx((8 + 4 - 1) * 3.0)  # the run with its fill and drain, as 1F1B


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.05, 3), st.floats(0.05, 3)), min_size=1, max_size=6), st.integers(1, 12))
def test_pipedream_steady_state_is_the_slowest_stage(times, extra):
    p = len(times)
    fwd, bwd = [f for f, _ in times], [b for _, b in times]
    r = simulate(build_schedule("pipedream", p, minibatches=p + extra), fwd, bwd)
    assert r.steady_state
    assert r.step_time == pytest.approx(max(f + b for f, b in times), rel=1e-9)


def test_pipedream_without_enough_steps_reports_the_average():
    r = simulate(build_schedule("pipedream", 4, minibatches=4), 1.0, 2.0)  # only one step has every stage busy
    assert not r.steady_state
    assert r.step_time == pytest.approx(r.makespan / 5)  # 4 steps and the drain


def test_latency_adds_two_hops_per_stage_boundary():
    tf, tb, lat = 1.0, 2.0, 0.25
    for p, m in [(2, 3), (4, 8), (5, 5)]:
        analytic = (m + p - 1) * (tf + tb) + 2 * (p - 1) * lat
        # GPipe: the forward fill crosses p - 1 links, the backward drain crosses them again.
        assert simulate(build_schedule("gpipe", p, m), tf, tb, latency=lat).makespan == pytest.approx(analytic)
        # 1F1B also waits on links in its steady phase (each backward needs a fresh round trip).
        one_f_one_b = simulate(build_schedule("1f1b", p, m), tf, tb, latency=lat).makespan
        assert one_f_one_b > analytic - 1e-9


def test_bandwidth_acts_like_latency_while_the_link_keeps_up():
    # 1 MB at 4 MB/s: 0.25 s per message, shorter than a forward, so each hop just adds 0.25 s.
    r = simulate(build_schedule("gpipe", 4, 8), 1.0, 2.0, activation_bytes=1e6, bandwidth=4e6)
    assert r.makespan == pytest.approx(33 + 2 * 3 * 0.25)
    assert r.bubble_fraction > (4 - 1) / (8 + 4 - 1)


def test_messages_queue_on_a_slow_link():
    # Transfers (1 s) are longer than compute (0.1 s): messages wait for the link one after another.
    r = simulate(build_schedule("gpipe", 2, 4), 0.1, 0.1, activation_bytes=1.0, bandwidth=1.0)
    # Activations reach stage 1 at 1.1, 2.1, 3.1, 4.1; its backwards end 4.3 .. 4.6; gradients
    # leave at 5.3, 6.3, 7.3, 8.3; stage 0's last backward ends at 8.4.
    assert r.makespan == pytest.approx(8.4)


def test_latency_slows_pipedream_steady_state():
    # Stage 0 keeps p minibatches in flight around a round trip of p (tf + tb) + 2 (p - 1) latency.
    # With latency the step times repeat in a pattern of several steps (3, 4, 4, 4 for p = 4).
    for p, n in [(2, 40), (3, 40), (4, 16), (4, 40), (6, 40)]:
        for lat in (0.1, 1.0):
            r = simulate(build_schedule("pipedream", p, minibatches=n), 1.0, 2.0, latency=lat)
            assert r.step_time == pytest.approx(3.0 + 2 * (p - 1) * lat / p)


def test_optimizer_time_is_added_after_the_flush():
    r = simulate(build_schedule("gpipe", 3, 4), 1.0, 2.0, optimizer_s=0.5)
    assert r.makespan == pytest.approx(6 * 3 + 0.5)


def test_events_are_consistent():
    s = build_schedule("1f1b", 3, 5)
    r = simulate(s, [1, 2, 1], [2, 3, 2], latency=0.1)
    assert len(r.events) == sum(len(a) for a in s.actions)
    sent = {}
    for e in r.events:
        if e.action.op.is_send:
            sent[(e.action.op is Op.SEND_ACT, e.action.microbatch, e.action.stage)] = e.end
    for rank in range(3):
        mine = [e for e in r.events if e.rank == rank]
        assert [e.action for e in mine] == list(s.actions[rank])
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))  # one thing at a time
        for e in mine:
            a = e.action
            if a.op is Op.RECV_ACT:
                assert e.end >= sent[(True, a.microbatch, a.stage - 1)] + 0.1 - 1e-12
            elif a.op is Op.RECV_GRAD:
                assert e.end >= sent[(False, a.microbatch, a.stage + 1)] + 0.1 - 1e-12
    assert r.summary()["makespan"] == r.makespan and "events" not in r.summary()


def test_bad_inputs():
    s = build_schedule("gpipe", 3, 2)
    with pytest.raises(ValueError, match="forward_s has 2 values but the schedule has 3 stages; give one value for all stages or one per stage"):
        simulate(s, [1.0, 1.0], 1.0)
    with pytest.raises(ValueError, match=r"backward_s must be >= 0"):
        simulate(s, 1.0, [1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        simulate(s, 1.0, 1.0, bandwidth=0)
    with pytest.raises(ValueError, match="latency and optimizer_s must be >= 0"):
        simulate(s, 1.0, 1.0, latency=-1)
    assert math.isfinite(simulate(s, 1.0, 1.0, bandwidth=math.inf).makespan)
    broken = replace(s, actions=(s.actions[0][1:],) + s.actions[1:])
    with pytest.raises(ScheduleError):
        simulate(broken, 1.0, 1.0)
