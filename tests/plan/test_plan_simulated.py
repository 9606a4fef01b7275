"""Plans report the schedule simulator's prediction beside the partitioner's analytic one."""

from __future__ import annotations

import pytest

from lightning_pipedream.plan.partition import partition
from lightning_pipedream.plan.profile import LayerProfile, Profile
from lightning_pipedream.plan.topology import Topology


def profile(times: list[tuple[float, float]], activation_bytes: int = 0) -> Profile:
    return Profile([LayerProfile(f"l{i}", f, b, activation_bytes, 1000) for i, (f, b) in enumerate(times)])


def test_straight_pipeline_without_communication_matches_the_slowest_stage():
    plan = partition(profile([(1.0, 2.0)] * 4), Topology.flat(2, float("inf")), "time")
    assert plan.balance == [2, 2]
    # pipedream's steady state: one minibatch per (forward + backward) of the slowest stage
    assert plan.simulated_time_per_minibatch() == pytest.approx(6.0)
    assert plan.simulated_time_per_minibatch() == pytest.approx(plan.time_per_minibatch)
    assert "ms (schedule simulator)" in plan.describe(simulated=True)
    assert "schedule simulator" not in plan.describe()  # printing a plan does not run the simulator


def test_flushed_schedule_prediction_includes_its_bubble():
    plan = partition(profile([(1.0, 2.0)] * 4), Topology.flat(2, float("inf")), "time")
    plan.schedule, plan.chunks = "1f1b", 4
    # (m + p - 1) micro-batch slots of (f + b) / m each: 5 * 6 / 4
    assert plan.simulated_time_per_minibatch() == pytest.approx(7.5)


def test_slow_links_cost_more_in_the_simulator_than_nothing():
    fast = partition(profile([(1.0, 2.0)] * 4, activation_bytes=10**6), Topology.flat(2, 1e12), "time")
    slow = partition(profile([(1.0, 2.0)] * 4, activation_bytes=10**6), Topology.flat(2, 1e5), "time")
    assert slow.simulated_time_per_minibatch() > fast.simulated_time_per_minibatch() + 5.0
