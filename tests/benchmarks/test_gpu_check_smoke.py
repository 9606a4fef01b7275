"""`python -m benchmarks.memory.gpu_check --device cpu --quick`: the GPU check's code paths on the CPU, its JSON and table."""

from __future__ import annotations

import importlib
import json

import pytest


def test_gpu_check_runs_every_section_on_the_cpu(tmp_path, capsys):
    check = importlib.import_module("benchmarks.memory.gpu_check")  # the repository root is on pytest's pythonpath
    memory_model = importlib.import_module("benchmarks.memory.memory_model")
    out = tmp_path / "gpu_check.json"
    check.main(["--device", "cpu", "--quick", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["torch"] and doc["date"] and "lightning" in doc
    # (a): every schedule, every stage, measured (the rank's thread's live tensors) against the CPU model
    rows = doc["memory"]
    assert not [r for r in rows + doc["executor"] if "error" in r]
    assert {(r["schedule"], r["rank"]) for r in rows} == {
        (s, rank) for s in memory_model.SCHEDULES for rank in range(memory_model.STAGES)}
    for r in rows:
        assert r["measured"]["peak_bytes"] > 0 and r["predicted"]["predicted_peak_bytes"] > 0
        assert "workspace" not in r["predicted"]  # the CPU's model: no CUDA terms
        # tiny sizes: the measured peaks sit at 0.85-1.0 of the model (benchmarks/memory/memory_model.py --quick alike)
        assert 0.7 < r["measured_over_predicted"] < 1.2, (r["schedule"], r["rank"])
    # (b): every schedule under the model of NCCL's rules, equal to one device (or to the CPU's run)
    assert {r["schedule"] for r in doc["executor"]} == set(check.SCHEDULES)
    assert all(r["equal"] and r["max_relative_difference"] <= check.TOLERANCE for r in doc["executor"])
    # (c): needs 2 GPUs, and says so
    assert doc["trainer"]["skipped"].startswith("skipped: needs 2 or more GPUs")
    printed = capsys.readouterr().out
    assert "measured / predicted: median" in printed and "max rel diff" in printed


def test_cuda_without_a_gpu_says_so():
    check = importlib.import_module("benchmarks.memory.gpu_check")
    if check.torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="torch sees no GPU here"):
        check.resolve_device("cuda")


def test_a_failing_case_is_recorded_and_the_others_still_run(monkeypatch, tmp_path):
    """A GPU's time is scarce: one case that fails is written into the JSON with its words, and the rest run."""
    check = importlib.import_module("benchmarks.memory.gpu_check")
    real = check.pipeline_weights

    def failing(schedule, *args, **kwargs):
        if schedule == "zb-h1":
            raise RuntimeError("planted")
        return real(schedule, *args, **kwargs)

    monkeypatch.setattr(check, "pipeline_weights", failing)
    doc = check.main(["--device", "cpu", "--quick", "--sections", "executor", "--json", str(tmp_path / "x.json")])
    failed = [r for r in doc["executor"] if "error" in r]
    assert [r["schedule"] for r in failed] == ["zb-h1"] and failed[0]["error"].startswith("RuntimeError: planted")
    assert len(doc["executor"]) == len(check.EXECUTOR_CASES) and doc["memory"] == []
