"""Faults a pipeline meets: a stopped (SIGSTOP) rank is named by every other rank, and each leaves a flight recorder."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue as queue_module
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_pipedream.cli import main as cli_main
from lightning_pipedream.runtime.failures import pipeline_failures
from lightning_pipedream.runtime.flight import PipelineTimeoutError
from lightning_pipedream.runtime.pipeline import Pipeline
from lightning_pipedream.schedule.timeline import from_chrome_trace

pytestmark = pytest.mark.multiprocess  # starts several processes: not in the fast suite

TIMEOUT = 10.0  # the process group's timeout, seconds


def stop_at_step(rank: int, world: int, stopped: int, step: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(world)])
    pipe = Pipeline(model, loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                    schedule="1f1b", chunks=2)
    for t in range(step + 3):
        if rank == stopped and t == step:
            time.sleep(1.5)  # a heartbeat (one a second) reports the last action first
            os.kill(os.getpid(), signal.SIGSTOP)
        pipe.step(torch.randn(4, 8), torch.randn(4, 8))


def _child(rank: int, world: int, store_path: str, queue, args: tuple, env: dict) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    code = 0
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT))
        stop_at_step(rank, world, *args)
        queue.put((rank, time.time(), "finished without an error"))
    except BaseException as err:
        queue.put((rank, time.time(), f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        code = 1
    finally:
        queue.close()
        queue.join_thread()
    os._exit(code)


def run_with_stopped_rank(tmp_path: Path, world: int, stopped: int, step: int, env: dict) -> tuple[dict, float]:
    """Every rank but ``stopped`` has to end within 30 s; the stopped one is killed at the end. Returns each
    surviving rank's error text and the seconds from the stop to the last one's exit."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, world, str(tmp_path / "store"), queue, (stopped, step), env),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    texts: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60
        while procs[stopped].exitcode is None and not _is_stopped(procs[stopped].pid):
            assert time.monotonic() < deadline, "the rank never stopped itself"
            time.sleep(0.05)
        stopped_at = time.time()
        deadline = time.monotonic() + 30
        while len(texts) < world - 1 and time.monotonic() < deadline:
            try:
                rank, when, text = queue.get(timeout=0.5)
            except queue_module.Empty:
                continue
            texts[rank] = text
            last = when
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    assert sorted(texts) == [r for r in range(world) if r != stopped], f"ranks that ended in 30 s: {sorted(texts)}"
    return texts, last - stopped_at


def _is_stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_stopped_rank_is_named_by_every_other_rank(tmp_path, capsys):
    if not sys.platform.startswith("linux"):
        pytest.skip("reads process states from /proc")
    recorder_dir = tmp_path / "flight"
    env = {"LIGHTNING_PIPEDREAM_FLIGHT_RECORDER": str(recorder_dir), "LIGHTNING_PIPEDREAM_NO_PROGRESS_WARNING": "4"}
    texts, seconds = run_with_stopped_rank(tmp_path, world=3, stopped=1, step=2, env=env)
    assert seconds < 30
    for rank, text in texts.items():
        first = text.splitlines()[0]
        assert first.startswith(f"PipelineTimeoutError: Pipeline timeout: rank {rank}, step 2: "), text
        assert "from stage 1 (rank 1) got no answer within 1" in first, text
        assert "(Timed out waiting 10000ms for recv operation to complete)" in first, text
        assert "Rank 1 last reported" in first and "it has stopped reporting" in first, text
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


HANG_TRAINER = Path(__file__).resolve().parents[1] / "scripts" / "hang_trainer.py"


def test_stopped_rank_of_a_trainer_is_named(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "LIGHTNING_PIPEDREAM_FLIGHT_RECORDER": str(tmp_path / "flight")}
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:  # a file, not a pipe: the stopped rank would hold a pipe open
        proc = subprocess.Popen([sys.executable, str(HANG_TRAINER), str(tmp_path), "1", "3"], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        start = time.monotonic()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # hang_trainer.py dumps its stacks on it
            time.sleep(1)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the stopped rank too, and anything else the launcher started
            proc.wait()
    err = log.read_text()
    assert proc.returncode not in (0, -signal.SIGKILL), err[-4000:]
    assert time.monotonic() - start < 90
    assert "PipelineTimeoutError: Pipeline timeout: rank 0, step 3: " in err, err[-4000:]
    message = err[err.index("PipelineTimeoutError: Pipeline timeout: rank 0"):].splitlines()[0]
    assert "from stage 1 (rank 1) got no answer within 1" in message, message
    assert "Rank 1 last reported" in message and "it has stopped reporting" in message, message
    assert "PipeDreamStrategy(timeout=timedelta(minutes=60))" in message
    assert from_chrome_trace(json.loads((tmp_path / "flight" / "rank0.json").read_text()))


def test_show_trace_of_a_file_that_is_not_a_trace_says_so(tmp_path, capsys):
    bad = tmp_path / "rank0.json"
    bad.write_text("{not json")
    assert cli_main(["show", "--trace", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad} is not a trace JSON written by lightning_pipedream (")


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
