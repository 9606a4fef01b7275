"""Faults a pipeline meets: a stopped (SIGSTOP) or spinning rank is named by every other rank and ended with them, a
failing rank's reason reaches every rank (rank 0's included, in training and in each step of setup), each leaves a
flight recorder, and a rank that starts late still joins."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue as queue_module
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fault_runs import RankRun, run_hang_trainer, run_many
from torch import nn

from lightning_pipedream.cli import main as cli_main
from lightning_pipedream.runtime.faults.failures import from_rank_zero, pipeline_failures, report_failure
from lightning_pipedream.runtime.faults.flight import PipelineTimeoutError
from lightning_pipedream.runtime.faults.launch import run_local
from lightning_pipedream.runtime.faults.mailbox import mailbox
from lightning_pipedream.runtime.pipeline import Pipeline
from lightning_pipedream.schedule.timeline import from_chrome_trace

# Starts several processes (not in the fast suite); the setup runs' launch has a limit of its own (SETUP_RUNS_LIMIT)
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

TIMEOUT = 10.0  # the process group's timeout, seconds
# How these tests tell "told by its peer" from "gave up on a timeout": by what each rank says (its error's words, the
# rank that stopped it), never by how many seconds it took. Where a run must end without any timeout's help, its
# timeout is LONG_TIMEOUT, far beyond HANG_LIMIT: a rank that was not told would still be waiting when the test's
# hang limit ends it, and fail the test. HANG_LIMIT bounds only a real hang (several times a slow hour's run).
LONG_TIMEOUT = 600.0
HANG_LIMIT = 150.0


def stop_at_step(rank: int, world: int, stopped: int, step: int, how: str = "stop") -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(world)])
    pipe = Pipeline(model, loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                    schedule="1f1b", chunks=2)
    for t in range(step + 3):
        if rank == stopped and t == step:
            time.sleep(1.5)  # a heartbeat (one a second) reports the last action first
            Path(os.environ["TEST_FAULT_FILE"]).write_text(str(time.time()))
            if how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            while how == "spin":  # a livelock in Python: its threads still run
                sum(range(1000))
        pipe.step(torch.randn(4, 8), torch.randn(4, 8))


def _child(rank: int, world: int, store_path: str, queue, args: tuple, env: dict) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    code = 0
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.FileStore(store_path, world)
        timeout = timedelta(seconds=float(env.get("TEST_TIMEOUT", TIMEOUT)))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        stop_at_step(rank, world, *args)
        queue.put((rank, time.time(), "finished without an error"))
    except BaseException as err:
        queue.put((rank, time.time(), f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        code = 1
    finally:
        queue.close()
        queue.join_thread()
    os._exit(code)


def run_with_stopped_rank(tmp_path: Path, world: int, stopped: int, step: int, env: dict, how: str = "stop"
                          ) -> tuple[dict, list]:
    """Every rank but ``stopped`` has to end by itself, and ``stopped`` too (its peers end it), within HANG_LIMIT s
    of the stop (an outer limit only a hang reaches). Returns each surviving rank's error text and every process's
    exit code."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, world, str(tmp_path / "store"), queue, (stopped, step, how), env),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    texts: dict[int, str] = {}
    try:
        deadline = time.monotonic() + HANG_LIMIT
        while not (tmp_path / "fault_time").exists() and procs[stopped].exitcode is None:
            assert time.monotonic() < deadline, "the rank never stopped itself"
            time.sleep(0.05)
        deadline = time.monotonic() + HANG_LIMIT
        while len(texts) < world - 1 and time.monotonic() < deadline:
            try:
                rank, when, text = queue.get(timeout=0.5)
            except queue_module.Empty:
                continue
            texts[rank] = text
        for p in procs:  # the stopped (or spinning) rank too: its peers end it
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    assert sorted(texts) == [r for r in range(world) if r != stopped], f"ranks that ended by themselves: {sorted(texts)}"
    return texts, [p.exitcode for p in procs]


