"""The auto planner: more stages or recompute when memory is tight, the smallest limit when nothing fits, --exact."""

from __future__ import annotations

import itertools
import math

import pytest

from lightning_pipedream.plan.auto import NoPlanFitsError, auto_plan
from lightning_pipedream.plan.partition import Plan
from lightning_pipedream.plan.profile import LayerProfile, Profile
from lightning_pipedream.plan.topology import Topology
from lightning_pipedream.schedule.specs import spec_of

FREE = Topology.flat(2, math.inf)


def four_layers(temporaries: int = 0) -> Profile:
    """4 layers: forward 1 s, backward 2 s, 1000 bytes of activations and 1000 of parameters each; a backward needs
    nothing on top but ``temporaries`` bytes of parameter gradients, a split one keeps nothing for its weight half."""
    return Profile([LayerProfile(f"l{i}", 1.0, 2.0, 1000, 1000, grad_working_bytes=0, grad_temp_bytes=temporaries,
                                 pending_bytes=0, largest_parameter_bytes=500) for i in range(4)])


def plan(limit, temporaries=0, **kwargs):
    kwargs = {"exact": True, "optimizer": "sgd", "max_chunks": 4, **kwargs}
    return auto_plan(four_layers(temporaries), FREE, limit, **kwargs)


def test_without_a_limit_two_data_parallel_replicas_win():
    # One stage on both workers runs 12 s of work per minibatch at half the time each, 6 s, with no bubble and free
    # links. Its peak is the all-reduce's flat copy of the 4000 bytes of gradients, whatever the micro-batches (4 keep a
    # quarter of the 4000 activation bytes, one all of them): among equal times and peaks, the fewest micro-batches.
    result = plan(None)
    c = result.chosen
    assert (c.schedule, c.replicas, c.chunks, c.recompute) == ("1f1b", (2,), 1, (False,))
    assert c.time_per_minibatch == pytest.approx(6.0)
    # SGD: 4000 bytes of weights, 4000 of gradients, and 4000 of the all-reduce's copy of them
    assert [m.predicted_peak_bytes for m in c.memory] == [12000]
    assert [m.sync_working for m in c.memory] == [4000]


ONE_CHUNK_PER_WORKER = ["gpipe", "1f1b", "zb-h1"]  # the exact schedules with one model chunk per worker


def test_a_tight_limit_gives_more_stages():
    result = plan(8999, schedules=ONE_CHUNK_PER_WORKER)  # one stage needs 8000 bytes of weights and gradients plus
    assert len(result.chosen.replicas) == 2  # at least 1000 of activations
    assert result.chosen.balance == (2, 2)
    assert result.chosen.peak_bytes <= 8999
    assert result.runner_up is not None and result.runner_up.shape != result.chosen.shape


def test_the_v_schedules_are_weighed_with_their_two_chunks_per_worker():
    """With a V schedule allowed, 4 chunks of one layer on 2 workers: zb-v's step (6.25 s: 6 s of work, a quarter
    second of bubble) beats zb-h1's on 2 stages (6.5 s) and dualpipev's (as fast, more activations), within the limit.
    Its memory: worker 0 holds stages 0 and 3, worker 1 stages 1 and 2, each 2000 bytes of weights and 2000 of
    gradients, and the activations of the chunk micro-batches its own action list keeps."""
    result = plan(8999)
    c = result.chosen
    assert (c.schedule, c.balance, c.chunks, c.virtual_stages) == ("zb-v", (1, 1, 1, 1), 4, 2)
    assert c.time_per_minibatch == pytest.approx(6.25)
    assert [m.chunks for m in c.memory] == [(0, 3), (1, 2)]
    assert [m.parameters for m in c.memory] == [2000, 2000]
    assert c.peak_bytes <= 8999
    assert result.runner_up is not None and result.runner_up.schedule == "dualpipev"
    assert plan(8999, schedules=["zb-h1"]).chosen.time_per_minibatch == pytest.approx(6.5)
    assert result.plan.schedule == "zb-v" and result.plan.extra["virtual_stages"] == 2 and result.plan.num_workers == 2


