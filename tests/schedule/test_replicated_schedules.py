"""Replicated stages in the schedule IR: layout, 1F1B-RR builders, validator and simulator, exhaustively over small sizes."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from lightning_pipedream.cli import main
from lightning_pipedream.schedule.actions import Action, Layout, Op, Schedule
from lightning_pipedream.schedule.builders import REPLICATED_SCHEDULES as SCHEDULES
from lightning_pipedream.schedule.builders import build_schedule
from lightning_pipedream.schedule.check import ScheduleError, place, render_grid, validate
from lightning_pipedream.schedule.simulate import simulate


def _build(name: str, replicas, count: int) -> Schedule:
    if name == "pipedream":
        return build_schedule(name, len(replicas), minibatches=count, replicas=replicas)
    return build_schedule(name, len(replicas), count, replicas=replicas)


def _edit(schedule: Schedule, rank: int, change) -> Schedule:
    ranks = list(schedule.actions)
    ranks[rank] = tuple(change(list(ranks[rank])))
    return replace(schedule, actions=tuple(ranks))


def test_layout_is_stage_major():
    layout = Layout((2, 1))
    assert [list(layout.ranks_of(s)) for s in range(2)] == [[0, 1], [2]]
    assert [layout.stage_of(r) for r in range(3)] == [0, 0, 1]
    assert [layout.owner(0, m) for m in range(4)] == [0, 1, 0, 1]
    assert [layout.owner(1, m) for m in range(4)] == [2, 2, 2, 2]
    dp = Layout.data_parallel(3, 2)  # rank s * d + k: stage s of pipeline k
    assert dp.replicas == (2, 2, 2) and list(dp.ranks_of(1)) == [2, 3] and dp.is_uniform
    assert dp.shards_of(4) == (0,) and dp.shards_of(5) == (1,) and dp.shards_of(2) == ()
    assert layout.shards_of(2) == (0, 1)  # the single last stage of a 2-1 plan reads both shards
    with pytest.raises(ValueError, match="one whole number >= 1 per stage"):
        Layout((2, 0))
    with pytest.raises(ValueError, match="lists 2 stages but there are 3"):
        build_schedule("gpipe", 3, 2, replicas=[2, 1])


def test_in_flight_is_pipedreams_rule():
    # NOAM = ceil(workers / replicas of the input stage) on the input stage.
    assert Layout((2, 1)).in_flight(0) == math.ceil(3 / 2) == 2
    assert Layout((15, 1)).in_flight(0) == 2
    assert Layout((1, 2)).in_flight(0) == 3 and Layout((1, 2)).in_flight(1) == 1
    assert [Layout((1,) * 4).in_flight(s) for s in range(4)] == [4, 3, 2, 1]  # straight pipeline: p - s
    assert [Layout.data_parallel(3, 2).in_flight(s) for s in range(3)] == [3, 2, 1]


def test_one_replica_everywhere_gives_the_existing_schedules():
    for name in SCHEDULES:
        for p in (1, 2, 3):
            assert _build(name, [1] * p, 4) == _build(name, [1] * p, 4) and _build(name, [1] * p, 4).replicas is None
            plain = build_schedule(name, p, minibatches=4) if name == "pipedream" else build_schedule(name, p, 4)
            assert _build(name, [1] * p, 4) == plain


def test_every_replicated_builder_and_size_is_valid():
    layouts = [r for p in (1, 2, 3) for r in itertools.product((1, 2, 3), repeat=p) if max(r) > 1]
    layouts += [r for r in itertools.product((1, 2), repeat=4) if max(r) > 1] + [(15, 1), (4, 4)]
    count = 0
    for replicas in layouts:
        for name in SCHEDULES:
            for n in range(1, 7):
                schedule = _build(name, replicas, n)
                validate(schedule)
                assert all(i is None for i in place(schedule).stuck)
                count += 1
    assert count == len(layouts) * len(SCHEDULES) * 6


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_microbatch_once_on_its_round_robin_replica(name):
    s = _build(name, (2, 1), 3)
    layout = s.layout
    for rank, actions in enumerate(s.actions):
        stage = layout.stage_of(rank)
        mbs = sorted(a.microbatch for a in actions if a.op is Op.FORWARD)
        assert mbs == [m for m in range(s.microbatch_count) if m % layout.replicas[stage] == layout.replica_of(rank)]
        for a in actions:  # messages go to and come from the owner on the neighbouring stage
            if a.op in (Op.SEND_ACT, Op.RECV_GRAD):
                assert a.peer == layout.owner(stage + 1, a.microbatch)
            elif a.op in (Op.RECV_ACT, Op.SEND_GRAD):
                assert a.peer == layout.owner(stage - 1, a.microbatch)
    assert s.microbatch_count == 6  # 3 chunks (or minibatches) for each of the 2 input replicas


def test_flushed_replicas_all_reduce_once_before_the_step():
    s = build_schedule("1f1b", 2, 2, replicas=[2, 2])
    for actions in s.actions:
        ops = [a.op for a in actions]
        assert ops.count(Op.ALLREDUCE_GRAD) == 1 and ops[-2:] == [Op.ALLREDUCE_GRAD, Op.OPTIMIZER_STEP]
    unreplicated = build_schedule("gpipe", 2, 2, replicas=[2, 1]).actions[2]
    assert Op.ALLREDUCE_GRAD not in [a.op for a in unreplicated]


def test_pipedream_rr_orders_and_in_flight():
    s = build_schedule("pipedream", 2, minibatches=4, replicas=[2, 1])
    text = [" ".join(str(a) for a in actions if a.op.is_compute or a.op in (Op.ALLREDUCE_GRAD, Op.OPTIMIZER_STEP))
            for actions in s.actions]
    # Replica 0 takes minibatches 0, 2, 4, 6 and keeps NOAM = 2 in flight; the single last stage takes all.
    assert text[0] == "F0 F2 B0 AR O F4 B2 AR O F6 B4 AR O B6 AR O"
    assert text[1] == "F1 F3 B1 AR O F5 B3 AR O F7 B5 AR O B7 AR O"
    assert text[2] == " ".join(f"F{m} B{m} O" for m in range(8))
    # A replica with fewer minibatches joins the last all-reduce round without a backward.
    odd = build_schedule("pipedream", 2, minibatches=3, replicas=[1, 2])
    assert [str(a) for a in odd.actions[2] if a.op in (Op.BACKWARD, Op.ALLREDUCE_GRAD, Op.OPTIMIZER_STEP)] == [
        "B1", "AR", "O", "AR", "O"
    ]


def test_validator_rejects_broken_replicated_schedules():
    s = build_schedule("gpipe", 2, 2, replicas=[2, 1])
    no_reduce = _edit(s, 1, lambda a: [x for x in a if x.op is not Op.ALLREDUCE_GRAD])
    with pytest.raises(ScheduleError, match="without a gradient all-reduce before it"):
        validate(no_reduce)
    extra = _edit(s, 2, lambda a: a[:-1] + [Action(Op.ALLREDUCE_GRAD, 1)] + a[-1:])
    with pytest.raises(ScheduleError, match="gradient all-reduce on stage 1, which has one replica"):
        validate(extra)
    wrong_owner = _edit(s, 0, lambda a: [replace(x, microbatch=1) if x.microbatch == 0 else x for x in a])
    with pytest.raises(ScheduleError, match="micro-batch 1 of stage 0 belongs to rank 1"):
        validate(wrong_owner)
    p = build_schedule("pipedream", 2, minibatches=3, replicas=[1, 2])
    missing_member = _edit(p, 2, lambda a: a[:-2])  # drop the filler round: rank 1 waits forever
    with pytest.raises(ScheduleError, match="runs 1 gradient all-reduces of stage 1 but rank 1 runs 2"):
        validate(missing_member)


def test_all_reduce_deadlock_names_the_missing_replica():
    s = build_schedule("1f1b", 2, 1, replicas=[2, 1])
    # Rank 0 all-reduces before its backward: it waits for rank 1, which waits for rank 2, which waits for rank 0.
    def early(actions):
        ar = next(i for i, a in enumerate(actions) if a.op is Op.ALLREDUCE_GRAD)
        b = next(i for i, a in enumerate(actions) if a.op is Op.RECV_GRAD)
        moved = actions.pop(ar)
        actions.insert(b, moved)
        return actions

    broken = _edit(s, 0, early)
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    assert "gradient all-reduce of stage 0 before 1 of the backwards" in str(info.value)


def test_grid_names_stages_and_all_reduces():
    grid = render_grid(build_schedule("gpipe", 2, 1, replicas=[2, 1]))
    assert grid.splitlines()[0].split() == ["slot", "rank", "0", "s0", "rank", "1", "s0", "rank", "2", "s1"]
    # Rank 0 waits in its all-reduce until rank 1's backward is done: both leave it in slot 5.
    assert grid.splitlines()[-1].split() == ["5", "AR+O", "B1+AR+O", "."]


def test_simulator_times_the_all_reduce():
    plain = simulate(build_schedule("1f1b", 2, 4), 1.0, 2.0)
    # Two data-parallel copies: the same pipeline per copy, then a ring all-reduce of stage 0's
    # 100 bytes over 2 replicas at 100 B/s: 2 * (2 - 1) / 2 * 100 / 100 = 1 s.
    dp = simulate(build_schedule("1f1b", 2, 4, replicas=[2, 2]), 1.0, 2.0, parameter_bytes=[100, 0], bandwidth=100.0)
    assert plain.makespan == 15.0 and dp.makespan == 16.0
    ars = [e for e in dp.events if e.action.op is Op.ALLREDUCE_GRAD]
    assert len(ars) == 4 and {e.end for e in ars if e.action.stage == 0} == {16.0}
    # PipeDream 2-1 with stage 0 twice as slow: two minibatches per step in the time one takes straight.
    rr = simulate(build_schedule("pipedream", 2, minibatches=8, replicas=[2, 1]), [2.0, 1.0], [4.0, 2.0])
    straight = simulate(build_schedule("pipedream", 2, minibatches=8), [2.0, 1.0], [4.0, 2.0])
    assert rr.steady_state and rr.step_time == straight.step_time == 6.0


def test_cli_show_and_simulate_draw_replicas(capsys):
    assert main(["show", "--schedule", "pipedream", "--replicas", "2,1", "--minibatches", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pipedream schedule, 2 stages (replicas 2,1 on 3 ranks) x 3 minibatches per input replica")
    assert "rank 0 s0  rank 1 s0  rank 2 s1" in out and "B5+AR+O" in out and "valid:" in out
    assert main(["simulate", "--replicas", "2,2", "--chunks", "4", "--parameter-bytes", "100,0", "--bandwidth", "100"]) == 0
    assert "step time         16 s" in capsys.readouterr().out
    assert main(["show", "--stages", "3", "--replicas", "2,1"]) == 2
    assert "lists 2 stages but --stages is 3" in capsys.readouterr().err