def test_a_frozen_peer_ends_the_run_long_before_the_timeout(tmp_path):
    # The watchdog finds the peer waited for stopped (not merely slow) and ends the run after
    # LIGHTNING_PIPEDREAM_FROZEN_PEER seconds, whatever the timeout (here ten minutes, past the test's hang limit: the
    # run can only have ended through the watchdog, as its words say).
    env = {"LIGHTNING_PIPEDREAM_FLIGHT_RECORDER": str(tmp_path / "flight"), "TEST_TIMEOUT": str(LONG_TIMEOUT),
           "LIGHTNING_PIPEDREAM_FROZEN_PEER": "3", "TEST_FAULT_FILE": str(tmp_path / "fault_time")}
    texts, codes = run_with_stopped_rank(tmp_path, world=2, stopped=1, step=2, env=env)
    assert codes == [1, -signal.SIGKILL], codes
    assert texts[0].startswith("PeerFailedError: Pipeline stopped: rank 0, step 2: RECV_GRAD of micro-batch 0 from "
                               "stage 1 (rank 1) has waited "), texts[0]
    assert ("Rank 1 is stopped (SIGSTOP, a debugger) or frozen (not even its mailbox answers), so the run is ended "
            "now rather than at the timeout (LIGHTNING_PIPEDREAM_FROZEN_PEER=seconds, 0 to wait for the timeout)."
            ) in texts[0].splitlines()[0], texts[0]


def test_a_rank_spinning_in_python_is_named_and_ended(tmp_path, capfd):
    # The spinning rank's threads run: its watchdog obeys the stop request its peer leaves, saying why.
    env = {"LIGHTNING_PIPEDREAM_FLIGHT_RECORDER": str(tmp_path / "flight"), "TEST_TIMEOUT": "5",
           "TEST_FAULT_FILE": str(tmp_path / "fault_time")}
    texts, codes = run_with_stopped_rank(tmp_path, world=2, stopped=1, step=2, env=env, how="spin")
    assert codes == [1, 1], codes
    assert texts[0].startswith("PipelineTimeoutError: Pipeline timeout: rank 0, step 2: RECV_GRAD of micro-batch 0 "
                               "from stage 1 (rank 1) got no answer within 5"), texts[0]
    assert "it answers, so it is running (busy, or waiting itself)" in texts[0]
    err = capfd.readouterr().err
    assert ("lightning_pipedream: rank 1 (stage 1) ends its process: rank 0 (stage 0) stopped the run, naming this "
            "rank as hung. Pipeline timeout: rank 0, step 2:") in err, err[-3000:]
    assert "in stop_at_step" in err  # where it spun: its main thread's stack