def test_a_tighter_limit_gives_recompute_where_it_is_needed():
    # Two stages of 2 layers, 4 micro-batches, 1f1b: stage 0 holds 2 micro-batches of (0 + 2000) / 4 bytes = 1000,
    # with 4000 of weights and gradients: 5000. Recomputing keeps 2 x (0 + 1000) / 4 = 500 and replays (2000 - 1000)
    # / 4 = 250: 4750. Stage 1 holds one micro-batch, (1000 + 2000) / 4 = 750: 4750 without recompute.
    # zb-h1 holds 2 on stage 1 (5500, 5000 recomputing), gpipe 4 (6000, 5250): only 1f1b fits.
    result = plan(4999)
    c = result.chosen
    assert (c.schedule, c.balance, c.chunks, c.recompute) == ("1f1b", (2, 2), 4, (True, False))
    assert [m.predicted_peak_bytes for m in c.memory] == [4750, 4000 + 750]
    # Stage 0's backward replays its forward: forward 2/4 = 0.5 s, backward (4 + 2)/4 = 1.5 s per micro-batch, busy
    # 4 x 2 = 8 s, idle 1 s waiting for the first gradient (stage 1's forward 0.5 s and backward 1 s after stage 0's
    # second forward ends at 1 s: it arrives at 2 s).
    assert c.time_per_minibatch == pytest.approx(9.0)
    text = result.describe()
    assert "1f1b, 2 stages (1-1), 4 micro-batches, recompute on stage 0" in text
    assert "why: no configuration of another shape fits" in text
    assert result.strategy_arguments() == {"schedule": "1f1b", "chunks": 4, "balance": [2, 2],
                                           "recompute": [True, False]}
    assert "run it with PipeDreamStrategy(schedule='1f1b', chunks=4, balance=[2, 2], recompute=[True, False])" in text


def test_nothing_fits_names_the_smallest_limit_that_does():
    with pytest.raises(NoPlanFitsError) as err:
        plan(4000)
    assert err.value.smallest_limit == 4750
    assert str(err.value) == (
        "No configuration of the 4 layers on 2 workers (any split, replicas, exact schedule, micro-batches and "
        "recompute) keeps every worker within memory_limit=4000 bytes (3.91 KiB): the least any needs is 4750 bytes "
        "(4.64 KiB) per worker, with 1f1b, 2 stages (1-1), 4 micro-batches, recompute on stage 0. Raise the limit "
        "to at least 4750 bytes, or add workers."
    )
    assert plan(4750).chosen.peak_bytes == 4750  # and it does fit


def test_the_backward_s_working_set_counts():
    # 500 bytes of parameter gradients on top of every backward: the plan that fitted in 4750 needs 5250
    with pytest.raises(NoPlanFitsError) as err:
        plan(4999, temporaries=500)
    assert err.value.smallest_limit == 5250
    c = plan(5250, temporaries=500).chosen
    assert [m.backward_working for m in c.memory] == [500, 500]
    assert [m.predicted_peak_bytes for m in c.memory] == [5250, 5250]


def test_exact_admits_only_schedules_equal_to_one_device():
    # 8 layers without activations on 4 workers whose slow links make data parallelism's all-reduce cost 3 s per
    # minibatch: one stage per worker, 6 s each. pipedream and 2bw run one minibatch per 6 s; a flushed schedule
    # pays its bubble on top (zb-h1 the least of them).
    profile = Profile([LayerProfile(f"l{i}", 1.0, 2.0, 0, 1000) for i in range(8)])
    topology = Topology.flat(4, 1e3)
    free = auto_plan(profile, topology, exact=False, optimizer="sgd")
    assert not spec_of(free.chosen.schedule).exact
    assert free.chosen.replicas == (1, 1, 1, 1) and free.chosen.time_per_minibatch == pytest.approx(6.0)
    exact = auto_plan(profile, topology, exact=True, optimizer="sgd")
    assert spec_of(exact.chosen.schedule).exact
    assert exact.runner_up is not None and spec_of(exact.runner_up.schedule).exact
    assert exact.chosen.time_per_minibatch > free.chosen.time_per_minibatch


def test_the_plan_is_a_plan_and_carries_the_memory():
    result = plan(4999)
    data = result.plan.to_json()
    again = Plan.from_json(data)
    assert again.balance == [2, 2] and again.schedule == "1f1b" and again.chunks == 4
    assert again.extra["recompute"] == [True, False]
    assert again.extra["predicted_peak_bytes"] == [4750, 4750]
    assert again.extra["memory"][0]["replay"] == 250
    assert result.to_json()["predicted_peak_bytes"] == [4750, 4750]


