"""`python -m lightning_pipedream plan`: the table, --json, --save, --shard, and errors as exit code 2."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from lightning_pipedream.cli import plan as cli
from lightning_pipedream.plan import LayerProfile, Plan, Profile


def _run(argv, capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    rc = cli.run(parser.parse_args(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture
def vgg16(pipedream_profiles):
    return str(pipedream_profiles / "vgg16" / "graph.txt")


def test_json_for_machines(vgg16, capsys):
    rc, out, _ = _run(["--pipedream-graph", vgg16, "--workers", "4", "--bandwidth", "1e9", "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert [s["replicas"] for s in data["stages"]] == [3, 1]
    assert data["stages"][0]["layers"][-1] == "node18" and data["stages"][1]["layers"][0] == "node19"
    assert data["time_per_minibatch"] == pytest.approx(0.205520896)


def test_table_for_people(vgg16, capsys):
    rc, out, _ = _run(["--pipedream-graph", vgg16, "--workers", "4,4", "--bandwidth", "1e10,1.25e9"], capsys)
    assert rc == 0
    assert "stage  layers" in out and "replicas" in out and "configuration 12-1-2-1" in out
    assert "16 workers: 4 workers at 10 GB/s, then 4 workers at 1.25 GB/s" in out
    assert "predicted time per minibatch: 67.134 ms" in out


def test_saved_profile_straight_and_save(tmp_path, capsys):
    layers = [LayerProfile(f"layer{i}", 0.01 * (i + 1), 0.02 * (i + 1), 1000, 4000) for i in range(6)]
    Profile(layers).save(tmp_path / "profile.json")
    argv = ["--profile", str(tmp_path / "profile.json"), "--workers", "3", "--bandwidth", "1e9", "--straight",
            "--save", str(tmp_path / "plan.json"), "--json"]
    rc, out, _ = _run(argv, capsys)
    assert rc == 0
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.to_json() == json.loads(out)
    assert plan.balance == [3, 2, 1] and [s.replicas for s in plan.stages] == [1, 1, 1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile", "missing.json", "--workers", "2", "--bandwidth", "1e9"], "missing.json"),
        (["--profile", "{p}", "--workers", "4,4", "--bandwidth", "1e9"], "--workers lists 2 levels but --bandwidth lists 1"),
        (["--profile", "{p}", "--workers", "9", "--bandwidth", "1e9", "--straight"],
         "9 workers but the profile has only 2 layers: without replication every worker needs its own stage"),
        (["--profile", "{p}", "--workers", "2", "--bandwidth", "1e9", "--memory", "3"], "within memory_limit=3 bytes"),
        (["--profile", "{p}", "--workers", "2", "--bandwidth", "1e9", "--free-side-sources"], "applies to --pipedream-graph only"),
        (["--profile", "{bad}", "--workers", "2", "--bandwidth", "1e9"], "is not valid JSON: line 2"),
    ],
)
def test_errors_exit_2_with_a_message(tmp_path, capsys, argv, message):
    Profile([LayerProfile("a", 1, 1, 1, 1), LayerProfile("b", 1, 1, 1, 1)]).save(tmp_path / "p.json")
    (tmp_path / "bad.json").write_text('{"layers":\n [oops]}')
    argv = [a.format(p=tmp_path / "p.json", bad=tmp_path / "bad.json") for a in argv]
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and message in err


def test_through_the_dispatcher(vgg16, capsys):
    from lightning_pipedream.__main__ import main

    assert main(["plan", "--pipedream-graph", vgg16, "--workers", "4", "--bandwidth", "1e9", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"][0]["replicas"] == 3


def test_planning_a_pipedream_graph_does_not_import_torch(pipedream_profiles):
    """Reading graph.txt and partitioning it is pure Python and numpy: torch (1.3 s to import) loads only for
    the profiler. A fresh interpreter, since this test process has torch already."""
    graph = pipedream_profiles / "gnmt16" / "graph.txt"
    code = (
        "import json, sys; import lightning_pipedream.cli.plan; from lightning_pipedream.cli import main; "
        f"rc = main(['plan', '--pipedream-graph', {str(graph)!r}, '--workers', '4,4', '--bandwidth', '1e10,1.25e9', "
        "'--json']); print(json.dumps([rc, 'torch' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rc, torch_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert json.loads(out.stdout.strip().splitlines()[0])["stages"]  # the plan was printed
    assert (rc, torch_loaded) == (0, False)


def _four_layers(tmp_path):
    """4 layers: forward 1 s, backward 2 s, 1000 bytes of activations and parameters each (tests/plan/test_auto.py)."""
    Profile([LayerProfile(f"l{i}", 1.0, 2.0, 1000, 1000, grad_working_bytes=0, grad_temp_bytes=0, pending_bytes=0,
                          largest_parameter_bytes=500) for i in range(4)]).save(tmp_path / "p.json")
    return ["--profile", str(tmp_path / "p.json"), "--workers", "2", "--bandwidth", "inf", "--optimizer", "sgd",
            "--max-chunks", "4"]


def test_auto_prints_the_plan_and_why(tmp_path, capsys):
    rc, out, _ = _run(_four_layers(tmp_path) + ["--schedule", "auto", "--exact", "--memory", "8999"], capsys)
    assert rc == 0
    assert "auto plan (exact schedules only, memory limit 8.79 KiB per worker, optimizer sgd): " in out
    assert "stage  layers" in out and "activations" in out and "peak" in out
    assert "why: the runner-up, " in out and "weighed " in out


def test_auto_json_gives_peak_bytes_and_terms_per_stage(tmp_path, capsys):
    argv = _four_layers(tmp_path) + ["--schedule", "auto", "--exact", "--memory", "4999", "--json",
                                     "--save", str(tmp_path / "plan.json")]
    rc, out, _ = _run(argv, capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["predicted_peak_bytes"] == [4750, 4750]
    stage0 = data["chosen"]["memory"][0]
    assert (stage0["parameters"], stage0["gradients"], stage0["optimizer_state"], stage0["stashed_weights"],
            stage0["activations"], stage0["replay"], stage0["recompute"]) == (2000, 2000, 0, 0, 500, 250, True)
    assert data["chosen"]["schedule"] == "1f1b" and data["chosen"]["chunks"] == 4
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.balance == [2, 2] and plan.schedule == "1f1b" and plan.extra["recompute"] == [True, False]


def test_a_named_schedule_keeps_it(tmp_path, capsys):
    rc, out, _ = _run(_four_layers(tmp_path) + ["--schedule", "gpipe", "--json"], capsys)
    assert rc == 0 and json.loads(out)["chosen"]["schedule"] == "gpipe"


def test_accumulated_gradients_are_counted_at_every_moment(tmp_path, capsys):
    """--accumulate-grad-batches N > 1 (the Trainer's): a step starts with the last one's gradients, so the model
    counts them at every moment, never less than from the first backward on (the default)."""
    plans = {}
    for n in (1, 2):
        rc, out, _ = _run(_four_layers(tmp_path) + ["--schedule", "gpipe", "--json", "--accumulate-grad-batches",
                                                    str(n)], capsys)
        assert rc == 0
        plans[n] = json.loads(out)
    assert all("before_gradients" in m for m in plans[1]["chosen"]["memory"])
    assert not any("before_gradients" in m for m in plans[2]["chosen"]["memory"])
    assert all(a <= b for a, b in zip(plans[1]["predicted_peak_bytes"], plans[2]["predicted_peak_bytes"]))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--schedule", "gpipe", "--accumulate-grad-batches", "0"],
         "error: --accumulate-grad-batches must be a whole number >= 1 (the Trainer's accumulate_grad_batches), got 0."),
        (["--accumulate-grad-batches", "4"],  # (_four_layers gives --optimizer and --max-chunks)
         "error: --optimizer, --max-chunks, --accumulate-grad-batches apply to --schedule (auto or a name) only: add "
         "--schedule auto."),
        (["--schedule", "auto", "--exact", "--memory", "4000"],
         "error: No configuration of the 4 layers on 2 workers (any split, replicas, exact schedule, micro-batches "
         "and recompute) keeps every worker within memory_limit=4000 bytes (3.91 KiB): the least any needs is 4750 "
         "bytes (4.64 KiB) per worker"),
        (["--exact"], "error: --exact, --optimizer, --max-chunks apply to --schedule (auto or a name) only: add "
         "--schedule auto."),
        (["--schedule", "auto", "--straight"], "error: --method, --straight and --cost-model choose PipeDream's "
         "partition; with --schedule the planner chooses the split itself."),
        (["--schedule", "pipedream", "--exact"], "error: exact=True admits only schedules equal to one device; "
         "pipedream is not."),
    ],
)
def test_auto_errors_exit_2(tmp_path, capsys, extra, message):
    rc, out, err = _run(_four_layers(tmp_path) + extra, capsys)
    assert rc == 2 and out == ""
    assert err.startswith(message)


def test_device_cuda_counts_what_cuda_adds(tmp_path, capsys):
    """--device cuda: the same choice's peak per worker grows by what CUDA adds (cuBLAS's workspaces alone are tens of
    MiB), and a GPU of another compute capability holds smaller ones than Hopper's."""
    base = _four_layers(tmp_path) + ["--schedule", "1f1b", "--json"]
    cpu = json.loads(_run(base, capsys)[1])["predicted_peak_bytes"]
    hopper = json.loads(_run(base + ["--device", "cuda"], capsys)[1])["predicted_peak_bytes"]
    ampere = json.loads(_run(base + ["--device", "cuda", "--cuda-capability", "8.0"], capsys)[1])["predicted_peak_bytes"]
    assert all(h > c + (32 << 20) for h, c in zip(hopper, cpu))
    assert all(c < a < h for c, a, h in zip(cpu, ampere, hopper))
    rc, out, err = _run(_four_layers(tmp_path) + ["--device", "cuda"], capsys)
    assert rc == 2 and err.startswith("error: --optimizer, --max-chunks, --device apply to --schedule (auto or a name) "
                                      "only: add --schedule auto.")


# --shard: whole or sharded replicas, the plan saying which.
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
