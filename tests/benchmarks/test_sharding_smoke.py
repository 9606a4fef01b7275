"""benchmarks/memory/sharding.py runs end to end in --quick mode: per rank, sharding halves the measured training state and
the memory model predicts every mode's live peak within 10 %."""

from __future__ import annotations

import importlib
import json

import pytest

pytestmark = pytest.mark.multiprocess  # starts 4 processes per configuration: not in the fast suite


def test_shards_hold_half_the_training_state_and_the_model_predicts_each_mode(tmp_path):
    bench = importlib.import_module("benchmarks.memory.sharding")  # the repository root is on pytest's pythonpath
    out = tmp_path / "sharding.json"
    bench.main(["--quick", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert set(doc["memory"]) == {*bench.SCHEDULES, *bench.CASES}  # 1f1b, gpipe; recompute, interleaved, zb-h1
    for schedule, rows in doc["memory"].items():
        whole = [r["measured"]["training_state_bytes_at_update"] for r in rows.get("None", [])]
        for mode, ranks in rows.items():
            assert sorted(r["measured"]["rank"] for r in ranks) == [0, 1, 2, 3]
            for r in ranks:
                assert r["ratio"] == pytest.approx(1.0, abs=0.1), (schedule, mode, r["measured"])
            if mode != "None" and whole:  # parameters, gradients and Adam's state: each rank holds half of them
                sharded = [r["measured"]["training_state_bytes_at_update"] for r in ranks]
                assert all(abs(s / w - 0.5) < 0.01 for s, w in zip(sharded, whole)), (schedule, mode, sharded)
    assert all(doc["speed"][mode]["steps_per_s_median"] > 0 for mode in ("None", "grad_op", "full", bench.UNPREFETCHED))
    assert doc["speed"]["prefetch_speedup_median"] > 0