def test_twenty_layers_on_four_workers_plan_within_the_memory_limit():
    profile = Profile([LayerProfile(f"l{i}", 1e-3 * (1 + i % 3), 2e-3, 4_000_000, 1_000_000) for i in range(20)],
                      batch_size=64)
    result = auto_plan(profile, Topology.flat(4, 1e10), 30e6)
    assert result.chosen.peak_bytes <= 30e6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"exact": True, "schedules": ["pipedream"]},
         "exact=True admits only schedules equal to one device; pipedream is not. Drop them or drop exact"),
        ({"memory_limit": -1}, "memory_limit is -1; give bytes per worker > 0, or None for no limit."),
        ({"optimizer": "lion"}, "Unknown optimizer kind 'lion'"),
        ({"max_chunks": 0}, "max_chunks must be a whole number >= 1, got 0."),
        ({"schedules": ["fast"]}, "Unknown schedule 'fast'. Choose one of: gpipe, 1f1b"),
        ({"topology": Topology.flat(1), "schedules": ["zb-h1"]},
         "No configuration of the 4 layers on 1 worker can run zb-h1: every stage needs a layer with parameters (its "
         "optimizer's), zb-h1 needs 2 stages or more and interleaved 2 model chunks per worker. Allow other "
         "schedules, or change the number of workers."),
    ],
)
def test_errors_say_what_to_change(kwargs, message):
    topology = kwargs.pop("topology", FREE)
    with pytest.raises(ValueError) as err:
        auto_plan(four_layers(), topology, **kwargs)
    assert message in str(err.value)
    assert not isinstance(err.value, NoPlanFitsError)  # nothing about memory


@pytest.mark.parametrize("seed", range(12))
def test_the_planner_s_memory_is_the_model_s_and_its_smallest_limit_fits(seed):
    """On random profiles (chains and skip connections) and limits: the chosen plan's memory is what
    predict_memory says for its split, within the limit; a refusal's smallest limit is then accepted."""
    import random

    from lightning_pipedream.plan.memory import predict_memory, stage_bytes

    rng = random.Random(seed)
    n = rng.randint(4, 9)
    layers = [LayerProfile(f"l{i}", rng.uniform(0.1, 2), rng.uniform(0.1, 4), rng.randint(0, 5000),
                           rng.randint(0, 5000)) for i in range(n)]
    edges = [(i, i + 1) for i in range(n - 1)] + ([(0, n - 1)] if seed % 2 else [])
    profile = Profile(layers, edges=edges, extra={"input_bytes": rng.randint(0, 3000)})
    topology = Topology.flat(rng.choice([2, 3, 4]), rng.choice([math.inf, 1e4]))
    limit = rng.randint(2000, 40000)
    kwargs = {"exact": bool(seed % 3), "optimizer": rng.choice(["sgd", "momentum", "adam"]), "max_chunks": 8}
    try:
        result = auto_plan(profile, topology, limit, **kwargs)
    except NoPlanFitsError as err:
        result = auto_plan(profile, topology, err.smallest_limit, **kwargs)
        limit = err.smallest_limit
    c = result.chosen
    expected = predict_memory(stage_bytes(profile, c.balance), c.schedule, c.chunks, replicas=c.replicas,
                              virtual_stages=c.virtual_stages, recompute=c.recompute, optimizer=kwargs["optimizer"])
    assert list(c.memory) == expected
    assert c.peak_bytes <= limit
    assert sum(c.balance) == n and sum(c.replicas) == topology.num_workers


def test_interleaved_plans_list_the_model_chunks():
    profile = Profile([LayerProfile(f"l{i}", 1.0, 2.0, 1000, 1000) for i in range(8)])
    result = auto_plan(profile, FREE, schedules=["interleaved"], optimizer="sgd", max_chunks=4)
    c = result.chosen
    assert (c.replicas, c.virtual_stages, c.balance) == ((1, 1), 2, (2, 2, 2, 2))
    assert [m.chunks for m in c.memory] == [(0, 2), (1, 3)]  # rank r holds chunks r and r + 2
    assert result.plan.balance == [2, 2, 2, 2] and result.plan.num_workers == 2
    assert result.plan.extra["virtual_stages"] == 2 and result.plan.extra["chunk_stages"] is True
    assert result.plan.simulated_time_per_minibatch() == pytest.approx(c.time_per_minibatch)
    assert "l0 .. l1 (2), l4 .. l5 (2)" in result.describe()
    assert result.strategy_arguments() == {"schedule": "interleaved", "chunks": 4, "balance": [2, 2, 2, 2],
                                           "virtual_stages": 2}


