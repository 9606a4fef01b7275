"""Placement in one process: every layout the strategy accepts (ranks, stages, groups) and refuses (with the fix)."""

from __future__ import annotations

import itertools

import pytest

from lightning_pipedream.schedule.specs import SCHEDULES, SPECS
from lightning_pipedream.strategy.setup import placement as placement_module
from lightning_pipedream.strategy.setup.placement import Placement, ProcessGroups


def all_ranks(schedule: str, world: int, **kwargs) -> list[Placement]:
    return [Placement.decide(schedule, world, rank, **kwargs) for rank in range(world)]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("world", "stages"), [(1, None), (2, None), (3, None), (4, 2), (6, 3), (6, 2), (8, 4),
                                               (4, 1), (4, 4)])
def test_equal_pipelines_are_stage_major(schedule: str, world: int, stages: int | None) -> None:
    places = all_ranks(schedule, world, stages=stages)
    p = stages or world
    d = world // p
    for place in places:
        assert (place.num_stages, place.num_pipelines) == (p, d)
        # stage s of pipeline k is rank s * d + k
        assert place.rank == place.stage_index * d + place.pipeline_index
        assert place.sampler_kwargs == {"num_replicas": d, "rank": place.pipeline_index}
        # the loss's stage: the last rank, or the first under a V schedule (its chunks go down and back up)
        assert place.is_last_stage == (place.stage_index == (0 if SPECS[schedule].v_shape else p - 1))
        assert place.last_stage_ranks() == [0 if SPECS[schedule].v_shape else p - 1]
        assert place.input_shards == 1 and not place.round_robin
    # every (stage, pipeline) pair is held by exactly one rank
    assert sorted((pl.stage_index, pl.pipeline_index) for pl in places) == sorted(
        itertools.product(range(p), range(d)))
    pipelines = places[0].pipeline_ranks()
    assert sorted(r for ranks in pipelines for r in ranks) == list(range(world))
    for place in places:
        mine = [ranks for ranks in pipelines if place.rank in ranks]
        assert len(mine) == 1 and all(places[r].pipeline_index == place.pipeline_index for r in mine[0])
        replicas = [ranks for ranks in place.replica_ranks() if place.rank in ranks]
        assert len(replicas) == (1 if d > 1 else 0)
        if replicas:
            assert all(places[r].stage_index == place.stage_index for r in replicas[0])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
@pytest.mark.parametrize("replicas", [(2, 1), (1, 2), (3, 1), (2, 1, 1), (1, 3, 2)])
def test_unequal_replicas_run_round_robin_over_the_whole_world(schedule: str, replicas: tuple[int, ...]) -> None:
    world = sum(replicas)
    places = all_ranks(schedule, world, replicas=replicas)
    starts = list(itertools.accumulate((0,) + replicas[:-1]))
    for place in places:
        assert place.round_robin and place.num_pipelines == 1 and place.num_stages == len(replicas)
        assert place.input_shards == replicas[0]
        s = place.stage_index
        assert starts[s] <= place.rank < starts[s] + replicas[s]
        assert place.replica_index == place.rank - starts[s]
        assert place.sampler_kwargs == {"num_replicas": 1, "rank": 0}  # every rank reads the whole batch
    assert places[0].pipeline_ranks() == [list(range(world))]
    assert places[0].replica_ranks() == [list(range(a, a + r)) for a, r in zip(starts, replicas)]
    assert places[0].last_stage_ranks() == list(range(starts[-1], world))
    assert places[0].first_replica_ranks() == starts


def test_equal_replicas_are_data_parallel_pipelines_and_ones_a_straight_pipeline() -> None:
    assert Placement.decide("1f1b", 4, 3, replicas=[2, 2]) == Placement.decide("1f1b", 4, 3, stages=2)
    assert Placement.decide("pipedream", 3, 1, replicas=[1, 1, 1]) == Placement.decide("pipedream", 3, 1)


