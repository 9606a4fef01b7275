"""The benchmark scripts still run end to end (tiny sizes, one round): they are not tests of speed."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
from script_runs import run_killable

pytestmark = pytest.mark.multiprocess  # starts several processes: not in the fast suite

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--layers", "2", "--width", "32", "--batch", "16", "--chunks", "4"]


def _load(name: str):
    return importlib.import_module(f"benchmarks.{name}")  # the repository root is on pytest's pythonpath


def test_schedules_memory_and_timelines_run(tmp_path):
    """Every schedule (ours and torch's) against the machine's bound; then the timelines and the memory probe."""
    schedules = _load("speed.schedules")
    out, traces = tmp_path / "schedules.json", tmp_path / "traces"
    # every contender but the newer schedules' traced runs (their analysis is the older schedules'); 4 blocks:
    # interleaved's 4 stages each hold a Linear
    names = [n for n in schedules.contenders() if n not in {f"ours_{s}_trace" for s in schedules.NEWER}]
    # In a fresh interpreter, as it is run: its contenders fork their ranks, and a fork of a process whose OpenMP
    # threads have run (a test worker's, after other files) hangs the first time the child computes on two threads.
    args = ["--layers", "4", *TINY[2:], "--rounds", "1", "--steps", "2", "--warmup", "0", "--quick", "--max-wait", "0",
            "--wait-budget", "0", "--only", ",".join(names), "--json", str(out), "--trace-dir", str(traces)]
    proc = run_killable([sys.executable, "-m", "benchmarks.speed.schedules", *args], ROOT, 540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = json.loads(out.read_text())
    assert saved["contenders"].keys() == set(names)
    contenders = saved["contenders"]
    for name, c in contenders.items():
        assert c["steps_per_s"] > 0 and c["share_of_bound"] > 0, name
        assert c["bound"] == ("bound" if name in schedules.PER_MINIBATCH else "bound_batch"), name
        assert c["share_of_bound"] == pytest.approx(c["steps_per_s"] / contenders[c["bound"]]["steps_per_s"])
        assert all(t["main"] >= 0 for t in saved["runs"][name][0]["threads_cpu_s_per_step"]), name
    assert contenders["bound"]["share_of_bound"] == contenders["bound_batch"]["share_of_bound"] == 1
    for s in ("gpipe", "1f1b", "zb-h1", "interleaved", "zb-v", "dualpipev"):  # flushed: a share of the bubble-limited bound too
        assert contenders[f"ours_{s}"]["share_of_simulated_bound"] > 0, s
        assert contenders[f"ours_{s}"]["ratio_vs_torch_of"] == f"torch_{s}"
    for name in ("ours_gpipe", "ours_1f1b", "ours_pipedream"):
        assert contenders[name]["ratio_vs_torch"] > 0 and contenders[name]["speedup_vs_one_thread"] > 0
        assert contenders[name]["simulated_step_s"] > 0
    # where the traced pipedream run's time went, per rank: the parts add up to the timed interval
    breakdown = saved["runs"]["ours_pipedream_trace"][0]["breakdown_s_per_step"]
    assert len(breakdown) == 2 and breakdown[0]["stash_copy"] > 0 and breakdown[1]["forward"] > 0
    # every contender trains the same model on the same data: the flushed schedules agree on the loss
    flushed = ["ours_gpipe", "ours_1f1b", "ours_zb-h1", "ours_interleaved", "ours_zb-v", "ours_dualpipev", "torch_gpipe",
               "torch_1f1b", "torch_zb-h1", "torch_interleaved", "torch_zb-v", "torch_dualpipev", "one_thread"]
    losses = [contenders[n]["loss"] for n in flushed]
    assert max(losses) == pytest.approx(min(losses), rel=1e-4)
    assert saved["bubble"]["gpipe"]["analytic"] == pytest.approx(1 / 5)
    assert {p.name for p in traces.iterdir()} == {"real_gpipe.json", "real_1f1b.json", "real_pipedream.json"}
    tiny = schedules.Config(layers=4, width=32, batch=16, chunks=4)  # the newer schedules' theory, at these sizes
    schedule_traces = _load("speed.schedule_traces")  # the traces' analysis, beside benchmarks.speed.schedules
    assert schedule_traces.analytic_bubble("interleaved", tiny, {}) == pytest.approx(0.5 / 4.5)
    assert schedule_traces.analytic_bubble("zb-h1", tiny, {"F": [1.0], "B": [1.0], "W": [1.0]}) == pytest.approx(1 / 13)

    timelines = _load("speed.timelines")
    timelines.main(["--results", str(out), "--traces", str(traces), "--out", str(tmp_path / "img")])
    assert {p.name for p in (tmp_path / "img").iterdir()} == {
        f"{kind}_{s}.png" for kind in ("real", "sim2") for s in ("gpipe", "1f1b", "pipedream")
    }

    memory = _load("memory.peaks")
    cfg = schedules.Config(layers=2, width=32, batch=16, chunks=4)
    ranks = memory.measure("gpipe", cfg, steps=1, timeout=60)
    assert [r["peak_in_flight"] for r in ranks] == [4, 4]  # gpipe keeps every micro-batch
    assert all(r["peak_activation_mb"] > 0 and r["peak_rss_mb"] > 0 for r in ranks)


def test_schedules_parts_run_on_three_stages():
    """--stages N: the link probe (which paired rank r with 1 - r and hung from 3 ranks on) and the bound on 3
    processes; the one-process contender takes as many threads. (No capsys here: a forked rank's faulthandler needs
    the real stderr.)"""
    from lightning_pipedream.runtime.faults.launch import run_local

    workload, schedules = _load("common.workload"), _load("speed.schedules")
    cfg = workload.Config(layers=3, width=32, batch=16, chunks=4, stages=3)
    link = run_local(workload.link_worker, 3, cfg, 2, timeout=60)
    assert link[0]["latency_s"] > 0 and link[0]["bandwidth_Bps"] > 0 and link[1:] == [None, None]
    bound = run_local(workload.bound_worker, 3, cfg, False, 0, 1, timeout=60)
    assert len(bound) == 3 and all(r["op_mean_s"]["F"] > 0 for r in bound)
    names = schedules.contenders(stages=3)
    assert "threads_3" in names and "two_threads" not in names and "two_threads" in schedules.contenders()


def test_schedules_on_three_stages_ask_interleaved_for_a_layer_per_model_chunk(capsys):
    schedules = _load("speed.schedules")
    with pytest.raises(SystemExit):  # interleaved on 3 processes holds 6 model chunks: 3 layers are too few
        schedules.main(["--stages", "3", "--layers", "3", "--json", ""])
    assert "--layers must be at least 6" in capsys.readouterr().err


def test_lightning_quick_runs(tmp_path):
    """`python -m benchmarks.speed.lightning --quick`: every contender trains on the same samples, with the same updates
    as the contenders it is compared with, and the JSON holds the ratios the docs quote."""
    lightning = _load("speed.lightning")
    out = tmp_path / "lightning.json"
    doc = lightning.main(["--quick", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved.keys() == doc.keys() == {"config", "machine", "contenders", "seconds"}
    assert len(saved["machine"]["loadavg_start"]) == 3 and saved["machine"]["loadavg_1m_during"]["max"] >= 0
    contenders = saved["contenders"]
    assert contenders.keys() == set(lightning.CONTENDERS)
    for name, c in contenders.items():
        assert c["seconds_per_step"] > 0, name
        assert all(len(pair) == 2 for pair in c["loadavg_1m"]), name
        assert len(set(c["updates_per_rank"])) == 1, name  # every rank (stage or replica) stepped as often
    assert len({c["samples"] for c in contenders.values()}) == 1  # the same samples for all
    cfg = saved["config"]
    batches = cfg["warmup_batches_of_512"] + cfg["timed_batches_of_512"]
    for name in ("one_device_64", "ddp", "pipedream", lightning.PER_BATCH, "engine_pipedream", "bound_64"):
        assert contenders[name]["updates"] == batches * cfg["chunks"], name  # one update per minibatch
        assert contenders[name]["bound"] == "bound_64", name
    # minibatches_per_batch: Lightning steps of a whole batch, its figures per minibatch as the others'
    assert contenders[lightning.PER_BATCH]["timed_steps"] == contenders["pipedream"]["timed_steps"]
    for name in ("one_device_512", "gpipe", "1f1b", "engine_gpipe", "engine_1f1b", "bound_512"):  # one per batch
        assert contenders[name]["updates"] == batches, name
        assert contenders[name]["bound"] == "bound_512", name
    for name, c in contenders.items():  # the share of the machine's bound doing the same updates
        bound = contenders[c["bound"]]
        assert c["share_of_bound"] == pytest.approx(bound["seconds_per_step"] / c["seconds_per_step"]), name
        assert all("main" in threads for threads in c["threads_cpu_s_per_step"]), name
    # the traced pipedream run's time per rank: the executor's actions and the rest (Lightning, the strategy)
    for parts in contenders["pipedream"]["breakdown_s_per_step"]:
        assert parts["forward"] > 0 and parts["backward"] > 0 and parts["between_actions"] > 0
    for name in lightning.LIGHTNING:
        assert contenders[name]["speedup_vs_one_device"] > 0 and contenders[name]["speedup_vs_ddp"] > 0
    for name in ("gpipe", "1f1b", "pipedream"):
        assert contenders[name]["strategy_over_engine"] > 0
    lightning.main(["--json", str(out), "--plot", str(tmp_path / "lightning.png")])
    assert (tmp_path / "lightning.png").stat().st_size > 0


def test_replication_quick_runs(tmp_path):
    """`python -m benchmarks.paper.replication --quick`: the planner's plans and predictions are recorded, the hybrid (2-1),
    straight and DDP runs on 3 processes do the same updates and end with one-process training's weights."""
    replication = _load("paper.replication")
    out = tmp_path / "replication.json"
    replication.main(["--quick", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["plans"]["3"]["replicated"]["time_per_minibatch_s"] > 0
    assert saved["plans"]["3"]["straight"]["configuration"] == "1-1-1"
    contenders = saved["contenders"]
    assert contenders.keys() == {"ddp3", "hybrid3", "straight3"}
    batches = saved["config"]["warmup_batches"] + saved["config"]["timed_batches"]
    for name, c in contenders.items():
        assert c["seconds_per_step"] > 0 and c["predicted_samples_per_s"] > 0, name
        assert c["updates_per_rank"] == [batches] * 3, name  # every stage, replica and DDP rank: one update per batch
        assert c["weights_agree"] and c["max_abs_diff_vs_one_process"] <= replication.TOLERANCE, name
    assert contenders["ddp3"]["per_process_batch"] * 3 == contenders["hybrid3"]["per_process_batch"]
    ranking = saved["ranking"]["3"]
    assert sorted(ranking["measured"]) == sorted(ranking["predicted"]) == ["ddp3", "hybrid3", "straight3"]
    replication.main(["--json", str(out), "--plot", str(tmp_path / "replication.png")])
    assert (tmp_path / "replication.png").stat().st_size > 0