def test_stopped_rank_is_named_by_every_other_rank_and_ended(tmp_path, capsys):
    if not sys.platform.startswith("linux"):
        pytest.skip("reads process states from /proc")
    recorder_dir = tmp_path / "flight"
    env = {"LIGHTNING_PIPEDREAM_FLIGHT_RECORDER": str(recorder_dir), "LIGHTNING_PIPEDREAM_NO_PROGRESS_WARNING": "4",
           "TEST_FAULT_FILE": str(tmp_path / "fault_time")}
    texts, codes = run_with_stopped_rank(tmp_path, world=3, stopped=1, step=2, env=env)
    # Every process is gone: the stopped one was ended (SIGKILL) by its peers, which timed out waiting for it.
    assert codes[1] == -signal.SIGKILL and codes[0] == codes[2] == 1, codes
    for rank, text in texts.items():
        first = text.splitlines()[0]
        assert first.startswith(f"PipelineTimeoutError: Pipeline timeout: rank {rank}, step 2: "), text
        assert "from stage 1 (rank 1) got no answer within 1" in first, text
        assert "(Timed out waiting 10000ms for recv operation to complete)" in first, text
        assert "Rank 1 (stage 1) last reported" in first and "it has stopped reporting" in first, text
        assert "its last, in step 1: OPTIMIZER_STEP" in first, text
        assert "PipeDreamStrategy(timeout=timedelta(minutes=60))" in first, text
        assert f"{recorder_dir / f'rank{rank}.json'}" in first, text
    # stage 0 waits for stage 1's gradient, stage 2 for its activation
    assert "step 2: RECV_GRAD of micro-batch 0 from stage 1 (rank 1)" in texts[0]
    assert "step 2: RECV_ACT of micro-batch 0 from stage 1 (rank 1)" in texts[2]
    for rank in (0, 2):
        trace = json.loads((recorder_dir / f"rank{rank}.json").read_text())
        events = from_chrome_trace(trace)
        assert events and {e.rank for e in events} == {rank}
        assert trace["traceEvents"][-1]["args"].get("unfinished") is True
        assert "Pipeline timeout" in trace["otherData"]["error"]
    capsys.readouterr()
    assert cli_main(["show", "--trace", str(recorder_dir / "rank0.json"), str(recorder_dir / "rank2.json")]) == 0
    shown = capsys.readouterr().out
    assert "rank 0" in shown and "rank 2" in shown and "unfinished" in shown


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_a_stopped_rank_of_a_trainer_is_named_and_every_process_ends(tmp_path):
    err, code = run_hang_trainer(tmp_path, {"rank": 1, "at": 3, "how": "stop", "timeout": 10})
    assert code not in (0, -signal.SIGKILL), err[-4000:]
    assert "PipelineTimeoutError: Pipeline timeout: rank 0, step 3: " in err, err[-4000:]
    message = err[err.index("PipelineTimeoutError: Pipeline timeout: rank 0"):].splitlines()[0]
    assert "from stage 1 (rank 1) got no answer within 1" in message, message
    assert "Rank 1 (stage 1) last reported" in message and "it has stopped reporting" in message, message
    assert "PipeDreamStrategy(timeout=timedelta(minutes=60))" in message
    assert "lightning_pipedream: rank 0 ends rank 1 (process " in err and "it is stopped or frozen" in err
    assert from_chrome_trace(json.loads((tmp_path / "flight" / "rank0.json").read_text()))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_a_failure_on_rank_0_reaches_rank_1(tmp_path):
    # Rank 0 hosts the store torch's process group uses: its reason travels through rank 1's own mailbox. The
    # pipeline's timeout is past the hang limit: rank 1 can only have stopped because it was told.
    err, code = run_hang_trainer(tmp_path, {"rank": 0, "at": 3, "how": "raise", "schedule": "pipedream",
                                            "timeout": LONG_TIMEOUT})
    assert code == 1, (code, err[-4000:])
    assert "[rank0]: ValueError: bad input on rank 0" in err
    assert ("[rank1]: lightning_pipedream.runtime.faults.errors.PeerFailedError: Pipeline stage 0 failed with ValueError: "
            "bad input on rank 0 (on rank 0) (this rank, 1, stage 1, stopped because of it)") in err, err[-4000:]


