"""The plan's prediction against measured stage figures (plan/explain.py): the parts of the gap add up to it, each
part reads what it says, and a plan made again from the measured compute moves the split away from a slow stage; the
CLI's `show --trace` and `plan --from-trace` on a merged trace's metadata. The same on a real fit's figures is in
tests/strategy/test_stage_figures.py."""

from __future__ import annotations

import json

import pytest

from lightning_pipedream.cli import main
from lightning_pipedream.plan.explain import PARTS, ExplainError, Explanation, explain, measured_profile, replan
from lightning_pipedream.plan.partition import Plan, StagePlan, partition
from lightning_pipedream.plan.profile import LayerProfile, Profile
from lightning_pipedream.plan.topology import Topology

MS = 1e-3


def _planned(layers: int = 8, stages: int = 2, schedule: str = "1f1b", chunks: int = 2) -> Plan:
    """PipeDream's partition of ``layers`` equal layers (1 ms forward, 2 ms backward), with its profile kept as the
    strategy keeps it."""
    profile = Profile([LayerProfile(f"l{i}", 1 * MS, 2 * MS, 1000, 4000) for i in range(layers)], source="equal")
    plan = partition(profile, Topology.flat(stages, 1e12), "pipedream", straight=True)
    plan.schedule, plan.chunks = schedule, chunks
    plan.extra["profile"] = profile.to_json()
    return plan


def _rank(stage: int, compute: float, wait: float = 0.0, transfer: float = 0.0, update: float = 0.0,
          other: float = 0.0) -> dict[str, float]:
    return {"stage": stage, "steps": 10, "compute": compute, "wait": wait, "transfer": transfer, "update": update,
            "other": other, "step": compute + wait + transfer + update + other}


def test_a_run_as_the_simulator_predicts_leaves_only_the_schedule_s_part() -> None:
    plan = _planned()
    assert plan.balance == [4, 4] and plan.time_per_minibatch == pytest.approx(12 * MS)
    simulated = plan.simulated_time_per_minibatch()  # 1f1b, 2 micro-batches, 2 stages: 12 ms x 3/2
    assert simulated == pytest.approx(18 * MS, rel=1e-3)
    # Each stage computes what its profile says and idles the rest of the simulated step, waiting.
    ranks = [_rank(0, 12 * MS, wait=simulated - 12 * MS), _rank(1, 12 * MS, wait=simulated - 12 * MS)]
    e = explain(plan, ranks)
    assert e.parts["schedule"] == pytest.approx(simulated - 12 * MS)
    for part in ("imbalance", "communication", "update", "outside"):
        assert e.parts[part] == pytest.approx(0.0, abs=1e-9), part
    assert [s.predicted_bubble for s in e.stages] == pytest.approx([1 / 3, 1 / 3], rel=1e-3)
    assert [s.bubble for s in e.stages] == pytest.approx([1 / 3, 1 / 3], rel=1e-3)


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 2), ("gpipe", 4), ("pipedream", 1), ("zb-h1", 4)])
def test_the_parts_add_up_to_the_gap_and_name_the_slow_stage(schedule: str, chunks: int) -> None:
    plan = _planned(stages=4, schedule=schedule, chunks=chunks)
    ranks = [_rank(0, 6 * MS, 1 * MS, 2 * MS, 0.5 * MS, 4 * MS), _rank(1, 6.3 * MS, 5 * MS, 1 * MS, 0.5 * MS, 3 * MS),
             _rank(2, 14 * MS, 0.2 * MS, 1 * MS, 0.5 * MS, 3 * MS), _rank(3, 6 * MS, 9 * MS, 1 * MS, 0.7 * MS, 5 * MS)]
    e = explain(plan, ranks)
    assert sum(e.parts[p] for p in PARTS) == pytest.approx(e.gap, abs=1e-12)
    assert e.measured == max(r["step"] for r in ranks) and e.reference == 3
    assert e.slowest == 2 and e.parts["imbalance"] > 0
    assert e.parts["update"] == pytest.approx(0.7 * MS) and e.parts["outside"] == pytest.approx(5 * MS)
    table = e.table()
    assert "stage 0 1.00x, stage 1 1.05x, stage 2 2.33x, stage 3 1.00x; furthest above: stage 2" in table
    assert f"gap {e.gap * 1e3:+.1f} ms" in table
    back = Explanation.from_json(json.loads(json.dumps(e.to_json())))
    assert back.table() == table and back.parts == pytest.approx(e.parts)


