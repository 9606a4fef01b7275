"""The validator over every builder and size, on broken schedules, and the builders' shapes as data."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_pipedream.schedule.actions import Action, Op, Schedule
from lightning_pipedream.schedule.builders import SCHEDULES, build_schedule, inference
from lightning_pipedream.schedule.check import ScheduleError, place, render_grid, validate

MAX_STAGES, MAX_CHUNKS = 8, 32


def _peak_in_flight(actions: tuple[Action, ...]) -> int:
    """Most micro-batches whose forward ran and backward did not, at any point of one rank's list."""
    live = peak = 0
    for a in actions:
        live += (a.op is Op.FORWARD) - (a.op is Op.BACKWARD)
        peak = max(peak, live)
    return peak


def _compute(actions: tuple[Action, ...]) -> list[str]:
    return [str(a) for a in actions if a.op.is_compute or a.op is Op.OPTIMIZER_STEP]


def _edit(schedule: Schedule, rank: int, change) -> Schedule:
    ranks = list(schedule.actions)
    ranks[rank] = tuple(change(list(ranks[rank])))
    return replace(schedule, actions=tuple(ranks))


def _index(actions, text: str) -> int:
    return [str(a) for a in actions].index(text)


# ------------------------------------------------------------------------------------------
# Every builder, every size.


def _build(name: str, stages: int, count: int) -> Schedule:
    """``count`` micro-batches per step, or for pipedream ``count`` minibatches before the drain
    (2bw: 3 minibatches of ``count`` micro-batches; interleaved: 2 model chunks per rank; dualpipev: at least
    ``2 * stages``)."""
    if name == "pipedream":
        return build_schedule(name, stages, minibatches=count)
    if name == "2bw":
        return build_schedule(name, stages, count, minibatches=3)
    if name == "interleaved":
        return build_schedule(name, stages, count, virtual_stages=2)
    if name == "dualpipev":  # at least 2 micro-batches per rank
        return build_schedule(name, stages, max(count, 2 * stages))
    return build_schedule(name, stages, count)


FIRST_SCHEDULES = ("gpipe", "1f1b", "pipedream")  # the newer ones: tests/schedule/test_newer_schedules.py


def test_every_builder_and_size_is_valid():
    count = 0
    for name in FIRST_SCHEDULES:
        for stages in range(1, MAX_STAGES + 1):
            for chunks in range(1, MAX_CHUNKS + 1):
                schedule = _build(name, stages, chunks)
                validate(schedule)
                placement = place(schedule)
                assert all(i is None for i in placement.stuck)
                count += 1
    assert count == len(FIRST_SCHEDULES) * MAX_STAGES * MAX_CHUNKS


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flushed_shapes(name):
    for p in range(1, MAX_STAGES + 1):
        for m in range(1, MAX_CHUNKS + 1):
            s = build_schedule(name, p, m)
            for stage, actions in enumerate(s.actions):
                order = _compute(actions)
                # One update per stage per step, after the flush.
                assert order.count("O") == 1 and order[-1] == "O"
                assert str(actions[-1]) == "O"
                forwards_first = order.index(f"B{0}")
                peak = _peak_in_flight(actions)
                if name == "gpipe":
                    assert forwards_first == m and peak == m
                else:
                    # Warm-up: stages - stage - 1 forwards, then the first 1F1B pair starts with a forward.
                    assert forwards_first == min(p - stage, m)
                    assert peak == min(p - stage, m)
                # Micro-batches run in order on every stage.
                assert [a for a in order if a[0] == "F"] == [f"F{i}" for i in range(m)]
                assert [a for a in order if a[0] == "B"] == [f"B{i}" for i in range(m)]


def test_1f1b_stage0_warmup_has_stages_minus_one_forwards():
    s = build_schedule("1f1b", 4, 8)
    assert _compute(s.actions[0])[:5] == ["F0", "F1", "F2", "F3", "B0"]  # F0..F2 warm-up, then F3 B0
    assert _compute(s.actions[3])[:4] == ["F0", "B0", "F1", "B1"]  # the last stage has none


