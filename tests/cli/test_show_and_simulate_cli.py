"""`python -m lightning_pipedream show|simulate`: output, files, and the errors for bad input."""

from __future__ import annotations

import argparse
import json
import sys
import types
from types import SimpleNamespace

import pytest

from lightning_pipedream.cli import show as cli_show
from lightning_pipedream.cli import simulate as cli_simulate
from lightning_pipedream.schedule.builders import build_schedule
from lightning_pipedream.schedule.check import render_grid
from lightning_pipedream.schedule.timeline import from_chrome_trace


def _run(module, argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog=module.__name__.rsplit("_", 1)[-1])
    module.add_arguments(parser)
    try:
        rc = module.run(parser.parse_args(argv))
    except SystemExit as exit_:  # argparse rejects the input
        rc = exit_.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_show_prints_the_validated_grid(capsys):
    rc, out, _ = _run(cli_show, ["--schedule", "gpipe", "--stages", "3", "--chunks", "4"], capsys)
    assert rc == 0
    assert render_grid(build_schedule("gpipe", 3, 4)) in out
    assert "   9  B1      B2      B3+O" in out
    assert out.rstrip().endswith("no rank waits forever")


def test_show_actions(capsys):
    rc, out, _ = _run(cli_show, ["--schedule", "1f1b", "--stages", "2", "--chunks", "2", "--actions"], capsys)
    assert rc == 0
    assert "rank 1: RA0@0 F0 B0 SG0@0 RA1@0 F1 B1 SG1@0 O" in out


def test_simulate_text(capsys):
    rc, out, _ = _run(cli_simulate, ["--schedule", "1f1b", "--stages", "4", "--chunks", "8"], capsys)
    assert rc == 0
    assert "step time         33 s" in out  # (8 + 4 - 1) x (1 + 2)
    assert "bubble fraction   0.2727   (analytic (p-1)/(m+p-1) = 0.2727" in out
    assert "peak activations  4 3 2 1" in out


def test_simulate_pipedream_reports_steady_state_and_makespan(capsys):
    argv = ["--schedule", "pipedream", "--stages", "4", "--minibatches", "8", "--forward", "1,1,2,1", "--backward", "2"]
    rc, out, _ = _run(cli_simulate, argv, capsys)
    assert rc == 0
    assert "step time         4 s per minibatch (steady state)" in out  # the slowest stage: 2 + 2
    assert "makespan" in out and "analytic" not in out


def test_simulate_json_plot_and_trace(tmp_path, capsys):
    plot, trace = tmp_path / "t.png", tmp_path / "t.json"
    argv = ["--schedule", "gpipe", "--stages", "2", "--chunks", "3", "--latency", "0.5", "--json",
            "--activation-bytes", "1e6", "--bandwidth", "1e6", "--plot", str(plot), "--trace", str(trace)]
    rc, out, _ = _run(cli_simulate, argv, capsys)
    assert rc == 0
    data = json.loads(out)
    # (3 + 2 - 1) x 3 s, plus 1 s transfer and 0.5 s latency on the way there and back.
    assert data["makespan"] == pytest.approx(12 + 2 * 1.5)
    assert data["analytic_bubble_fraction"] == pytest.approx(1 / 4)
    assert data["peak_activations"] == [3, 3]
    assert plot.read_bytes()[:4] == b"\x89PNG"
    events = from_chrome_trace(json.loads(trace.read_text()))
    assert max(e.end for e in events) == pytest.approx(data["makespan"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schedule", "foo"], "argument --schedule: invalid choice: 'foo' (choose from"),
        (["--stages", "0"], "argument --stages: must be a whole number >= 1 (the number of pipeline stages), got '0'"),
        (["--chunks", "-2"], "argument --chunks: must be a whole number >= 1 (micro-batches per training step"),
        (["--chunks", "two"], "argument --chunks: must be a whole number >= 1"),
    ],
)
@pytest.mark.parametrize("module", [cli_show, cli_simulate])
def test_bad_schedule_arguments(module, argv, message, capsys):
    rc, _, err = _run(module, argv, capsys)
    assert rc == 2
    assert message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stages", "4", "--forward", "1,2"], "--forward has 2 values but the schedule has 4 stages; give one value for all stages or one per stage"),
        (["--backward", "x"], "argument --backward: expected a number or comma-separated numbers such as 1.0,2.5, got 'x'"),
        (["--forward", "-1"], "argument --forward: must be >= 0"),
        (["--bandwidth", "0"], "argument --bandwidth: must be a number > 0 (bytes per second; 'inf' for free links)"),
        (["--latency", "-1"], "--latency and --optimizer are seconds and must be >= 0"),
        (["--balance", "2,2"], "--balance splits the layers of a --profile; give --profile too, or drop --balance"),
    ],
)
def test_bad_cost_arguments(argv, message, capsys):
    rc, _, err = _run(cli_simulate, argv, capsys)
    assert rc == 2
    assert message in err


@pytest.fixture
def fake_profile(monkeypatch):
    """A stand-in for plan/profile.py: five layers, loaded from any path but 'missing.json'."""
    layers = [SimpleNamespace(forward_s=f, backward_s=2 * f, activation_bytes=100.0 * (i + 1))
              for i, f in enumerate([1.0, 2.0, 3.0, 4.0, 5.0])]

    class Profile:
        @staticmethod
        def load(path):
            if str(path).endswith("missing.json"):
                raise FileNotFoundError(f"No such file: {path}")
            return SimpleNamespace(layers=layers)

    module = types.ModuleType("lightning_pipedream.plan.profile")
    module.Profile = Profile
    monkeypatch.setitem(sys.modules, "lightning_pipedream.plan.profile", module)