def test_unequal_replicas_run_as_1f1b_rr():
    # Layer 0: 6 s of work and 1 byte of parameters; layer 1: 3 s and 1000 bytes; 3 workers joined at 1000 B/s.
    # PipeDream's 2-1: two replicas of layer 0 take a minibatch each per 6 s and all-reduce after it (ring of two:
    # 2 x 1/2 x 1 / 1000 = 0.001 s), layer 1 one per 3 s: 6.001 / 2 s per minibatch. Three data-parallel copies take
    # 9 s per minibatch each plus a ring all-reduce of 1001 bytes after every minibatch, 2 x 2/3 x 1001 / 1000 s.
    profile = Profile([LayerProfile("a", 2.0, 4.0, 0, 1), LayerProfile("b", 1.0, 2.0, 0, 1000)])
    result = auto_plan(profile, Topology.flat(3, 1000.0), schedules=["pipedream"], optimizer="sgd")
    c = result.chosen
    assert (c.replicas, c.balance) == ((2, 1), (1, 1))
    assert result.strategy_arguments() == {"schedule": "pipedream", "chunks": 1, "balance": [1, 1], "replicas": [2, 1]}
    assert c.time_per_minibatch == pytest.approx(6.001 / 2)
    assert result.runner_up is not None and result.runner_up.replicas == (3,)
    assert result.runner_up.time_per_minibatch == pytest.approx((9 + 4 / 3 * 1.001) / 3)
    assert [m.weight_versions for m in c.memory] == [2, 1]  # ceil(3 workers / 2 replicas) minibatches in flight


def test_every_stage_has_parameters_to_train():
    # A parameter-free layer (an activation) cannot be a stage alone: it would have no optimizer.
    layers = [LayerProfile("fc1", 1.0, 2.0, 100, 1000), LayerProfile("relu", 3.0, 3.0, 100, 0),
              LayerProfile("fc2", 1.0, 2.0, 100, 1000)]
    result = auto_plan(Profile(layers), Topology.flat(3, math.inf), exact=True, optimizer="sgd")
    assert len(result.chosen.replicas) < 3  # three stages would leave relu alone
    bounds = [0, *itertools.accumulate(result.chosen.balance)]
    assert all(any(l.parameter_bytes for l in layers[a:b]) for a, b in zip(bounds, bounds[1:]))


def test_zero_bubble_defers_the_measured_weight_gradients():
    # Two layers on two workers, free links, 4 micro-batches of F = 1/4, B + W = 2/4 s. With no weight-gradient part
    # zb-h1 is 1f1b: (m + p - 1)(F + B + W) = 5 x 3/4 = 3.75 s. With W = B = 1/4 (the measured half) the bubble shrinks
    # to (p - 1)(F + B - W): m (F + B + W) + 1/4 = 3.25 s.
    def result(weight_s):
        layers = [LayerProfile(f"l{i}", 1.0, 2.0, 0, 1000, weight_s=weight_s) for i in range(2)]
        return auto_plan(Profile(layers), Topology.flat(2, math.inf), schedules=["zb-h1"], max_chunks=4,
                         optimizer="sgd").chosen

    assert result(0.0).time_per_minibatch == pytest.approx(3.75)
    assert result(1.0).time_per_minibatch == pytest.approx(3.25)
    assert result(None).time_per_minibatch == pytest.approx(3.25)  # unmeasured: half the backward


def test_vgg16_under_shrinking_limits_as_the_docs_show(pipedream_profiles):
    from lightning_pipedream.plan.profile import load_pipedream_graph

    profile = load_pipedream_graph(pipedream_profiles / "vgg16" / "graph.txt")
    topology = Topology.flat(4, 1e9)

    def plan_with(limit):
        return auto_plan(profile, topology, limit, exact=True, optimizer="momentum").chosen

    free = plan_with(None)
    assert (free.schedule, free.replicas, free.chunks) == ("1f1b", (3, 1), 16)
    assert free.time_per_minibatch == pytest.approx(0.185539, rel=1e-5)
    tight = plan_with(1.8e9)
    assert (tight.schedule, tight.replicas, tight.recompute) == ("1f1b", (1, 1, 1, 1), (True, False, True, False))
    with pytest.raises(NoPlanFitsError) as err:
        plan_with(1e9)
    assert err.value.smallest_limit == 1647034368