def test_pipedream_shapes():
    for p in range(1, MAX_STAGES + 1):
        for n in range(1, MAX_CHUNKS + 1):
            s = build_schedule("pipedream", p, minibatches=n)
            assert s.steps() == n + (p > 1)  # n steps, then the drain (empty with one stage)
            for stage, actions in enumerate(s.actions):
                assert _peak_in_flight(actions) == min(p - stage, n)
                order = _compute(actions)
                backwards = [i for i, a in enumerate(order) if a[0] == "B"]
                assert len(backwards) == n == order.count("O")
                assert all(order[i + 1] == "O" for i in backwards)  # one update after every backward
                for a in actions:  # step t admits minibatch t; backward of t runs p - stage - 1 steps later
                    if a.op is Op.FORWARD:
                        assert a.step == a.microbatch
                    elif a.op is Op.BACKWARD:
                        assert a.step == min(a.microbatch + p - stage - 1, n)


# ------------------------------------------------------------------------------------------
# The grid, against tables drawn by hand (unit-time forward and backward, free communication).

GPIPE_3x4 = """\
slot  rank 0  rank 1  rank 2
   0  F0      .       .
   1  F1      F0      .
   2  F2      F1      F0
   3  F3      F2      F1
   4  .       F3      F2
   5  .       .       F3
   6  .       .       B0
   7  .       B0      B1
   8  B0      B1      B2
   9  B1      B2      B3+O
  10  B2      B3+O    .
  11  B3+O    .       ."""

ONE_F_ONE_B_3x4 = """\
slot  rank 0  rank 1  rank 2
   0  F0      .       .
   1  F1      F0      .
   2  F2      F1      F0
   3  .       .       B0
   4  .       B0      F1
   5  B0      F2      B1
   6  F3      B1      F2
   7  B1      F3      B2
   8  .       B2      F3
   9  B2      .       B3+O
  10  .       B3+O    .
  11  B3+O    .       ."""


@pytest.mark.parametrize(("name", "table"), [("gpipe", GPIPE_3x4), ("1f1b", ONE_F_ONE_B_3x4)])
def test_grid_matches_hand_drawn_table(name, table):
    assert render_grid(build_schedule(name, 3, 4)) == table


def test_grid_rows_and_mark():
    s = build_schedule("gpipe", 3, 4)
    text = render_grid(s, mark=(1, _index(s.actions[1], "F2")), rows=(2, 4))
    assert text.splitlines() == [
        "slot  rank 0  rank 1  rank 2",
        "...",
        "   2  F2      F1      F0",
        "   3  F3      >F2<    F1",
        "   4  .       F3      F2",
        "...",
    ]


def _round_robin(num_ranks: int, num_stages: int, chunks: int, order: dict[int, list], name: str = "gpipe") -> Schedule:
    """A schedule from per-rank compute orders [(op, stage, mb)], with stage s on rank s % num_ranks."""
    ranks = []
    for rank in range(num_ranks):
        acts = []
        for op, stage, mb in order[rank]:
            prev, nxt = (stage - 1) % num_ranks, (stage + 1) % num_ranks
            if op == "F":
                acts += [Action(Op.RECV_ACT, stage, mb, prev)] if stage > 0 else []
                acts += [Action(Op.FORWARD, stage, mb)]
                acts += [Action(Op.SEND_ACT, stage, mb, nxt)] if stage < num_stages - 1 else []
            elif op == "B":
                acts += [Action(Op.RECV_GRAD, stage, mb, nxt)] if stage < num_stages - 1 else []
                acts += [Action(Op.BACKWARD, stage, mb)]
                acts += [Action(Op.SEND_GRAD, stage, mb, prev)] if stage > 0 else []
            else:
                acts.append(Action(Op.OPTIMIZER_STEP, stage))
        ranks.append(tuple(acts))
    return Schedule(name, num_ranks, num_stages, chunks, tuple(ranks))


def test_several_stages_per_rank():
    # Two ranks, four stages (0, 2 on rank 0; 1, 3 on rank 1), GPipe order over the virtual stages.
    m = 3
    order = {
        r: [("F", r, i) for i in range(m)] + [("F", r + 2, i) for i in range(m)]
        + [("B", r + 2, i) for i in range(m)] + [("O", r + 2, None)]
        + [("B", r, i) for i in range(m)] + [("O", r, None)]
        for r in range(2)
    }
    s = _round_robin(2, 4, m, order)
    validate(s)
    grid = render_grid(s)
    assert "F0s2" in grid and "B2s1+Os1" not in grid and "B2s1+O" in grid


