"""Partitioners against brute force: PipeDream's DP (both cost models, flat and two-level), min-max splits."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_pipedream.cli.plan import parse_topology
from lightning_pipedream.plan import LayerProfile, Plan, Profile, StagePlan, Topology, configuration_time, partition

# ---------------------------------------------------------------------------------------------------------
# The cost model, written out configuration by configuration (independently of the DP's tables)


def _sum(values, a, b):
    return float(sum(values[a:b + 1]))


def _pipeline_time(prof, cuts, level, topology, a, b, config, model, memory_limit):
    """Time of layers a..b as ``config`` = [(first, last, replicas, sub_config)] on level ``level``."""
    workers, band = topology.levels[level]
    within = topology.levels[level - 1][0] if level > 0 else 1
    unit = math.prod(w for w, _ in topology.levels[:level])
    compute = [l.forward_s + l.backward_s for l in prof.layers]
    params = [l.parameter_bytes for l in prof.layers]
    acts = [l.activation_bytes for l in prof.layers]
    last_layer = len(prof.layers) - 1
    allowed = prof.cut_allowed()
    time, used = 0.0, 0
    for q, (s, e, r, sub) in enumerate(config):
        if q > 0 and not allowed[s - 1]:
            return math.inf
        used += r
        if memory_limit is not None:
            stash = (math.ceil((workers - used) / r) + 1) * (_sum(acts, s, e) + _sum(params, s, e))
            if stash > memory_limit * unit:
                return math.inf
        inner = _sum(compute, s, e) if level == 0 else _pipeline_time(
            prof, cuts, level - 1, topology, s, e, sub, model, memory_limit)
        sync = 4.0 * (r - 1) * _sum(params, s, e) / (r * band)
        if model == "code":
            t = (inner + sync / (within if q == 0 else 1)) / r
            if q > 0:
                t = max(t, 2.0 * cuts[s - 1] / (band * r))
                if e < last_layer:
                    t = max(t, 2.0 * cuts[e] / (band * r))
        else:
            t = max(inner, sync) / r
            if q > 0:
                t = max(t, 2.0 * cuts[s - 1] / band)
        time = max(time, t)
    return time


def _configs(a, b, level, topology, straight):
    """Every configuration of layers a..b on all workers of ``level`` (with every configuration below)."""
    workers = topology.levels[level][0]
    count = b - a + 1
    for stages in range(1, min(count, workers) + 1):
        for inner_cuts in itertools.combinations(range(a + 1, b + 1), stages - 1):
            bounds = [a, *inner_cuts, b + 1]
            spans = [(bounds[q], bounds[q + 1] - 1) for q in range(stages)]
            for reps in _compositions(workers, stages):
                if straight and any(r > 1 for r in reps):
                    continue
                if level == 0:
                    yield [(s, e, r, None) for (s, e), r in zip(spans, reps)]
                else:
                    subs = [list(_configs(s, e, level - 1, topology, straight)) for s, e in spans]
                    for choice in itertools.product(*subs):
                        yield [(s, e, r, sub) for (s, e), r, sub in zip(spans, reps, choice)]


def _compositions(total, parts):
    for bars in itertools.combinations(range(1, total), parts - 1):
        edges = [0, *bars, total]
        yield [edges[i + 1] - edges[i] for i in range(parts)]


def brute_force(prof, topology, model, straight=False, memory_limit=None):
    cuts = prof.cut_bytes() + [0]
    top = len(topology.levels) - 1
    return min((_pipeline_time(prof, cuts, top, topology, 0, len(prof.layers) - 1, c, model, memory_limit)
                for c in _configs(0, len(prof.layers) - 1, top, topology, straight)), default=math.inf)


# ---------------------------------------------------------------------------------------------------------
# Random small profiles

@st.composite
def profiles(draw, max_layers=6):
    n = draw(st.integers(1, max_layers))
    layers = [
        # Bytes comparable to seconds x bandwidth, so that transfers and all-reduces matter as much as compute.
        LayerProfile(f"l{i}", draw(st.floats(0.0, 1.0)), draw(st.floats(0.0, 1.0)),
                     draw(st.integers(0, 1_000_000_000)), draw(st.integers(0, 1_000_000_000)))
        for i in range(n)
    ]
    edges = None
    if n > 2 and draw(st.booleans()):  # a DAG: the chain plus a few skip connections
        skips = draw(st.lists(st.tuples(st.integers(0, n - 3), st.integers(2, n - 1)), max_size=3))
        edges = sorted({(i, i + 1) for i in range(n - 1)} | {(a, b) for a, b in skips if b > a + 1})
    no_cut = draw(st.lists(st.integers(0, n - 2), max_size=2, unique=True)) if n > 1 and draw(st.booleans()) else []
    return Profile(layers, edges=edges, no_cut_after=no_cut)


FLAT = [Topology.flat(1, 1e9), Topology.flat(2, 1e9), Topology.flat(3, 2e9), Topology.flat(4, 1e9)]
NESTED = [Topology([(2, 1e10), (2, 1e9)]), Topology([(2, 4e9), (3, 5e8)]), Topology([(1, 1e9), (3, 1e9)])]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _dp_time(prof, topology, **kwargs):
    try:
        return partition(prof, topology, "pipedream", **kwargs).time_per_minibatch
    except ValueError:
        return math.inf


@SETTINGS
@given(prof=profiles(), topology=st.sampled_from(FLAT), model=st.sampled_from(["code", "paper"]),
       straight=st.booleans(), memory=st.one_of(st.none(), st.integers(500_000_000, 20_000_000_000)))
def test_flat_dp_equals_brute_force(prof, topology, model, straight, memory):
    expected = brute_force(prof, topology, model, straight, memory)
    got = _dp_time(prof, topology, cost_model=model, straight=straight, memory_limit=memory)
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("model", ["code", "paper"])
def test_flat_dp_equals_brute_force_seeded(model):
    """Uniformly random profiles (hypothesis favours small and zero values; these do not)."""
    rng = random.Random(4)
    for _ in range(250):
        n = rng.randint(2, 6)
        layers = [LayerProfile(f"l{i}", rng.random(), rng.random(), rng.randint(0, 10**9), rng.randint(0, 10**9))
                  for i in range(n)]
        prof = Profile(layers)
        topology = Topology.flat(rng.choice([3, 4]), 1e9)
        assert _dp_time(prof, topology, cost_model=model) == pytest.approx(brute_force(prof, topology, model), rel=1e-9)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prof=profiles(max_layers=5), topology=st.sampled_from(NESTED), model=st.sampled_from(["code", "paper"]),
       straight=st.booleans())
def test_two_level_dp_equals_brute_force(prof, topology, model, straight):
    expected = brute_force(prof, topology, model, straight)
    assert _dp_time(prof, topology, cost_model=model, straight=straight) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@SETTINGS
@given(prof=profiles(), topology=st.sampled_from(FLAT[1:]), model=st.sampled_from(["code", "paper"]))
def test_flat_plan_is_a_configuration_with_the_predicted_time(prof, topology, model):
    """The stages the plan lists cost what the plan predicts, cover every layer once and use every worker."""
    try:
        plan = partition(prof, topology, cost_model=model)
    except ValueError:
        return
    assert [name for s in plan.stages for name in s.layers] == prof.names
    assert plan.num_workers == topology.num_workers
    spans, start = [], 0
    for s in plan.stages:
        spans.append((start, start + len(s.layers) - 1, s.replicas, None))
        start += len(s.layers)
    cuts = prof.cut_bytes() + [0]
    time = _pipeline_time(prof, cuts, 0, topology, 0, len(prof.layers) - 1, spans, model, None)
    assert time == pytest.approx(plan.time_per_minibatch, rel=1e-9, abs=1e-12)


@SETTINGS
@given(prof=profiles(max_layers=7), parts=st.integers(1, 4), method=st.sampled_from(["time", "parameters", "uniform"]))
def test_straight_partitioners_minimise_the_largest_stage(prof, parts, method):
    n = len(prof.layers)
    possible = 1 + sum(prof.cut_allowed())
    if possible < parts:
        with pytest.raises(ValueError, match="without replication every worker needs its own stage"):
            partition(prof, Topology.flat(parts, 1e9), method)
        return
    weight = {"time": lambda l: l.forward_s + l.backward_s, "parameters": lambda l: l.parameter_bytes,
              "uniform": lambda l: 1}[method]
    w = [weight(l) for l in prof.layers]
    allowed = prof.cut_allowed()
    best = min(max(sum(w[a:b]) for a, b in zip((0, *c), (*c, n)))
               for c in itertools.combinations(range(1, n), parts - 1) if all(allowed[k - 1] for k in c))
    plan = partition(prof, Topology.flat(parts, 1e9), method)
    assert len(plan.stages) == parts and all(s.replicas == 1 for s in plan.stages)
    sizes, start = [], 0
    for count in plan.balance:
        sizes.append(sum(w[start:start + count]))
        start += count
    assert max(sizes) == pytest.approx(best, rel=1e-12, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Hand-checked cases

def _chain(*times, act=0, params=0):
    return Profile([LayerProfile(f"l{i}", t, 0.0, act, params) for i, t in enumerate(times)])


def test_time_partition_balances_a_known_chain():
    plan = partition(_chain(1, 1, 1, 1, 4, 1, 1), Topology.flat(3, math.inf), "time")
    assert plan.balance == [4, 1, 2]
    assert plan.time_per_minibatch == pytest.approx(4.0)
    assert plan.speedup_vs_one_worker == pytest.approx(10 / 4)


def test_replication_beats_a_pipeline_when_weights_are_free_to_sync():
    """No parameters, free links: data parallelism over 4 workers is 4x faster than one worker."""
    plan = partition(_chain(1, 2, 3), Topology.flat(4, 1e9))
    assert [s.replicas for s in plan.stages] == [4] and plan.time_per_minibatch == pytest.approx(1.5)


def test_cost_models_differ_as_documented():
    """One 1 s layer with 1 GB of weights replicated on 2 workers at 1 GB/s: all-reduce 4*(1/2)*1e9/1e9 = 2 s.
    PipeDream's code adds, (1 + 2)/2 = 1.5 s; the paper takes the larger, max(1, 2)/2 = 1 s."""
    prof = Profile([LayerProfile("w", 1.0, 0.0, 0, 1_000_000_000)])
    assert partition(prof, Topology.flat(2, 1e9), cost_model="code").time_per_minibatch == pytest.approx(1.5)
    assert partition(prof, Topology.flat(2, 1e9), cost_model="paper").time_per_minibatch == pytest.approx(1.0)