def test_equal_replicas_weigh_every_data_parallel_pipeline_count_and_never_unequal_replicas():
    """``replicas="equal"`` (what a traced graph's split runs): d pipelines of W/d stages for every d dividing the W
    workers (as many stages as the cuts allow), a straight pipeline the case d = 1; "none" the straight one alone;
    "any" adds PipeDream's unequal replicas."""
    from lightning_pipedream.plan.auto import replica_layouts

    eight = Profile([LayerProfile(f"l{i}", 1.0, 2.0, 1000, 1000) for i in range(8)])
    assert replica_layouts(eight, Topology.flat(4), 8, "equal") == [((1, 1, 1, 1), None), ((2, 2), None), ((4,), None)]
    assert replica_layouts(eight, Topology.flat(6), 8, "equal") == [((1,) * 6, None), ((2, 2, 2), None), ((3, 3), None),
                                                            ((6,), None)]
    assert replica_layouts(eight, Topology.flat(6), 2, "equal") == [((3, 3), None), ((6,), None)]  # only 2 stages possible
    assert replica_layouts(eight, Topology.flat(4), 8, "none") == [((1, 1, 1, 1), None)]
    # The profile whose free plan is PipeDream's 2-1 (test_unequal_replicas_run_as_1f1b_rr): equal replicas only.
    profile = Profile([LayerProfile("a", 2.0, 4.0, 0, 1), LayerProfile("b", 1.0, 2.0, 0, 1000)])
    assert ((2, 1), [1, 1]) in replica_layouts(profile, Topology.flat(3, 1000.0), 2, "any")
    result = auto_plan(profile, Topology.flat(3, 1000.0), schedules=["pipedream"], optimizer="sgd", replicas="equal")
    assert result.chosen.replicas == (3,) and result.runner_up is None  # 3 stages of 2 layers cannot be
    assert result.chosen.time_per_minibatch == pytest.approx((9 + 4 / 3 * 1.001) / 3)


@pytest.mark.parametrize("seed", range(8))
def test_equal_replicas_choose_the_fastest_equal_layout_that_fits(seed):
    """On random profiles, workers and limits: the choice under ``replicas="equal"`` is as fast as the fastest of the
    straight pipeline and every data-parallel pipeline count planned alone, equal replicas, never sharded, and the
    full search (unequal replicas too) is never slower."""
    import random

    rng = random.Random(seed)
    n = rng.randint(4, 9)
    profile = Profile([LayerProfile(f"l{i}", rng.uniform(0.1, 2), rng.uniform(0.1, 4), rng.randint(0, 5000),
                                    rng.randint(1, 5000)) for i in range(n)], extra={"input_bytes": 100})
    topology = Topology.flat(rng.choice([2, 4, 6]), rng.choice([1e4, 1e5, math.inf]))
    kwargs = {"optimizer": "sgd", "max_chunks": 4, "exact": bool(seed % 2)}
    limit = rng.choice([None, 30000.0])
    try:
        equal = auto_plan(profile, topology, limit, replicas="equal", **kwargs)
    except NoPlanFitsError:
        return
    for c in (equal.chosen, equal.runner_up):
        if c is not None:
            assert len(set(c.replicas)) == 1 and c.shard is None and sum(c.replicas) == topology.num_workers
    straight = auto_plan(profile, topology, limit, straight=True, **kwargs) if n >= topology.num_workers else None
    assert straight is None or equal.chosen.time_per_minibatch <= straight.chosen.time_per_minibatch * (1 + 1e-9)
    assert auto_plan(profile, topology, limit, **kwargs).chosen.time_per_minibatch <= (
        equal.chosen.time_per_minibatch * (1 + 1e-9))


def test_vgg16_s_free_plan_with_equal_replicas_only(pipedream_profiles):
    """VGG-16 on 4 workers: the full search's free choice is PipeDream's 3-1 (unequal, 0.186 s per minibatch: see
    above); with equal replicas only, 4 data-parallel copies, twice as slow (its classifier's weights all-reduced)."""
    from lightning_pipedream.plan.profile import load_pipedream_graph

    profile = load_pipedream_graph(pipedream_profiles / "vgg16" / "graph.txt")
    chosen = auto_plan(profile, Topology.flat(4, 1e9), exact=True, optimizer="momentum", replicas="equal").chosen
    assert (chosen.schedule, chosen.replicas, chosen.chunks) == ("1f1b", (4,), 16)
    assert chosen.time_per_minibatch == pytest.approx(0.375670, rel=1e-5)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"replicas": "some"}, "replicas='some' is not a choice: use 'any' (equal and unequal replicas), 'equal' "
                           "(data-parallel pipelines of equal length) or 'none' (one stage per worker)."),
    ({"replicas": "equal", "straight": True}, "straight=True plans one stage per worker, which replicas='equal' "
                                              "contradicts. Give one of them (straight=True is replicas='none')."),
])
def test_the_replica_choice_s_errors_say_what_to_give(kwargs, message):
    with pytest.raises(ValueError) as err:
        auto_plan(four_layers(), FREE, **kwargs)
    assert str(err.value) == message