def test_forward_only_schedules():
    order = {r: [("F", r, i) for i in range(3)] for r in range(3)}
    validate(_round_robin(3, 3, 3, order, name="inference"))
    with pytest.raises(ScheduleError, match=r"rank 2, action 4 \(end of its list\): never runs the forward of micro-batch 2"):
        validate(_round_robin(3, 3, 3, {**order, 2: order[2][:2]}, name="inference"))
    with pytest.raises(ScheduleError, match=r"rank 0, action 6 \(O\): inference runs forwards only; remove this optimizer_step"):
        validate(_round_robin(3, 3, 3, {**order, 0: order[0] + [("O", 0, None)]}, name="inference"))
    with pytest.raises(ScheduleError, match=r"   2  F2\+>O<  F1"):
        validate(_round_robin(3, 3, 3, {**order, 0: order[0] + [("O", 0, None)]}, name="inference"))
    with pytest.raises(ScheduleError, match=r"rank 0, action 6 \(end of its list\): never runs the backward"):
        validate(_round_robin(3, 3, 3, order, name="gpipe"))  # a training schedule needs its backwards
    for p in range(1, MAX_STAGES + 1):
        for m in range(1, MAX_CHUNKS + 1, 7):
            validate(inference(p, m))


def test_sends_may_be_delayed():
    # A valid schedule the builders never make: stage 0 sends each output only after the next forward.
    s = build_schedule("gpipe", 2, 3)

    def late(actions):
        sends = [a for a in actions if a.op is Op.SEND_ACT]
        rest = [a for a in actions if a.op is not Op.SEND_ACT]
        f2 = rest.index(Action(Op.FORWARD, 0, 2))
        return rest[:f2 + 1] + sends + rest[f2 + 1:]

    validate(_edit(s, 0, late))


# ------------------------------------------------------------------------------------------
# Broken schedules are rejected, naming the rank, the step and the action.


def test_swapped_receive_deadlocks():
    s = build_schedule("gpipe", 3, 4)

    def early_grad(actions):  # rank 1 waits for a gradient before forwarding the rest
        grad = actions.pop(_index(actions, "RG0@2"))
        actions.insert(3, grad)
        return actions

    with pytest.raises(ScheduleError, match=r"rank 1, action 3 \(RG0@2\): deadlock: ranks 1, 2 wait for each other") as err:
        validate(_edit(s, 1, early_grad))
    text = str(err.value)
    assert "rank 2 at action 2 (RA1@1) waits for the output of stage 1 micro-batch 1 from rank 1" in text
    assert "wait  ?RG0@1  >?RG0@2<  ?RA1@1" in text  # the grid's last row: what each rank waits on


def test_missing_send():
    s = build_schedule("gpipe", 3, 4)
    broken = _edit(s, 0, lambda acts: [a for a in acts if str(a) != "SA2@1"])
    with pytest.raises(
        ScheduleError, match=r"rank 1, action 6 \(RA2@0\): waits for the output of stage 0 micro-batch 2, which rank 0 never sends"
    ) as err:
        validate(broken)
    assert ">RA2@0<" in str(err.value)


def test_missing_receive():
    s = build_schedule("1f1b", 2, 2)
    broken = _edit(s, 0, lambda acts: [a for a in acts if str(a) != "RG1@1"])
    with pytest.raises(ScheduleError, match=r"rank 0, action \d+ \(B1\): backward of micro-batch 1 before its output gradient"):
        validate(broken)


def test_backward_before_forward():
    s = build_schedule("1f1b", 2, 3)
    broken = _edit(s, 1, lambda acts: acts[:1] + [acts[2], acts[1]] + acts[3:])  # RA0 B0 F0 ...
    with pytest.raises(ScheduleError, match=r"rank 1, action 1 \(B0\): backward of micro-batch 0 before its forward on stage 1") as err:
        validate(broken)
    assert ">B0<" in str(err.value)