def test_a_cut_counts_every_crossing_output_once():
    # l0 feeds l1 and l3; cut after l1 carries l0's and l1's outputs, cut after l2 carries l0's and l2's.
    layers = [LayerProfile(f"l{i}", 1.0, 0.0, (i + 1) * 100, 0) for i in range(4)]
    prof = Profile(layers, edges=[(0, 1), (1, 2), (2, 3), (0, 3), (0, 2)])
    assert prof.cut_bytes() == [100, 300, 400]


def test_memory_limit_forces_a_pipeline():
    """Four 1 GB layers on 2 workers. Data parallelism holds 4 GB per worker; the pipeline 1+3 holds 2 GB on
    the first worker (its weights for 2 minibatches in flight) and 3 GB on the second."""
    prof = _chain(1.0, 1.0, 1.0, 1.0, params=1_000_000_000)
    free = partition(prof, Topology.flat(2, math.inf))
    assert [s.replicas for s in free.stages] == [2] and free.time_per_minibatch == pytest.approx(2.0)
    tight = partition(prof, Topology.flat(2, math.inf), memory_limit=3.5e9)
    assert tight.balance == [1, 3] and tight.time_per_minibatch == pytest.approx(3.0)
    with pytest.raises(ValueError, match="keeps every worker within memory_limit=1.5e"):
        partition(prof, Topology.flat(2, math.inf), memory_limit=1.5e9)


