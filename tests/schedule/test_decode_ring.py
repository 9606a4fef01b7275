"""The decode ring as schedule IR: built for every small size and retire pattern, validated, simulated against the
closed-form bubble, and broken rings rejected with words that say what is wrong."""

from __future__ import annotations

import itertools
import math

import pytest

from lightning_pipedream.schedule.actions import Action, Op, Schedule
from lightning_pipedream.schedule.check import ScheduleError, validate
from lightning_pipedream.schedule.generation import decode_ring, ring_bubble, simulate_ring
from lightning_pipedream.schedule.simulate import simulate
from lightning_pipedream.schedule.timeline import from_chrome_trace, to_chrome_trace


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_every_small_ring_and_retire_pattern_is_sound(stages):
    for lanes in range(1, 5):
        for tokens in itertools.product(range(1, 4), repeat=lanes):
            ring = decode_ring(stages, lanes, list(tokens))
            validate(ring)  # the general validator hands rings to validate_ring
            for actions in ring.actions:
                forwards = [(a.microbatch, a.step) for a in actions if a.op is Op.FORWARD]
                # every lane's steps, step-major on every rank
                assert forwards == sorted(((m, t) for m in range(lanes) for t in range(tokens[m])),
                                          key=lambda x: (x[1], x[0]))


def test_the_token_goes_from_the_last_stage_back_to_the_first():
    ring = decode_ring(3, 2, 2)
    assert [str(a) for a in ring.actions[2][:3]] == ["RA0@1", "F0", "SA0@0"]
    assert [(str(a), a.step) for a in ring.actions[0][4:7]] == [("RA0@2", 1), ("F0", 1), ("SA0@1", 1)]


@pytest.mark.parametrize(("stages", "lanes", "tokens"), [(2, 1, 6), (2, 2, 6), (3, 2, 5), (3, 3, 5), (3, 4, 5),
                                                          (4, 4, 3), (4, 5, 3)])
def test_the_simulated_bubble_is_the_closed_form(stages, lanes, tokens):
    sim = simulate_ring(stages, lanes, tokens, 1.0)
    assert math.isclose(sim["bubble_fraction"], ring_bubble(stages, lanes, tokens))
    if lanes >= stages:
        assert math.isclose(sim["bubble_fraction"], (stages - 1) / (lanes * tokens + stages - 1))


def test_m_equal_p_makes_more_steps_per_second_than_one_lane():
    one, full = simulate_ring(3, 1, 8, 1.0), simulate_ring(3, 3, 8, 1.0)
    assert full["steps_per_s"] > 2.5 * one["steps_per_s"]


def _without(ring: Schedule, rank: int, index: int) -> Schedule:
    rows = [list(r) for r in ring.actions]
    del rows[rank][index]
    return Schedule(ring.name, ring.num_ranks, ring.num_stages, ring.chunks, tuple(map(tuple, rows)))


def test_a_missing_retire_pass_is_refused():
    ring = decode_ring(2, 1, 2)
    last_send = max(i for i, a in enumerate(ring.actions[0]) if a.op is Op.SEND_ACT)
    with pytest.raises(ScheduleError, match="lane 0 made 2 tokens but has no retire pass at step 2"):
        validate(_without(ring, 0, last_send))


def test_a_forward_before_its_token_came_back_is_refused():
    ring = decode_ring(2, 1, 2)
    recv = next(i for i, a in enumerate(ring.actions[0]) if a.op is Op.RECV_ACT)
    with pytest.raises(ScheduleError, match="forward of lane 0 step 1 before its input was received"):
        validate(_without(ring, 0, recv))


def test_lanes_in_another_order_on_one_rank_are_refused():
    ring = decode_ring(2, 2, 1)
    rows = [list(r) for r in ring.actions]
    rows[1] = rows[1][3:6] + rows[1][:3] + rows[1][6:]  # rank 1 takes lane 1 first
    bad = Schedule(ring.name, 2, 2, 2, tuple(map(tuple, rows)))
    with pytest.raises(ScheduleError, match="messages between two ranks arrive in the order they were sent"):
        validate(bad)


def test_a_ring_with_a_backward_is_refused():
    ring = decode_ring(1, 1, 1)
    bad = Schedule(ring.name, 1, 1, 1, ((*ring.actions[0], Action(Op.BACKWARD, 0, 0)),))
    with pytest.raises(ScheduleError, match="a decode ring has forwards, sends and receives only, not BACKWARD"):
        validate(bad)


def test_bad_sizes_are_refused_with_the_way_out():
    with pytest.raises(ValueError, match="new_tokens lists 1 lanes but lanes=2"):
        decode_ring(2, 2, [3])
    with pytest.raises(ValueError, match="lanes must be an integer >= 1, got 0"):
        decode_ring(2, 0, 3)


def test_a_simulated_ring_makes_a_timeline_with_the_token_link():
    events = simulate(decode_ring(2, 2, [2, 3]), 1.0, 0.0, activation_bytes=[8.0, 1.0], bandwidth=8.0).events
    assert from_chrome_trace(to_chrome_trace(events)) == events
    back = [e for e in events if e.rank == 0 and e.action.op is Op.RECV_ACT]  # tokens from the last stage
    assert [(e.action.microbatch, e.action.step) for e in back] == [(0, 1), (1, 1), (0, 2), (1, 2), (1, 3)]
    assert all(e.action.peer == 1 for e in back)