def test_duplicated_forward():
    s = build_schedule("gpipe", 3, 4)
    broken = _edit(s, 0, lambda acts: acts[:2] + [acts[0]] + acts[2:])
    with pytest.raises(ScheduleError, match=r"rank 0, action 2 \(F0\): duplicated forward of micro-batch 0 on stage 0 \(already at action 0\)") as err:
        validate(broken)
    assert "   1  >F0<    F0" in str(err.value)


def test_receives_out_of_order_on_one_link():
    s = build_schedule("gpipe", 3, 4)
    broken = _edit(s, 1, lambda acts: acts[3:6] + acts[:3] + acts[6:])  # RA1 F1 SA1 RA0 F0 SA0 ...
    with pytest.raises(ScheduleError, match=r"rank 1, action 0 \(RA1@0\): expects the output of stage 0 micro-batch 1, but the message arriving next"):
        validate(broken)


def test_never_runs_backward():
    s = build_schedule("gpipe", 1, 2)
    broken = _edit(s, 0, lambda acts: [a for a in acts if str(a) != "B1"])
    with pytest.raises(ScheduleError, match=r"rank 0, action 4 \(end of its list\): never runs the backward of micro-batch 1"):
        validate(broken)


def test_wrong_peer_and_wrong_rank():
    s = build_schedule("gpipe", 3, 2)
    bad_peer = _edit(s, 0, lambda acts: [replace(a, peer=2) if a.op is Op.SEND_ACT else a for a in acts])
    with pytest.raises(ScheduleError, match=r"rank 0, action 1 \(SA0@2\): peer should be rank 1"):
        validate(bad_peer)
    bad_stage = _edit(s, 0, lambda acts: [replace(acts[0], stage=1)] + acts[1:])
    with pytest.raises(ScheduleError, match=r"rank 0, action 0 \(F0\): stage 1 does not live on rank 0"):
        validate(bad_stage)


def test_optimizer_step_placement():
    flushed = build_schedule("1f1b", 2, 2)
    early = _edit(flushed, 0, lambda acts: [acts[-1]] + acts[:-1])
    with pytest.raises(ScheduleError, match=r"rank 0, action 0 \(O\): optimizer step of stage 0 before 2 of the backwards"):
        validate(early)
    none = _edit(flushed, 1, lambda acts: acts[:-1])
    with pytest.raises(ScheduleError, match=r"rank 1, action \d+ \(end of its list\): stage 1 has no optimizer step"):
        validate(none)
    twice = _edit(flushed, 1, lambda acts: acts + [acts[-1]])
    with pytest.raises(ScheduleError, match=r"second optimizer step of stage 1"):
        validate(twice)

    pd = build_schedule("pipedream", 3, minibatches=4)
    skipped = _edit(pd, 0, lambda acts: [a for a in acts if not (a.op is Op.OPTIMIZER_STEP and a.step == 3)])
    with pytest.raises(ScheduleError, match=r"rank 0, action \d+ \(B2\): stage 0 computes before the optimizer step that must follow backward 1"):
        validate(skipped)
    extra = _edit(pd, 2, lambda acts: [Action(Op.OPTIMIZER_STEP, 2)] + acts)
    with pytest.raises(ScheduleError, match=r"rank 2, action 0 \(O\): optimizer step on stage 2 without a backward before it"):
        validate(extra)


@pytest.mark.parametrize("name", SCHEDULES)
def test_dropping_or_repeating_any_action_is_rejected(name):
    s = _build(name, 3, 4)
    for rank, actions in enumerate(s.actions):
        for i in range(len(actions)):
            with pytest.raises(ScheduleError, match=r"rank \d, action \d+"):
                validate(_edit(s, rank, lambda acts: acts[:i] + acts[i + 1:]))
            with pytest.raises(ScheduleError, match=r"rank \d, action \d+"):
                validate(_edit(s, rank, lambda acts: acts[:i + 1] + acts[i:]))


def test_bad_sizes():
    s = build_schedule("gpipe", 2, 2)
    with pytest.raises(ScheduleError, match="lists actions for 1 ranks but declares num_ranks=2"):
        validate(replace(s, actions=s.actions[:1]))


