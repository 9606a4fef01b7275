"""`python -m lightning_pipedream plan --schedule auto --shard ...`: whole or sharded replicas, the plan saying which."""

from __future__ import annotations

import argparse
import json

from lightning_pipedream.cli import plan as cli
from lightning_pipedream.plan import LayerProfile, Plan, Profile


def _run(argv, capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    rc = cli.run(parser.parse_args(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _one_stage(tmp_path):
    """Two layers that cannot be cut apart (tests/plan/test_shard_plan.py): on 2 workers, one stage on 2 replicas."""
    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 100, 1000, grad_working_bytes=0, grad_temp_bytes=0, pending_bytes=0,
                           largest_parameter_bytes=1000) for i in range(2)]
    Profile(layers, no_cut_after=[0]).save(tmp_path / "p.json")
    return ["--profile", str(tmp_path / "p.json"), "--workers", "2", "--bandwidth", "1000", "--optimizer", "momentum",
            "--max-chunks", "4", "--schedule", "1f1b", "--exact"]


def test_shard_auto_shards_when_whole_replicas_do_not_fit_and_saves_it(tmp_path, capsys):
    argv = _one_stage(tmp_path) + ["--memory", "6000", "--shard", "auto", "--save", str(tmp_path / "plan.json")]
    rc, out, _ = _run(argv, capsys)
    assert rc == 0
    assert "sharded (grad_op): with whole replicas this configuration needs 7.81 KiB on its fullest worker" in out
    assert "replicas=[2], shard='grad_op')" in out
    assert Plan.load(tmp_path / "plan.json").shard == "grad_op"
    rc, out, _ = _run(_one_stage(tmp_path) + ["--memory", "9000", "--shard", "auto", "--json"], capsys)
    data = json.loads(out)
    assert data["shard"] is None and data["shard_note"].startswith("whole replicas: both fit")


def test_shard_without_schedule_is_refused(tmp_path, capsys):
    argv = ["--profile", str(tmp_path / "p.json"), "--workers", "2", "--bandwidth", "1e9", "--shard", "full"]
    _one_stage(tmp_path)
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == ""
    assert err == "error: --shard applies to --schedule (auto or a name) only: add --schedule auto.\n"
