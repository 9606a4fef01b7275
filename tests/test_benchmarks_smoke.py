"""The benchmark scripts still run end to end (tiny sizes, one round): they are not tests of speed."""

from __future__ import annotations

import importlib
import json

import pytest

TINY = ["--layers", "2", "--width", "32", "--batch", "16", "--chunks", "4"]


def _load(name: str):
    return importlib.import_module(f"benchmarks.{name}")  # the repository root is on pytest's pythonpath


@pytest.mark.timeout(60)
def test_schedules_memory_and_timelines_run(tmp_path):
    schedules = _load("schedules")
    out, traces = tmp_path / "schedules.json", tmp_path / "traces"
    doc = schedules.main(TINY + ["--rounds", "1", "--steps", "2", "--warmup", "0", "--quick",
                                 "--max-wait", "0", "--wait-budget", "0",
                                 "--json", str(out), "--trace-dir", str(traces)])
    saved = json.loads(out.read_text())
    assert saved["contenders"].keys() == doc["contenders"].keys()
    contenders = saved["contenders"]
    for name in ("ours_gpipe", "ours_1f1b", "ours_pipedream", "torch_gpipe", "torch_1f1b", "one_thread", "two_threads"):
        assert contenders[name]["steps_per_s"] > 0, name
    for name in ("ours_gpipe", "ours_1f1b", "ours_pipedream"):
        assert contenders[name]["ratio_vs_torch"] > 0 and contenders[name]["speedup_vs_one_thread"] > 0
        assert contenders[name]["simulated_step_s"] > 0
    # every contender trains the same model on the same data: the flushed schedules agree on the loss
    losses = [contenders[n]["loss"] for n in ("ours_gpipe", "ours_1f1b", "torch_gpipe", "torch_1f1b", "one_thread")]
    assert max(losses) == pytest.approx(min(losses), rel=1e-4)
    assert saved["bubble"]["gpipe"]["analytic"] == pytest.approx(1 / 5)
    assert {p.name for p in traces.iterdir()} == {"real_gpipe.json", "real_1f1b.json", "real_pipedream.json"}

    timelines = _load("timelines")
    timelines.main(["--results", str(out), "--traces", str(traces), "--out", str(tmp_path / "img")])
    assert {p.name for p in (tmp_path / "img").iterdir()} == {
        f"{kind}_{s}.png" for kind in ("real", "sim2") for s in ("gpipe", "1f1b", "pipedream")
    }

    memory = _load("memory")
    cfg = schedules.Config(layers=2, width=32, batch=16, chunks=4)
    ranks = memory.measure("gpipe", cfg, steps=1, timeout=60)
    assert [r["peak_in_flight"] for r in ranks] == [4, 4]  # gpipe keeps every micro-batch
    assert all(r["peak_activation_mb"] > 0 and r["peak_rss_mb"] > 0 for r in ranks)
