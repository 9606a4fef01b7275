"""What a pipeline run tells its user: every stage's time, bubble and memory in Lightning's loggers (CSVLogger read
back after real multi-process fits), the actions under Trainer(profiler="pytorch"), and a logger that refuses the
names not stopping training."""

from __future__ import annotations

import csv
import glob
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.script_runs import run_script

from lightning_pipedream.cli import main
from lightning_pipedream.plan.explain import PARTS as EXPLAINED_PARTS
from lightning_pipedream.plan.explain import explain, from_trace
from lightning_pipedream.runtime.execution.accounts import PARTS, StepAccounts
from lightning_pipedream.schedule.actions import Action, Op
from lightning_pipedream.schedule.timeline import from_chrome_trace
from lightning_pipedream.strategy.reporting.stage_figures import check_trace_dir

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "figures_trainer.py"


def _rows(out: Path) -> list[dict[str, float]]:
    with open(out / "csv" / "version_0" / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def _figure_rows(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [row for row in rows if "pipeline/bubble" in row]


def _launch(tmp_path: Path, name: str, runs: list[tuple[str, dict]]) -> dict[str, Path]:
    outs = {case: tmp_path / case for case, _ in runs}
    plan = tmp_path / f"{name}.json"
    plan.write_text(json.dumps([[str(outs[case]), options] for case, options in runs]))
    run_script(SCRIPT, tmp_path / name, {"--runs": str(plan)}, timeout=600)
    return outs


def _check_every_stage(rows: list[dict[str, float]], stages: int) -> None:
    figures = _figure_rows(rows)
    assert len(figures) >= 3, rows
    for row in figures:
        for k in range(stages):
            prefix = f"pipeline/stage{k}/"
            for part in (*PARTS, "step"):
                assert prefix + f"{part}_ms" in row, (k, part, sorted(row))
            parts = sum(row[prefix + f"{part}_ms"] for part in PARTS)
            assert parts == pytest.approx(row[prefix + "step_ms"], rel=0.01)
            # The measured parts never exceed the step: "other" (Lightning, data) is what they leave.
            for part in PARTS:
                assert row[prefix + f"{part}_ms"] >= -1e-6, (part, row)
            assert row[prefix + "compute_ms"] > 0 and row[prefix + "peak_memory_mb"] > 0
        assert 0.0 <= row["pipeline/bubble"] < 1.0
        assert 0.0 < row["pipeline/bubble_simulated"] < 1.0


def _check_predicted_memory(rows: list[dict[str, float]], stages: int) -> None:
    """The memory model's prediction beside every stage's measured peak, for a Sequential the strategy profiled. On
    the CPU the measured peak is the process's resident set (interpreter, torch, Lightning: hundreds of MB) and the
    prediction counts the model's tensors alone (weights, momentum, activations in flight: 10.5 and 9.5 KiB for these
    layers). Measured on this machine (2 CPU processes, 2026-11-29) the peaks were 834 and 831 MB, 81,000 and 89,000
    times the predictions: no factor a CPU run could hold to says anything about the model, so the test asserts only
    that every stage's prediction is logged, positive and under its peak. (On CUDA both count allocated tensors.)"""
    for row in _figure_rows(rows):
        for k in range(stages):
            predicted = row[f"pipeline/stage{k}/predicted_memory_mb"]
            assert 0 < predicted < row[f"pipeline/stage{k}/peak_memory_mb"], (k, row)


def _check_live_memory(out: Path, stages: int, tolerance: float) -> None:
    """With trace_memory=True (the whole fit traced), every stage's live tensor peak beside the prediction: in every
    logged row, within ``tolerance`` bytes of it, and the fit's peak in the merged trace's metadata and the
    explanation."""
    for row in _figure_rows(_rows(out)):
        for k in range(stages):
            live = row[f"pipeline/stage{k}/peak_live_mb"] * 2**20
            predicted = row[f"pipeline/stage{k}/predicted_memory_mb"] * 2**20
            assert abs(live - predicted) <= tolerance, (k, live, predicted)
    measured = json.loads((out / "trace" / "pipeline_trace.json").read_text())["metadata"]["measured"]
    explained = json.loads((out / "explanation.json").read_text())["stages"]
    for m in measured:
        assert abs(m["peak_live_bytes"] - m["predicted_memory_bytes"]) <= tolerance, m
        assert explained[m["stage"]]["live_peak"] == m["peak_live_bytes"]


# Six layers that sleep 0.25 ms per sample forward (0.5 backward); layer 1 sleeps 2 ms more per sample from the train
# start on, after the strategy profiled them: its stage computes about twice what its profile says.
SLEEPY = {"layers": 6, "per_sample_s": 0.00025, "slow_layer": 1, "extra_s": 0.002}


def test_two_stage_figures_in_csv_logger_and_off(tmp_path: Path, capsys) -> None:
    outs = _launch(tmp_path, "two", [
        ("on", {"devices": 2, "schedule": "1f1b", "epochs": 2, "progress_bar": True}),
        ("off", {"devices": 2, "schedule": "gpipe", "epochs": 2, "log_figures": False, "progress_bar": True}),
        ("planned", {"devices": 2, "schedule": "1f1b", "epochs": 2, "trace": "trace", "sleepy": SLEEPY,
                     "trace_memory": True}),
    ])
    _check_explained_and_planned_again(outs["planned"], capsys)
    _check_predicted_memory(_rows(outs["planned"]), 2)
    # What the memory model leaves out: the messages in flight (each the flat copy of a boundary tensor of 4 samples x
    # 16 floats after a 64-byte header; the model counts the tensor where a stage keeps it, not the transport's copy),
    # at most one per micro-batch of the step (2); and what it times differently: the model adds a backward's working
    # set to all the stage's activations, where autograd frees a layer's as it goes (under the same bound here).
    # Measured on this machine: stage 0 208 B above its 10.50 KiB, stage 1 160 B below its 9.55 KiB.
    _check_live_memory(outs["planned"], 2, tolerance=2 * (64 + 4 * 16 * 4))
    rows = _rows(outs["on"])
    _check_every_stage(rows, 2)
    # balance= without a profile: no activation sizes, so no prediction (rank 0's log says why).
    assert not any(k.endswith("predicted_memory_mb") for row in rows for k in row)
    # One row per logging interval, at the interval's last step (log_every_n_steps=3, 12 batches per epoch).
    steps = sorted(int(row["step"]) for row in _figure_rows(rows))
    assert steps[:4] == [2, 5, 8, 11]
    # Under 1f1b with 2 micro-batches, stage 1 waits for stage 0's first forward every step.
    assert sum(row["pipeline/stage1/wait_ms"] for row in _figure_rows(rows)) > 0
    assert not any(k.startswith("pipeline/stage") for row in _rows(outs["off"]) for k in row)
    assert any("train_loss" in row for row in _rows(outs["off"]))
    # The progress bar shows the measured bubble beside the module's own figures (train_loss is logged with
    # prog_bar=True), while training: from the first interval's figures on, each a logged interval's
    # (log_every_n_steps=3: intervals end at steps 2, 5, 8, ...; the figures of the others arrive a step or so
    # later). log_figures=False leaves it out.
    rank0 = json.loads((outs["on"] / "rank0.json").read_text())
    logged = [row["pipeline/bubble"] for row in _figure_rows(rows)]
    seen = [b for b in rank0["bubbles"] if b is not None]
    assert len(seen) >= len(rank0["bubbles"]) // 2, rank0["bubbles"]  # figures arrive while training, not at the end
    assert all(any(b == pytest.approx(v) for v in logged) for b in seen + [rank0["progress_bar"]["bubble"]])
    assert "train_loss" in rank0["progress_bar"]
    rank0_off = json.loads((outs["off"] / "rank0.json").read_text())
    assert "bubble" not in rank0_off["progress_bar"] and "train_loss" in rank0_off["progress_bar"]
    assert not any(rank0_off["bubbles"])


def test_three_stages_asynchronous_broken_logger_and_profiler(tmp_path: Path) -> None:
    outs = _launch(tmp_path, "three", [
        ("pipedream", {"devices": 3, "schedule": "pipedream", "epochs": 2, "logger": "broken", "trace": "trace",
                       "trace_steps": [20, 10], "trace_memory": True}),
        ("profiled", {"devices": 3, "schedule": "1f1b", "epochs": 1, "profiler": "pytorch", "trace": "trace"}),
    ])
    # pipedream: the figures travel without a collective at a batch boundary; a logger that refuses their names
    # (it sits first in the Trainer's list) is left out with a warning, the CSVLogger after it still gets them.
    _check_every_stage(_rows(outs["pipedream"]), 3)
    _check_every_stage(_rows(outs["profiled"]), 3)
    # Under Trainer(profiler="pytorch") every rank's Kineto trace names the pipeline's actions.
    for rank in range(3):
        (trace,) = glob.glob(str(outs["profiled"] / f"fit-prof-{rank}-*training_step*.json"))
        names = {event.get("name") for event in json.load(open(trace))["traceEvents"]}
        assert {"pipeline/F0", "pipeline/B0"} <= names, sorted(n for n in names if str(n).startswith("pipeline"))
    names = {event.get("name") for event in json.load(open(glob.glob(
        str(outs["profiled"] / "fit-prof-1-*training_step*.json"))[0]))["traceEvents"]}
    assert {"pipeline/RA0@0", "pipeline/SA0@2", "pipeline/RG0@2", "pipeline/O"} <= names
    _check_merged_trace(outs["profiled"] / "trace", steps=12)
    # A window that goes past the run's 24 steps: its 4 steps are there, and the trace says so.
    merged = json.loads((outs["pipedream"] / "trace" / "pipeline_trace.json").read_text())
    assert merged["metadata"]["steps"] == 4
    assert "fit ran 24 training steps: the trace holds 4 of them" in merged["metadata"]["notes"][0]
    check = merged["metadata"]["clock_check"]
    assert check["messages"] > 0 and check["receives_before_their_send"] == 0
    assert {e.rank for e in from_chrome_trace(merged)} == {0, 1, 2}
    # trace_memory=True over the window (steps 20-23; metered from step 18, pipedream's 2 steps of lead): every
    # stage's live tensor peak is logged from the interval that holds step 20 on, and kept in the trace.
    for row in _figure_rows(_rows(outs["pipedream"])):
        for k in range(3):
            assert (f"pipeline/stage{k}/peak_live_mb" in row) == (row["step"] >= 20), (k, row)
            assert row.get(f"pipeline/stage{k}/peak_live_mb", 1.0) > 0
    assert all(m["peak_live_bytes"] > 0 for m in merged["metadata"]["measured"])


def _check_explained_and_planned_again(out: Path, capsys) -> None:
    """A planned fit's explanation (the strategy's, at the fit's end) adds up to its gap on the measured figures and
    names the stage of the slow layer; `show --trace` gives the same from the merged trace, and `plan --from-trace`
    takes layers away from that stage."""
    _check_every_stage(_rows(out), 2)
    explanation = json.loads((out / "explanation.json").read_text())
    parts = explanation["parts_s"]
    assert sorted(parts) == sorted(EXPLAINED_PARTS)
    assert sum(parts.values()) == pytest.approx(explanation["gap_s"], rel=1e-9, abs=1e-12)
    assert explanation["measured_s"] - explanation["predicted_s"] == pytest.approx(explanation["gap_s"])
    trace_path = out / "trace" / "pipeline_trace.json"
    plan, measured = from_trace(json.loads(trace_path.read_text()))
    slow_stage = next(k for k, stage in enumerate(plan.stages) if str(SLEEPY["slow_layer"]) in stage.layers)
    assert explanation["slowest_stage"] == slow_stage, explanation
    # The traced steps timed each layer's forward: the slow layer's is the longest of its stage's.
    forwards = next(m["layer_forward"] for m in measured if m["stage"] == slow_stage)
    assert sorted(forwards) == sorted(plan.stages[slow_stage].layers)
    assert max(forwards, key=forwards.get) == str(SLEEPY["slow_layer"]), forwards
    again = explain(plan, measured)
    assert again.gap == pytest.approx(explanation["gap_s"]) and again.parts == pytest.approx(parts)
    assert main(["show", "--trace", str(trace_path), "--last", "0"]) == 0
    assert f"furthest above: stage {slow_stage})" in capsys.readouterr().out
    assert main(["plan", "--from-trace", str(trace_path), "--json"]) == 0
    replanned = json.loads(capsys.readouterr().out)
    assert replanned["after"][slow_stage] < replanned["before"][slow_stage], replanned


def _check_merged_trace(trace_dir: Path, steps: int) -> None:
    """One file for the whole pipeline: a process per stage with its lanes, every receive ending after its send began
    (the clocks aligned), an arrow per message, and the predicted track."""
    assert sorted(p.name for p in trace_dir.iterdir()) == ["pipeline_trace.json"]
    merged = json.loads((trace_dir / "pipeline_trace.json").read_text())
    events = merged["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert [names[r] for r in range(3)] == [f"stage {r} (rank {r})" for r in range(3)]
    assert sorted(n for n in names.values() if n.startswith("predicted")) == [f"predicted: stage {r}" for r in range(3)]
    lanes = {(e["pid"], e["args"]["name"]) for e in events if e.get("name") == "thread_name"}
    assert {(r, lane) for r in range(3) for lane in ("compute", "send", "receive", "waiting")} <= lanes
    check = merged["metadata"]["clock_check"]
    # 1f1b, 2 micro-batches, 3 stages: 2 x 2 activations and 2 x 2 gradients per step
    assert check["messages"] == 8 * steps and check["receives_before_their_send"] == 0
    starts = {e["id"]: e["ts"] for e in events if e.get("ph") == "s"}
    ends = {e["id"]: e["ts"] for e in events if e.get("ph") == "f"}
    assert len(starts) == len(ends) == 8 * steps and all(ends[i] >= starts[i] for i in starts)
    assert any(e.get("cat") == "predicted" for e in events)
    actions = from_chrome_trace(merged)
    assert {e.rank for e in actions} == {0, 1, 2}
    assert sum(e.action.op is Op.FORWARD for e in actions) == 3 * 2 * steps
    shown = subprocess.run([sys.executable, "-m", "lightning_pipedream", "show", "--trace",
                            str(trace_dir / "pipeline_trace.json"), "--last", "0"], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert "rank 0, 1, 2" in shown.stdout


def test_a_trace_directory_that_cannot_be_written_is_refused_in_words(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"trace=.*a_file/traces.*rank 0 cannot write there.*or trace=None"):
        check_trace_dir(blocker / "traces")


def _recv(mb: int = 0) -> Op:
    return Action(Op.RECV_ACT, 1, mb, peer=0).op


def test_a_receive_splits_into_waiting_and_transfer_at_the_send_start() -> None:
    accounts = StepAccounts()
    accounts.begin_step()
    accounts.action(_recv(), 10.0, 10.5, sent_at=10.3)  # waited 0.3 s for the peer to start, 0.2 s of transfer
    accounts.action(_recv(1), 11.0, 11.1, sent_at=9.0)  # sent long before: all transfer
    accounts.action(_recv(2), 12.0, 12.1, sent_at=13.0)  # a clock a little off: capped at the receive
    accounts.action(Op.FORWARD, 12.1, 12.4)
    accounts.action(Op.OPTIMIZER_STEP, 12.4, 12.5)
    accounts.end_step()
    accounts.begin_step()
    figures = accounts.take()
    assert figures.steps == 1
    assert figures.wait == pytest.approx(0.3 + 0.1)
    assert figures.transfer == pytest.approx(0.2 + 0.1)
    assert figures.compute == pytest.approx(0.3) and figures.update == pytest.approx(0.1)


def test_actions_outside_a_step_do_not_count_and_evaluation_ends_the_step_at_its_work(monkeypatch) -> None:
    from lightning_pipedream.runtime.execution import accounts as accounts_module

    times = iter([0.0, 1.0, 100.0, 103.0, 110.0, 111.0])  # the clock at each begin_step / end_step
    monkeypatch.setattr(accounts_module, "clock", lambda: next(times))
    accounts = StepAccounts()
    accounts.action(Op.FORWARD, 0.0, 5.0)  # before any step (e.g. the sanity check's evaluation)
    accounts.begin_step()  # 0
    accounts.end_step()  # 1
    accounts.interrupt()  # validation came between: its time is no step's
    accounts.action(Op.FORWARD, 2.0, 7.0)
    accounts.begin_step()  # 100: the first step ends at 1, its own end
    accounts.action(Op.FORWARD, 100.0, 102.0)
    accounts.end_step()  # 103
    accounts.begin_step()  # 110: nothing between, the second step runs from 100 to 110 (data loading, hooks)
    accounts.end_step()  # 111
    accounts.finish()
    figures = accounts.take()
    assert figures.steps == 3 and figures.compute == 2.0
    assert figures.step == 1.0 + 10.0 + 1.0 and figures.other == 10.0


def test_a_logger_that_refuses_the_names_is_left_out_in_words_and_the_others_go_on(caplog) -> None:
    import torch

    from lightning_pipedream.strategy.reporting.stage_figures import StageFigures

    class Refuses:
        calls = 0

        def log_metrics(self, metrics: dict, step: int | None = None) -> None:
            self.calls += 1
            raise ValueError("names may not contain '/'")

    class Takes:
        def __init__(self) -> None:
            self.logged: list[tuple[int, dict]] = []

        def log_metrics(self, metrics: dict, step: int | None = None) -> None:
            self.logged.append((step, metrics))

    accounts = StepAccounts()
    figures = StageFigures(accounts, rank=0, world_size=1, stage=0, replica=0, every=1, device=torch.device("cpu"),
                           replicas=False, simulated=0.25)
    refuses, takes = Refuses(), Takes()
    figures.loggers = [refuses, takes]
    with caplog.at_level("WARNING", logger="lightning_pipedream"):
        for step in range(3):
            figures.begin_step()
            accounts.action(Op.FORWARD, 0.0, 0.001)
            figures.end_step(step)
        figures.finish(3)
    assert refuses.calls == 1  # told once, then left out
    assert [step for step, _ in takes.logged] == [1, 2, 3]  # each interval, after the step that closes it
    assert "pipeline/stage0/compute_ms" in takes.logged[0][1] and takes.logged[0][1]["pipeline/bubble_simulated"] == 0.25
    (warning,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert warning == ("PipeDreamStrategy: the logger Refuses refused the pipeline's figures (ValueError: names may not "
                       "contain '/'); they are no longer sent to it. Training goes on. "
                       "PipeDreamStrategy(log_figures=False) stops logging them.")


def test_on_cuda_the_device_compute_is_logged_beside_the_host_parts_once_resolved_per_interval() -> None:
    """CUDA modelled in process (tests/helpers/cuda_events.py): the accounts time each compute action with a pair of
    events and the interval's figures resolve them with one synchronization, where the stage's figures are gathered."""
    import torch
    from cuda_events import StandInDevice

    from lightning_pipedream.strategy.reporting.explanation import measured_ranks
    from lightning_pipedream.strategy.reporting.stage_figures import RankFigures, StageFigures

    class Takes:
        def __init__(self) -> None:
            self.logged: list[tuple[int, dict]] = []

        def log_metrics(self, metrics: dict, step: int | None = None) -> None:
            self.logged.append((step, metrics))

    device = StandInDevice([1.0 + k for k in range(12)])  # ms: step k's three compute actions run 3k+1 .. 3k+3
    accounts = StepAccounts(events=device.timing_event)
    figures = StageFigures(accounts, rank=0, world_size=1, stage=0, replica=0, every=2, device=torch.device("cpu"),
                           replicas=False)
    takes = Takes()
    figures.loggers = [takes]
    syncs = []
    for step in range(4):
        figures.begin_step()
        for _ in range(3):
            mark = accounts.device_begin()
            accounts.device_end(mark)
            accounts.action(Op.FORWARD, 0.0, 0.002)  # the host's clock: 2 ms to launch each
        figures.end_step(step)
        syncs.append(device.syncs)
    figures.finish(4)
    assert syncs == [0, 1, 1, 2] and device.syncs == 3  # one per interval, none per action
    # The intervals hold steps {0}, {1, 2}, {3} (a step closes when the next begins).
    expected = [sum(device.ran[:3]), sum(device.ran[3:9]) / 2, sum(device.ran[9:])]
    assert [step for step, _ in takes.logged] == [1, 3, 4]
    for (_, metrics), device_ms in zip(takes.logged, expected):
        assert metrics["pipeline/stage0/device_compute_ms"] == pytest.approx(device_ms)
        assert metrics["pipeline/stage0/compute_ms"] == pytest.approx(6.0)  # the host's, beside it
        host = sum(metrics[f"pipeline/stage0/{part}_ms"] for part in PARTS)
        assert host == pytest.approx(metrics["pipeline/stage0/step_ms"])  # the host parts still make the step
    total = figures.totals[0].figures
    assert total.device_actions == 12 and total.device_compute * 1e3 == pytest.approx(sum(device.ran))
    # What the end of the fit explains and the merged trace keeps (metadata.measured): the device's mean per step.
    (measured,) = measured_ranks(figures.totals)
    assert measured["device_compute"] == pytest.approx(sum(device.ran) / 4 / 1e3)
    assert measured["compute"] == pytest.approx(0.006)
    accounts = StepAccounts()  # a CPU device: no device figure at all
    accounts.begin_step()
    accounts.action(Op.FORWARD, 0.0, 0.002)
    accounts.end_step()
    accounts.finish()
    cpu = RankFigures(0, 0, 0, 1, 0.0, accounts.take())
    assert "device_compute" not in measured_ranks({0: cpu})[0]