def test_schedule_package_is_pure_python():
    """No torch or Lightning in schedule/, and matplotlib only inside functions (imported when drawing)."""
    import ast
    from pathlib import Path

    import lightning_pipedream.schedule as package

    for path in Path(package.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            roots = {n.split(".")[0] for n in names}
            assert not roots & {"torch", "lightning", "pytorch_lightning"}, f"{path.name} imports {roots}"
            if "matplotlib" in roots:
                assert id(node) not in top_level, f"{path.name} imports matplotlib at module level"


def test_build_schedule_keeps_chunks_and_minibatches_apart():
    pd = build_schedule("pipedream", 3, minibatches=5)
    assert (pd.chunks, pd.minibatches, pd.microbatch_count, pd.size()) == (1, 5, 5, "3 stages x 5 minibatches")
    gp = build_schedule("gpipe", 3, 4)
    assert (gp.chunks, gp.minibatches, gp.microbatch_count, gp.size()) == (4, 1, 4, "3 stages x 4 chunks")
    with pytest.raises(ValueError, match=r"needs minibatches=N: the number of minibatches \(training steps\)"):
        build_schedule("pipedream", 3)
    with pytest.raises(ValueError, match="schedule='pipedream' runs each batch as one PipeDream minibatch; chunks=4"):
        build_schedule("pipedream", 3, 4, minibatches=2)
    with pytest.raises(ValueError, match="minibatches=2 applies to schedule='pipedream' or '2bw' only"):
        build_schedule("1f1b", 3, 4, minibatches=2)
    with pytest.raises(ValueError, match="minibatches must be an integer >= 1, got 0"):
        build_schedule("pipedream", 3, minibatches=0)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=r"chunks must be an integer >= 1, got .*: it is the number of micro-batches"):
            build_schedule("gpipe", 3, bad)


# --------------------------------------------------------------------------------------------
# The builders' arguments and labels (what the mutation run found unguarded)


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_schedule_carries_its_name(name):
    assert _build(name, 2, 2).name == name


def test_pipedream_communication_carries_the_training_step():
    from lightning_pipedream.schedule.builders import pipedream_step

    comm = (Op.RECV_ACT, Op.SEND_ACT, Op.RECV_GRAD, Op.SEND_GRAD)
    for stage in range(3):
        actions = [a for a in pipedream_step(3, stage, 5) if a.op in comm]
        assert actions and all(a.step == 5 for a in actions), stage
    assert {a.op for s in range(3) for a in pipedream_step(3, s, 5) if a.op in comm} == set(comm)


def test_pipedream_drain_after_no_steps_is_empty():
    from lightning_pipedream.schedule.builders import pipedream_drain

    assert pipedream_drain(2, 0, 0) == []
    with pytest.raises(ValueError, match="minibatches must be >= 0, got -1"):
        pipedream_drain(2, 0, -1)


@pytest.mark.parametrize("num_stages", [0, -1, 2.0])
def test_builders_refuse_a_bad_stage_count(num_stages):
    with pytest.raises(ValueError, match="num_stages must be an integer >= 1"):
        build_schedule("gpipe", num_stages, 2)


def test_schedule_options_errors_say_what_to_change():
    from lightning_pipedream.schedule.builders import check_schedule_name, check_schedule_options

    with pytest.raises(ValueError, match="Unknown schedule 'zb'. Choose one of: gpipe, 1f1b, pipedream"):
        check_schedule_name("zb")
    with pytest.raises(ValueError, match=r"vertical_sync=True only applies to schedule='pipedream'\."):
        check_schedule_options("1f1b", 2, vertical_sync=True)
    check_schedule_options("pipedream", 1, vertical_sync=True)
    with pytest.raises(ValueError, match=r"Use chunks=1, or schedule='1f1b'/'gpipe'"):
        check_schedule_options("pipedream", 4)


def test_builder_argument_errors_are_worded_in_full():
    from lightning_pipedream.schedule.builders import check_chunks

    with pytest.raises(ValueError, match=r"split into \(1 means no split\)\.$"):
        check_chunks(0)
    with pytest.raises(ValueError, match=r"PipeDream minibatches \(training steps\) run before the drain\.$"):
        build_schedule("pipedream", 2, minibatches=0)
    with pytest.raises(ValueError, match=r"'gpipe' covers one training step of `chunks` micro-batches\.$"):
        build_schedule("gpipe", 2, 2, minibatches=3)