def test_plan_json_round_trip(tmp_path):
    plan = partition(_chain(1, 2, 3, 4, act=10), Topology.flat(2, 1e9), "pipedream", straight=True)
    data = plan.to_json()
    assert {"stages", "time_per_minibatch"} <= set(data)
    assert all({"layers", "replicas"} <= set(s) for s in data["stages"])
    plan.save(tmp_path / "plan.json")
    again = Plan.load(tmp_path / "plan.json")
    assert again == plan and again.balance == plan.balance == [3, 1]
    assert Plan.from_json(plan.to_json()) == plan
    text = plan.describe()
    assert "replicas" in text and "predicted time per minibatch" in text and "l0 .. l2 (3)" in text


def test_hand_written_plan_needs_only_layers_and_replicas():
    plan = Plan.from_json({"stages": [{"layers": ["a", "b"]}, {"layers": ["c"], "replicas": 2}]})
    assert plan.balance == [2, 1] and plan.num_workers == 3
    assert plan.stages[1] == StagePlan(["c"], 2)


# ---------------------------------------------------------------------------------------------------------
# Bad input

def test_more_workers_than_layers_without_replication():
    with pytest.raises(ValueError, match=r"5 workers but the profile has only 3 layers: without replication every "
                                         r"worker needs its own stage. Use at most 3 workers"):
        partition(_chain(1, 1, 1), Topology.flat(5, 1e9), straight=True)
    with pytest.raises(ValueError, match="Use at most 3 workers"):
        partition(_chain(1, 1, 1), Topology.flat(5, 1e9), "time")
    # With replication, spare workers replicate stages.
    assert partition(_chain(1, 1, 1), Topology.flat(5, 1e9)).num_workers == 5