def test_summaries_lag_under_the_asynchronous_schedules_only() -> None:
    for name, spec in SPECS.items():
        assert Placement.decide(name, 2).lagged_summaries == spec.asynchronous
        assert not Placement.decide(name, 2, stages=1).lagged_summaries  # one stage: nothing in flight


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(schedule="1f1b", world_size=4, stages=3),
     "PipeDreamStrategy(stages=3) runs on 4 processes: the processes must be a multiple of the stages (d "
     "data-parallel pipelines of 3 stages). Use devices x num_nodes = 3 x d, or stages dividing 4."),
    (dict(schedule="1f1b", world_size=2, stages=0), "stages must be an integer >= 1 (the pipeline's length), got 0."),
    (dict(schedule="1f1b", world_size=2, stages=True),
     "stages must be an integer >= 1 (the pipeline's length), got True."),
    (dict(schedule="1f1b", world_size=4, replicas=[2, 1]),
     "replicas [2, 1] need 3 processes but the Trainer runs 4; set devices x num_nodes to 3, or change the replicas."),
    (dict(schedule="1f1b", world_size=3, replicas=[2, 1], stages=3),
     "stages=3 but replicas [2, 1] give 2 stages; drop one of them."),
    (dict(schedule="2bw", world_size=3, replicas=[2, 1]),
     "Stages with unequal replica counts ([2, 1]) run with schedule='pipedream', 'gpipe' or '1f1b' under "
     "PipeDreamStrategy, not '2bw'. Use one of those, or equal replicas (data-parallel pipelines)."),
    (dict(schedule="interleaved", world_size=3, replicas=[1, 2]),
     "Stages with unequal replica counts ([1, 2]) run with schedule='pipedream', 'gpipe' or '1f1b' under "
     "PipeDreamStrategy, not 'interleaved'."),
    (dict(schedule="pipedream", world_size=3, replicas=[2, 1], accumulate_grad_batches=2),
     "PipeDreamStrategy(schedule='pipedream') with replicas [2, 1] and accumulate_grad_batches=2: PipeDream's "
     "1F1B-RR makes each shard a minibatch of its own and does not accumulate. Use a larger batch instead, or "
     "schedule='1f1b'."),
    (dict(schedule="nope", world_size=2), "Unknown schedule 'nope'. Choose one of: gpipe, 1f1b, pipedream, 2bw, "
                                          "interleaved, zb-h1, zb-v, dualpipev."),
])
def test_layouts_that_cannot_run_are_refused_with_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        Placement.decide(**kwargs)
    assert message in str(err.value)


def test_accumulation_with_unequal_replicas_is_fine_for_the_flushed_schedules() -> None:
    assert Placement.decide("1f1b", 3, replicas=[2, 1], accumulate_grad_batches=4).round_robin


class RecordingGroups:
    """A stand-in for ``dist.new_group``: records every call, returns a token naming the members."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, ...] | None] = []

    def __call__(self, ranks=None, **options) -> tuple:
        assert set(options) == {"backend", "timeout"}
        self.calls.append(None if ranks is None else tuple(ranks))
        return ("group", len(self.calls) - 1, None if ranks is None else tuple(ranks))


@pytest.mark.parametrize(("schedule", "world", "kwargs"), [
    ("1f1b", 1, {}), ("1f1b", 2, {}), ("pipedream", 2, {}), ("pipedream", 4, {"stages": 2}),
    ("1f1b", 6, {"stages": 3}), ("2bw", 4, {"stages": 4}), ("1f1b", 4, {"stages": 1}),
    ("pipedream", 3, {"replicas": [2, 1]}), ("1f1b", 5, {"replicas": [1, 3, 1]}),
])
def test_every_rank_makes_the_same_groups_in_the_same_order_and_keeps_its_own(monkeypatch, schedule, world, kwargs):
    made = {}
    for rank in range(world):
        recorder = RecordingGroups()
        monkeypatch.setattr(placement_module.dist, "new_group", recorder)
        place = Placement.decide(schedule, world, rank, **kwargs)
        groups = ProcessGroups.make(place, "gloo", None)
        made[rank] = (recorder.calls, groups, place)
    orders = {tuple(calls) for calls, _, _ in made.values()}
    assert len(orders) == 1, "new_group is collective: every rank must make the same groups in the same order"
    for rank, (_, groups, place) in made.items():
        if place.num_stages == 1 and place.num_pipelines == 1:
            assert groups == ProcessGroups()  # one process: nothing to talk to
            continue
        # A group of None members is the whole world (one pipeline over every rank).
        members = groups.pipeline[2] or tuple(range(world))
        assert tuple(members) == tuple(next(r for r in place.pipeline_ranks() if rank in r))
        assert (groups.summaries is not None) == place.lagged_summaries
        if groups.replicas is not None:
            assert tuple(groups.replicas[2]) == tuple(next(r for r in place.replica_ranks() if rank in r))
        else:  # no other replica of this stage
            assert all(rank not in r or len(r) == 1 for r in place.replica_ranks())