def test_profile_with_balance(fake_profile, capsys):
    argv = ["--schedule", "pipedream", "--stages", "2", "--minibatches", "6", "--profile", "p.json", "--balance", "3,2", "--json"]
    rc, out, _ = _run(cli_simulate, argv, capsys)
    assert rc == 0, out
    data = json.loads(out)
    assert data["forward_s"] == [6.0, 9.0] and data["backward_s"] == [12.0, 18.0]
    assert data["activation_bytes"] == [300.0, 500.0]  # the output of each stage's last layer
    assert data["step_time"] == pytest.approx(27.0)  # slowest stage: 9 + 18


def test_profile_equal_split_scaled_to_micro_batches(fake_profile, capsys):
    argv = ["--schedule", "gpipe", "--stages", "2", "--chunks", "4", "--profile", "p.json"]
    rc, out, _ = _run(cli_simulate, argv, capsys)
    assert rc == 0
    assert "forward s:  1.5, 2.25" in out  # layers 3 + 2 -> 6 s and 9 s per batch, / 4 micro-batches
    assert "layers per stage 3,2; batch times split over 4 micro-batches" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile", "missing.json"], "could not read the profile missing.json: No such file"),
        (["--profile", "p.json", "--forward", "1"], "give either --profile or --forward/--backward/--activation-bytes, not both"),
        (["--profile", "p.json", "--stages", "2", "--balance", "1,1"], "must be counts >= 1 adding up to the profile's 5 layers"),
        (["--profile", "p.json", "--stages", "3", "--balance", "4,1"], "--balance lists 2 stages but --stages is 3"),
        (["--profile", "p.json", "--stages", "2", "--balance", "a,b"], "--balance must be whole numbers separated by commas"),
        (["--profile", "p.json", "--stages", "6"], "the profile has 5 layers, fewer than --stages 6; use at most 5 stages"),
    ],
)
def test_bad_profile_arguments(fake_profile, argv, message, capsys):
    rc, _, err = _run(cli_simulate, argv, capsys)
    assert rc == 2
    assert message in err


def test_through_the_dispatcher(capsys):
    from lightning_pipedream.__main__ import main

    assert main(["show", "--schedule", "gpipe", "--stages", "3", "--chunks", "4"]) == 0
    assert "B3+O" in capsys.readouterr().out
    assert main(["simulate", "--schedule", "gpipe", "--stages", "3", "--chunks", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] == pytest.approx(18.0)


def test_show_and_simulate_the_newer_schedules(capsys):
    rc, out, _ = _run(cli_show, ["--schedule", "zb-h1", "--stages", "3", "--chunks", "3"], capsys)
    assert rc == 0 and render_grid(build_schedule("zb-h1", 3, 3)) in out and "W3 = its weight-gradient half" in out
    rc, out, _ = _run(cli_show, ["--schedule", "interleaved", "--stages", "2", "--chunks", "4", "--virtual-stages",
                                 "3"], capsys)
    assert rc == 0 and "interleaved schedule, 2 ranks x 3 model chunks (6 stages) x 4 micro-batches" in out
    assert render_grid(build_schedule("interleaved", 2, 4, virtual_stages=3)) in out
    rc, out, _ = _run(cli_show, ["--schedule", "2bw", "--stages", "2", "--chunks", "2", "--minibatches", "3"], capsys)
    assert rc == 0 and render_grid(build_schedule("2bw", 2, 2, minibatches=3)) in out
    rc, out, _ = _run(cli_simulate, ["--schedule", "zb-h1", "--stages", "4", "--chunks", "8"], capsys)
    assert "step time         27 s" in out  # 8 x (1 + 2) + 3 x (1 + 1 - 1)
    assert "bubble fraction   0.1111   (analytic (p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W)) = 0.1111" in out
    rc, out, _ = _run(cli_simulate, ["--schedule", "interleaved", "--stages", "4", "--chunks", "8"], capsys)
    assert "step time         28.5 s" in out and "((p-1)/v)/(m+(p-1)/v) = 0.1579" in out  # v = 2 by default
    rc, out, _ = _run(cli_simulate, ["--schedule", "2bw", "--stages", "4", "--chunks", "4"], capsys)
    assert "step time         12 s per minibatch (steady state)" in out
    rc, out, _ = _run(cli_simulate, ["--schedule", "1f1b", "--stages", "4", "--chunks", "8", "--recompute"], capsys)
    assert "step time         44 s" in out and "with recompute only their stage inputs" in out  # 11 x (1 + 3)


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        (cli_show, ["--schedule", "1f1b", "--virtual-stages", "2"], "--virtual-stages applies to --schedule interleaved"),
        (cli_show, ["--schedule", "zb-h1", "--minibatches", "2"], "--minibatches applies to --schedule pipedream and 2bw"),
        (cli_simulate, ["--schedule", "1f1b", "--weight", "1"], "--weight times the split backward of zb-h1; 1f1b runs"),
        (cli_simulate, ["--schedule", "zb-h1", "--weight", "3"], "--weight 3,3,3,3 must not exceed the backward's seconds"),
    ],
)
def test_bad_arguments_of_the_newer_schedules(module, argv, message, capsys):
    rc, _, err = _run(module, argv, capsys)
    assert rc == 2 and message in err
