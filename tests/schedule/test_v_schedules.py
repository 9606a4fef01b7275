"""The V-shape schedules (zb-v, dualpipev): torch's per-rank orders, every size validated, the bubble table, the words."""

from __future__ import annotations

import functools

import pytest

from lightning_pipedream.schedule.actions import Op, Schedule, v_rank
from lightning_pipedream.schedule.builders import build_schedule, check_schedule_options, inference
from lightning_pipedream.schedule.check import validate
from lightning_pipedream.schedule.simulate import simulate

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def _torch_order(cls_name: str, p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """torch's ``pipeline_order[rank]`` for ``cls_name``, computed without processes or stages: its per-rank
    method on a bare instance with the sizes it reads. A whole backward ("B") is our B then W; an overlapped
    forward-and-backward pair is its two parts, the forward first; idle slots (None) are left out."""
    cls = getattr(schedules, cls_name)
    bare = object.__new__(cls)
    bare.pp_group_size, bare._n_microbatches, bare.num_stages, bare._num_stages = p, m, 2 * p, 2 * p
    out: list[tuple[str, int, int]] = []

    def add(action) -> None:
        kind = action.computation_type.value  # "F", "I", "W", "B" (torch 2.8: numbers, the letters are str(type))
        kind = kind if isinstance(kind, str) else str(action.computation_type)
        if getattr(action, "sub_actions", None) is not None:  # torch 2.8's actions have none (no overlapped F and B)
            for sub in action.sub_actions:
                add(sub)
        elif kind == "B":
            out.extend([("B", action.stage_index, action.microbatch_index),
                        ("W", action.stage_index, action.microbatch_index)])
        else:
            out.append(({"I": "B"}.get(kind, kind), action.stage_index, action.microbatch_index))

    for action in bare._calculate_single_rank_operations(rank):
        if action is not None:
            add(action)
    return out


@functools.cache
def _validated(name: str, p: int, m: int) -> Schedule:
    schedule = build_schedule(name, p, m)
    validate(schedule)
    return schedule


def _our_order(name: str, p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    actions = _validated(name, p, m).actions[rank]
    return [(a.op.value, a.stage, a.microbatch) for a in actions if a.op.is_compute]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_per_rank_orders_agree_with_torch(p: int) -> None:
    for m in sorted({1, 2, p, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 1}):
        for rank in range(p):
            assert _our_order("zb-v", p, m, rank) == _torch_order("ScheduleZBVZeroBubble", p, m, rank), (p, m, rank)
            if m >= 2 * p and hasattr(schedules, "ScheduleDualPipeV"):
                assert _our_order("dualpipev", p, m, rank) == _torch_order("ScheduleDualPipeV", p, m, rank), (p, m, rank)


def test_every_size_is_valid_and_in_a_v() -> None:
    """Every size up to 6 ranks and 16 micro-batches (8 ranks: see the torch comparison, validated there too)."""
    for p in range(1, 7):
        for m in range(1, 17):
            names = ["zb-v"] + (["dualpipev"] if m >= 2 * p else [])
            for name in names:
                s = build_schedule(name, p, m)
                validate(s)
                assert (s.num_ranks, s.num_stages, s.virtual_stages, s.splits_backward) == (p, 2 * p, 2, True)
                for rank, actions in enumerate(s.actions):
                    assert {a.stage for a in actions} == {rank, 2 * p - 1 - rank} == set(s.stages_of(rank))
                    for a in actions:
                        if a.op.is_send or a.op.is_recv:
                            other = a.stage + (1 if a.op in (Op.SEND_ACT, Op.RECV_GRAD) else -1)
                            assert a.peer == v_rank(other, p)
                    ops = [a.op for a in actions]
                    assert ops.count(Op.FORWARD) == ops.count(Op.BACKWARD) == ops.count(Op.BACKWARD_WEIGHT) == 2 * m
                    assert ops[-2:] == [Op.OPTIMIZER_STEP, Op.OPTIMIZER_STEP]
            validate(inference(p, m, v_shape=True))


def test_the_turn_of_the_v_stays_on_its_rank() -> None:
    """Stage P-1 hands its output to stage P on rank P-1, and stage P its input gradient back, in memory:
    a message from the rank to itself (the executor's local queue), the only one; the loss's stage is on rank 0."""
    p = 4
    s = build_schedule("zb-v", p, 8)
    assert s.rank_of(2 * p - 1) == 0 and s.rank_of(0) == 0
    own = {(r, a.op, a.stage) for r, actions in enumerate(s.actions) for a in actions if a.peer == r}
    assert own == {(p - 1, Op.SEND_ACT, p - 1), (p - 1, Op.RECV_ACT, p), (p - 1, Op.SEND_GRAD, p),
                   (p - 1, Op.RECV_GRAD, p - 1)}


def test_simulated_bubbles_for_four_ranks_and_eight_micro_batches() -> None:
    """F = B = W for a whole stage's work (a V chunk does half of it): ideal work 24 units per rank; the bubble is
    makespan / 24 - 1, with the peak activations of rank 0 in whole-stage micro-batches."""
    table = {}
    for name, v in [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2)]:
        s = build_schedule(name, 4, 8, virtual_stages=v)
        unit = 1.0 / s.virtual_stages
        split = {"weight_s": unit} if s.splits_backward else {}
        result = simulate(s, unit, 2 * unit, **split)
        table[name] = (result.makespan / 24 - 1, result.peak_activations[0] * unit)
    assert table == {
        "1f1b": (0.375, 4), "interleaved": (0.1875, 5.5), "zb-h1": (0.125, 4), "zb-v": (0.0625, 4),
        "dualpipev": (0.0625, 4.5),
    }


def test_the_constraints_in_words() -> None:
    with pytest.raises(ValueError, match=r"schedule='zb-v' runs exactly 2 model chunks per rank \(one down the "
                                         r"ranks, one back up\), got virtual_stages=3: drop virtual_stages"):
        build_schedule("zb-v", 4, 8, virtual_stages=3)
    with pytest.raises(ValueError, match=r"schedule='dualpipev' needs at least 2 x ranks = 8 micro-batches per "
                                         r"step, got chunks=7: raise chunks to 8 or more, or use schedule='zb-v'."):
        build_schedule("dualpipev", 4, 7)
    with pytest.raises(ValueError, match=r"does not support replicated stages yet"):
        build_schedule("zb-v", 2, 4, replicas=[2, 1])
    check_schedule_options("zb-v", 4, virtual_stages=2)
    check_schedule_options("dualpipev", 4)  # virtual_stages defaults to the V's two
    assert build_schedule("zb-v", 3, 5, virtual_stages=2) == build_schedule("zb-v", 3, 5)


def test_a_model_needs_a_layer_per_chunk() -> None:
    from lightning_pipedream.plan.balance import check_chunk_count

    check_chunk_count(8, 4, 2, "zb-v")
    with pytest.raises(ValueError, match=r"schedule='zb-v' cuts the model into 4 processes x 2 model chunks = 8 "
                                         r"stages, but the model has 7 layers; every stage needs at least one. Use at "
                                         r"most 3 processes, or split the model into more layers."):
        check_chunk_count(7, 4, 2, "zb-v")


def test_the_memory_model_counts_each_ranks_two_chunks_of_the_v() -> None:
    """Rank r holds stages r and 2P-1-r: their parameters, and the activations its own action list keeps (zb-v holds
    as many chunk micro-batches on every rank; rank 0, with the loss's stage, no more than the others)."""
    from lightning_pipedream.plan.memory import StageBytes, predict_memory

    sizes = [StageBytes(parameters=1000.0 * (s + 1), input=80.0, layers=160.0, output=80.0) for s in range(4)]
    for name in ("zb-v", "dualpipev"):
        ranks = predict_memory(sizes, name, chunks=4, optimizer="sgd")
        assert [m.chunks for m in ranks] == [(0, 3), (1, 2)]
        assert [m.parameters for m in ranks] == [1000 + 4000, 2000 + 3000]
        interleaved = predict_memory(sizes, "interleaved", chunks=4, optimizer="sgd", virtual_stages=2)
        assert [m.chunks for m in interleaved] == [(0, 2), (1, 3)]
    zb_v = predict_memory(sizes, "zb-v", chunks=4, optimizer="sgd")
    assert zb_v[0].held == zb_v[1].held == 4  # 2P chunk micro-batches (P = 2), one stage's worth of 1F1B's stage 0


def test_a_dualpipev_step_of_fewer_micro_batches_runs_zb_v_on_the_same_v() -> None:
    """A smaller last batch (fewer than 2 micro-batches per rank) cannot run dualpipev's order: the engine runs that
    step as zb-v, whose chunks and placement are the same."""
    from torch import nn

    from lightning_pipedream.runtime.execution.engine import PipelineEngine
    from lightning_pipedream.schedule.builders import step_schedule

    assert step_schedule("dualpipev", 2, 3) == "zb-v" and step_schedule("dualpipev", 2, 4) == "dualpipev"
    assert step_schedule("zb-h1", 2, 1) == "zb-h1"
    engine = PipelineEngine([nn.Linear(2, 2), nn.Linear(2, 2)], 0, 2, None, schedule="dualpipev", chunks=4)  # type: ignore[arg-type]
    assert engine.step_actions() == list(build_schedule("dualpipev", 2, 4).actions[0])
    assert engine.step_actions(micro_batches=3) == list(build_schedule("zb-v", 2, 3).actions[0])