def test_topology_must_match_the_processes():
    topology = Topology([(4, 1e10), (2, 1.25e9)])
    topology.check_processes(8)
    with pytest.raises(ValueError, match=r"The topology 2 x 4 has 8 workers but there are 6 processes; make the "
                                         r"product of the levels' workers equal 6"):
        topology.check_processes(6)


@pytest.mark.parametrize(
    ("workers", "bandwidth", "message"),
    [
        ("4,4", "1e9", "--workers lists 2 levels but --bandwidth lists 1"),
        ("4,x", "1e9,1e9", "--workers must be whole numbers"),
        ("4", "fast", "--bandwidth must be bytes/s"),
        ("0", "1e9", "has 0 workers; use a whole number >= 1"),
        ("2", "-1", "bandwidth -1.0; use bytes per second > 0"),
    ],
)
def test_bad_topology(workers, bandwidth, message):
    with pytest.raises(ValueError, match=message):
        parse_topology(workers, bandwidth)


def test_bad_arguments():
    prof = _chain(1, 1)
    with pytest.raises(ValueError, match="Unknown partition method 'fastest'; choose one of"):
        partition(prof, Topology.flat(2, 1e9), "fastest")
    with pytest.raises(ValueError, match="Unknown cost model 'guess'"):
        partition(prof, Topology.flat(2, 1e9), cost_model="guess")
    with pytest.raises(ValueError, match="give it a 'layers' list"):
        Plan.from_json({"stages": [{"replicas": 2}]})
    with pytest.raises(ValueError, match="replicas=0"):
        Plan.from_json({"stages": [{"layers": ["a"], "replicas": 0}]})
    with pytest.raises(ValueError, match=r"Stage 0 of the plan has unknown fields \['replica'\]"):
        Plan.from_json({"stages": [{"layers": ["a"], "replica": 2}]})
    with pytest.raises(ValueError, match=r"The plan has unknown fields \['time'\]"):
        Plan.from_json({"stages": [{"layers": ["a"]}], "time": 1.0})


def _best_with_replicas(prof, topology, replicas, model):
    """The brute force restricted to stages with exactly ``replicas`` workers each, in order."""
    cuts, n = prof.cut_bytes() + [0], len(prof.layers)
    best = math.inf
    for inner in itertools.combinations(range(1, n), len(replicas) - 1):
        bounds = [0, *inner, n]
        config = [(bounds[q], bounds[q + 1] - 1, r, None) for q, r in enumerate(replicas)]
        best = min(best, _pipeline_time(prof, cuts, 0, topology, 0, n - 1, config, model, None))
    return best


@SETTINGS
@given(prof=profiles(), topology=st.sampled_from(FLAT[1:]), model=st.sampled_from(["code", "paper"]),
       data=st.data())
def test_configuration_time_is_the_best_split_with_those_replicas(prof, topology, model, data):
    """Pricing a configuration someone else chose ("15-1") searches only the stage boundaries."""
    workers = topology.num_workers
    stages = data.draw(st.integers(1, min(workers, len(prof.layers))))
    replicas = data.draw(st.sampled_from(list(_compositions(workers, stages))))
    expected = _best_with_replicas(prof, topology, replicas, model)
    got = configuration_time(prof, topology, replicas, model)
    assert (got is None) == math.isinf(expected)
    if got is not None:
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_configuration_time_by_hand_and_its_errors():
    # compute 1, 1, 4 s (forward = backward), no parameters, free links
    prof = Profile([LayerProfile(f"l{i}", c / 2, c / 2, 0, 0) for i, c in enumerate([1, 1, 4])])
    topology = Topology.flat(3, math.inf)
    assert configuration_time(prof, topology, [1, 2]) == pytest.approx(2.0)  # max(1 + 1, 4 / 2); not max(1, 5 / 2)
    assert configuration_time(prof, topology, [2, 1]) == pytest.approx(4.0)  # layer 2 alone on one worker
    assert configuration_time(prof, topology, [3]) == pytest.approx(2.0)  # data parallelism: 6 / 3
    assert configuration_time(prof, topology, [1, 1, 1]) == partition(prof, topology, straight=True).time_per_minibatch
    with pytest.raises(ValueError, match=r"adding up to the topology's 3 workers"):
        configuration_time(prof, topology, [2, 2])
    with pytest.raises(ValueError, match=r"needs a one-level topology, got 2 levels: a configuration such as 15-1"):
        configuration_time(prof, Topology([(1, 1e9), (3, 1e9)]), [3])
