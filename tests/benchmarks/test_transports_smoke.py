"""The transports benchmark runs end to end on a tiny model and writes its JSON (the figures are not checked here)."""

from __future__ import annotations

import json

import pytest

from benchmarks.speed import transports

pytestmark = pytest.mark.multiprocess


def test_transports_benchmark_writes_every_contender(tmp_path):
    out = tmp_path / "t.json"
    transports.main(["--rounds", "1", "--steps", "1", "--width", "16", "--batch", "8", "--chunks", "2",
                     "--json", str(out)])
    result = json.loads(out.read_text())
    assert set(result["ms_per_step_median"]) == {"auto", "gloo", "directional"}
    assert result["ratio_to_gloo_median"]["gloo"] == 1.0
    assert all(t > 0 for t in result["rounds"][0].values())