def test_replicas_are_averaged_and_a_stage_without_steps_is_refused_in_words() -> None:
    plan = _planned()
    e = explain(plan, [_rank(0, 10 * MS), _rank(0, 14 * MS), _rank(1, 12 * MS)])
    assert e.stages[0].compute == pytest.approx(12 * MS)
    with pytest.raises(ExplainError, match=r"measured figures for stages \[1\]: every stage from 0 on needs"):
        explain(plan, [{**_rank(0, 0.0), "steps": 0}, _rank(1, 10 * MS)])
    with pytest.raises(ExplainError, match="the plan has 2 stages but the run measured 3"):
        explain(plan, [_rank(0, 1 * MS), _rank(1, 1 * MS), _rank(2, 1 * MS)])
    counted = Plan([StagePlan(["a"]), StagePlan(["b"])], schedule="1f1b")  # a plan of layer counts: no times
    with pytest.raises(ExplainError, match="no compute time for every stage.*no prediction to explain"):
        explain(counted, [_rank(0, 1 * MS), _rank(1, 1 * MS)])
    with pytest.raises(ExplainError, match="holds no profile of its layers.*plan again from that run's trace"):
        replan(counted, [_rank(0, 1 * MS), _rank(1, 1 * MS)])


def test_planning_again_from_a_slow_stage_moves_the_boundary_away_from_it() -> None:
    plan = _planned(layers=8)
    assert plan.balance == [4, 4]
    # Stage 0's compute measured 1.5x its profile (one of its layers is slower than the profiler saw).
    ranks = [_rank(0, 18 * MS), _rank(1, 12 * MS, wait=6 * MS)]
    scaled = measured_profile(plan, ranks)
    assert [layer.forward_s for layer in scaled.layers] == pytest.approx([1.5 * MS] * 4 + [1 * MS] * 4)
    new = replan(plan, ranks)
    assert new.balance == [3, 5]
    assert (new.schedule, new.chunks) == ("1f1b", 2)
    # Every layer of the slow stage carries its factor (the accounts time stages, not layers), l3 too when it moves:
    # 3 x 4.5 ms against 4.5 + 4 x 3 ms, where 4-4 measured 18.
    assert new.time_per_minibatch == pytest.approx(16.5 * MS)
    # The new plan keeps the scaled profile: a second rerun plans from it.
    assert Profile.from_json(new.extra["profile"]).layers[0].forward_s == pytest.approx(1.5 * MS)
    # The other way round: a slow last stage gives layers to the first.
    assert replan(plan, [_rank(0, 12 * MS, wait=6 * MS), _rank(1, 18 * MS)]).balance == [5, 3]


def _trace(tmp_path, plan: Plan | None, ranks: list[dict]) -> str:
    path = tmp_path / "pipeline_trace.json"
    path.write_text(json.dumps({"traceEvents": [], "metadata": {"measured": ranks,
                                                                "plan": None if plan is None else plan.to_json()}}))
    return str(path)


def test_plan_from_trace_and_show_trace_on_the_command_line(tmp_path, capsys) -> None:
    plan = _planned(layers=8)
    path = _trace(tmp_path, plan, [_rank(0, 18 * MS), _rank(1, 12 * MS, wait=6 * MS)])
    saved = tmp_path / "again.json"
    assert main(["plan", "--from-trace", path, "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "where the gap went (measured compute over the profile's: stage 0 1.50x, stage 1 1.00x" in out
    assert "layers per stage [4, 4] -> [3, 5]" in out
    assert Plan.load(saved).balance == [3, 5]
    assert main(["plan", "--from-trace", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["after"] == [3, 5]
    assert main(["show", "--trace", path, "--last", "0"]) == 0
    assert "time per minibatch: predicted 12.0 ms, measured 18.0 ms" in capsys.readouterr().out


def test_plan_from_trace_refuses_in_words(tmp_path, capsys) -> None:
    path = _trace(tmp_path, _planned(), [_rank(0, 18 * MS), _rank(1, 12 * MS)])
    assert main(["plan", "--from-trace", path, "--workers", "2"]) == 2
    assert ("--from-trace plans again for the run's own stages, links and schedule; --workers apply to --profile "
            "and --pipedream-graph. Drop them.") in capsys.readouterr().err
    balanced = _trace(tmp_path, None, [_rank(0, 18 * MS), _rank(1, 12 * MS)])
    assert main(["plan", "--from-trace", balanced]) == 2
    assert "holds no plan: the run split its model without one (balance=" in capsys.readouterr().err
    flight = tmp_path / "flight.json"
    flight.write_text(json.dumps({"traceEvents": []}))
    assert main(["plan", "--from-trace", str(flight)]) == 2
    assert "holds no measured stage figures: it is not a merged trace of PipeDreamStrategy(trace=...)" in \
        capsys.readouterr().err
    assert main(["plan", "--profile", str(flight)]) == 2
    assert "--workers and --bandwidth are required with --profile" in capsys.readouterr().err