def test_show_trace_of_a_file_that_is_not_a_trace_says_so(tmp_path, capsys):
    bad = tmp_path / "rank0.json"
    bad.write_text("{not json")
    assert cli_main(["show", "--trace", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad} is not a trace JSON written by lightning_pipedream (")


class _SummaryEnds:
    """What LaggedSummaries reads of its SummaryChannel."""

    device = torch.device("cpu")
    stage_index = 0

    def _averaged(self, summary):
        return summary


def post_a_summary_receive_after_the_peer_failed(rank: int, world: int, out: str) -> None:
    from lightning_pipedream.strategy.reporting.summaries import LaggedSummaries

    link = torch.zeros(1)  # the pair's connection, made before rank 1 fails
    if rank == 0:
        dist.send(link, 1)
        dist.recv(link, 1)
    else:
        dist.recv(link, 0)
        dist.send(link, 0)
        with pipeline_failures(1):
            raise ValueError("planted failure on rank 1")
    time.sleep(1.5)  # rank 1 has exited: gloo refuses to post on the closed pair
    try:
        LaggedSummaries(_SummaryEnds(), dist.group.WORLD, source=1, receivers=[0], lag=1, is_source=False).step(None)
    except Exception as err:  # noqa: BLE001 - what the user would read
        Path(out).write_text(f"{type(err).__name__}: {err}")
        return
    Path(out).write_text("posted")


def test_posting_a_step_summary_to_a_failed_peer_gives_that_peer_s_error(tmp_path, monkeypatch):
    """pipedream's step summaries post their next receive ahead; gloo raises at the post when the peer's connection
    has closed, which must read as the peer's error, as a failed wait does (it was gloo's 'Connection closed')."""
    monkeypatch.setenv("LIGHTNING_PIPEDREAM_FLIGHT_RECORDER", str(tmp_path))
    out = tmp_path / "rank0.txt"
    with pytest.raises(RuntimeError, match="1 of 2 ranks failed"):
        run_local(post_a_summary_receive_after_the_peer_failed, 2, str(out), timeout=60)
    assert out.read_text() == ("PeerFailedError: Pipeline stage 1 failed with ValueError: planted failure on rank 1 "
                               "(on rank 1) (this rank, 0, stage 0, stopped because of it)")


def test_a_timed_out_collective_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PIPEDREAM_FLIGHT_RECORDER", str(tmp_path))
    with pytest.raises(PipelineTimeoutError) as info:
        with pipeline_failures(1, waiting="the step summary's broadcast from the last stage"):
            raise RuntimeError("[unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete")
    text = str(info.value)
    assert text.startswith("Pipeline timeout: rank 0, step ")
    assert ": the step summary's broadcast from the last stage (stage 1) got no answer within " in text
    assert "(Timed out waiting 10000ms for recv operation to complete), in a collective of the pipeline's ranks." in text
    assert f"are in {tmp_path / 'rank0.json'}" in text and (tmp_path / "rank0.json").exists()


# Where rank 0 fails in setup, and the words every other rank stops with.
SETUP_FAULTS = {
    "profile": "SetupFailedError: Rank 0 could not profile the layers to plan the stages, so this rank stops too. "
               "Rank 0's error: ValueError: planted failure in a layer on rank 0 (on rank 0; this rank is rank 1)",
    "auto": "SetupFailedError: Rank 0 could not profile the layers and plan the pipeline (schedule='auto'), so this "
            "rank stops too. Rank 0's error: ValueError: planted failure in a layer on rank 0 (on rank 0; this rank is "
            "rank 1)",
    "capture": "SetupFailedError: Rank 0 could not split Branches into stages, so this rank stops too. Rank 0's "
               "error: GraphCaptureError: Could not trace Branches.forward into a graph at ",
    "materialize": "Rank 0 failed in setup with ValueError: planted failure initializing a layer on rank 0 (on rank "
                   "0)",
    "plan": "Rank 0 failed in setup with ValueError: The plan {out}/plan_rank0.json was made for another model: it "
            "plans 4 layers and the model's nn.Sequential (layers) has 6;",
    "restore": "Rank 0 failed with CheckpointReadError: The checkpoint {out}/damaged.ckpt cannot be read: it is cut "
               "short (14 bytes,",
}
# Rank 0 failed in a step of its own (rank 1 does it too, or has nothing to do): rank 1 learns of it in its next wait,
# or, when that wait is on a store that rank 0's exit has not closed yet, from its watchdog (a stop request's grace).
LATER = {"materialize", "plan", "restore"}
# What rank 0 itself stops with.
OWN_ERRORS = {
    "profile": "ValueError: planted failure in a layer on rank 0",
    "auto": "ValueError: planted failure in a layer on rank 0",
    "capture": "GraphCaptureError: Could not trace Branches.forward into a graph at ",
    "materialize": "ValueError: planted failure initializing a layer on rank 0",
    "plan": "ValueError: The plan {out}/plan_rank0.json was made for another model",
    "restore": "CheckpointReadError: The checkpoint {out}/damaged.ckpt cannot be read",
}


SETUP_RUNS_LIMIT = 420.0  # seconds for the launch of all setup runs; 61 s on a quiet machine


@pytest.fixture(scope="module")
def setup_runs(tmp_path_factory) -> dict[str, tuple[Path, list[RankRun]]]:
    """The two-process runs of tests/scripts/setup_fault_trainer.py, side by side (one launch for all: each waits
    more than it computes): rank 0 failing in each step of setup, every rank refusing ``balance=``, and rank 1
    starting 30 s after rank 0 with a pipeline timeout of 10 s. The failing runs' pipeline timeout is LONG_TIMEOUT,
    past the launch's limit: a rank that was not told of rank 0's failure would wait for it, and fail the test
    (the limit is several times what 16 processes starting at once on two cores take on a slow hour)."""
    root = tmp_path_factory.mktemp("setup_faults")
    runs = {fault: (root / fault, {"fault": fault, "timeout": LONG_TIMEOUT}, {}) for fault in [*SETUP_FAULTS,
                                                                                               "balance"]}
    runs["late"] = (root / "late", {"fault": "none", "timeout": 10}, {1: 30.0})
    results = run_many(list(runs.values()), limit=SETUP_RUNS_LIMIT)
    return {name: (run[0], ranks) for (name, run), ranks in zip(runs.items(), results)}


@pytest.mark.parametrize("fault", list(SETUP_FAULTS))
def test_a_failure_of_rank_0_in_setup_reaches_every_rank(setup_runs, fault):
    # Rank 0 profiles, captures and plans for every rank, reads its own plan= and checkpoint and materializes its own
    # stage: wherever it fails, rank 1 stops with rank 0's reason and rank, never gloo's "Connection closed by peer",
    # and never by a timeout (its pipeline timeout is past the launch's limit).
    out, ranks = setup_runs[fault]
    assert (out / "fault_time").exists(), ranks[0].err[-3000:]  # rank 0 failed where planted, not earlier
    for rank, run in enumerate(ranks):
        assert run.code not in (0, None), (rank, run.code, run.err[-3000:])
        assert "Pipeline timeout" not in run.err, (rank, run.err[-3000:])
    assert OWN_ERRORS[fault].format(out=out) in ranks[0].err, ranks[0].err[-3000:]
    words = SETUP_FAULTS[fault].format(out=out)
    if fault in LATER:
        raised = f"[rank1]: lightning_pipedream.runtime.faults.errors.PeerFailedError: {words}"
        ended = f"lightning_pipedream: rank 1 ends its process: rank 0 stopped the run. {words}"
        assert raised in ranks[1].err or ended in ranks[1].err, ranks[1].err[-3000:]
        if raised in ranks[1].err:
            assert "(on rank 0) (this rank, 1, stopped because of it)" in ranks[1].err, ranks[1].err[-3000:]
    else:
        assert f"[rank1]: lightning_pipedream.runtime.faults.failures.{words}" in ranks[1].err, ranks[1].err[-3000:]
    assert "Connection closed" not in ranks[1].err


def test_a_balance_every_rank_refuses_ends_every_rank(setup_runs):
    out, ranks = setup_runs["balance"]
    words = "ValueError: balance=[3, 3] must list 2 positive layer counts (one per stage) that add up to the model's 4"
    for rank, run in enumerate(ranks):
        assert run.code not in (0, None) and f"[rank{rank}]: {words}" in run.err, (rank, run.err[-3000:])
        assert "Pipeline timeout" not in run.err, (rank, run.err[-3000:])


def test_a_rank_that_starts_30_s_late_joins_despite_a_10_s_timeout(setup_runs):
    # The rendezvous waits for late ranks (30 minutes); PipeDreamStrategy(timeout=10 s) bounds the pipeline's waits.
    out, ranks = setup_runs["late"]
    for rank, run in enumerate(ranks):
        assert run.code == 0, (rank, run.err[-3000:])
        assert (out / f"trained_rank{rank}").read_text() == "3"
        assert (out / f"wait_timeout_rank{rank}").read_text() == "10.0"  # the pipeline's waits keep timeout=


def _rank_zero_computes(rank: int, world: int, fails: bool) -> str:
    def compute() -> str:
        if fails:
            raise ValueError("no plan today")
        return "the plan"

    try:
        return from_rank_zero("plan the stages", compute)
    except Exception as err:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(err).__name__}: {err}"


def test_from_rank_zero_gives_every_rank_the_result_or_rank_0s_error():
    assert run_local(_rank_zero_computes, 2, False, timeout=60) == ["the plan", "the plan"]
    assert run_local(_rank_zero_computes, 2, True, timeout=60) == [
        "ValueError: no plan today",
        "SetupFailedError: Rank 0 could not plan the stages, so this rank stops too. Rank 0's error: ValueError: no "
        "plan today (on rank 0; this rank is rank 1)",
    ]


def test_an_error_that_follows_a_peers_failure_names_it(caplog):
    # An error outside the pipeline's waits (a raw collective of Lightning's) on a rank that a peer asked to stop.
    box = mailbox()
    box.put_here("stop", {"rank": 0, "message": "Rank 0 failed in setup with ValueError: bad (on rank 0)"})
    try:
        with caplog.at_level(logging.ERROR, logger="lightning_pipedream"):
            report_failure(RuntimeError("a collective failed"), None)
    finally:
        with box.lock:
            box.values.pop("stop", None)
    assert ("lightning_pipedream: rank 0 stops because another rank failed first: Rank 0 failed in setup with "
            "ValueError: bad (on rank 0)") in caplog.text
