"""Trainer scripts whose ranks go wrong on purpose, run in subprocesses, and checks that every process ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zygote
from script_runs import free_port, script_env

HANG_TRAINER = Path(__file__).resolve().parents[1] / "scripts" / "hang_trainer.py"
HANG_LIMIT = 200.0  # seconds a hang_trainer.py run may take in all: several times a slow hour's run (11-22 s quiet)


def start_group(argv: list[str], cwd: Path, env: dict[str, str], err: Any) -> Any:
    """``argv`` with its standard error in the file ``err``, in a group of its own: a fork of this worker's zygote
    (tests/helpers/zygote.py) when there is one, else a new session. Either answers poll(), wait(), returncode,
    live() (its processes not yet ended: the launcher and the ranks it started) and kill_group()."""
    with open(os.devnull, "r+") as null:
        proc = zygote.start(argv, cwd, env, (null.fileno(), null.fileno(), err.fileno()))
        if proc is None:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
            proc.live = lambda: session_processes(proc.pid)  # type: ignore[attr-defined]
            proc.kill_group = lambda: os.killpg(proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    return proc


def run_hang_trainer(tmp_path: Path, options: dict) -> tuple[str, int]:
    """hang_trainer.py with ``options``; returns its stderr and the launcher's (rank 0's) exit code. Every process the
    launcher started must end by itself within HANG_LIMIT s (an outer limit only a hang reaches: whether a rank was
    told by its peer or timed out is for the test to read from its words, not from the seconds it took).
    Lightning's launcher starts the other ranks on a rendezvous port of this pytest worker's own (script_env)."""
    env = script_env(LIGHTNING_PIPEDREAM_FLIGHT_RECORDER=str(tmp_path / "flight"))
    log = tmp_path / "stderr.txt"
    argv = [sys.executable, str(HANG_TRAINER), str(tmp_path), json.dumps(options)]
    with log.open("w") as err:  # a file, not a pipe: a stopped rank would hold a pipe
        proc = start_group(argv, tmp_path, env, err)  # its ranks: forks too
        try:
            deadline = time.monotonic() + HANG_LIMIT
            while proc.live() and time.monotonic() < deadline:
                proc.poll()  # reaps the launcher; the ranks it started are reaped by init (or the zygote)
                time.sleep(0.1)
            if proc.live():
                os.kill(proc.pid, signal.SIGUSR1)  # hang_trainer.py dumps its stacks on it
                time.sleep(1)
        finally:
            left = proc.live()
            proc.kill_group() if left else None  # anything still there fails the test below
            proc.wait()
    text = log.read_text()
    assert not left, f"processes left: {left}\n{text[-4000:]}"
    fault_time = tmp_path / "fault_time"
    assert fault_time.exists(), f"the run ended before its planted fault:\n{text[-4000:]}"  # say why, not "no file"
    return text, proc.returncode


def kill_at_marker(script: Path, out: Path, runs: Path, marker: Path, limit: float = HANG_LIMIT) -> str:
    """``script --runs RUNS`` (a launcher and its ranks, in a group of their own), killed with SIGKILL, every process
    of it at once, as soon as the run writes ``marker`` (the moment the test wants it dead). Returns its stderr. Fails
    the test when the marker does not come within ``limit`` seconds (the run ended or hung before) or a process
    outlives the kill; never waits longer than that."""
    env = script_env()
    log = out / "stderr.txt"
    argv = [sys.executable, str(script), "--runs", str(runs)]
    with log.open("w") as err:
        proc = start_group(argv, out, env, err)
        try:
            deadline = time.monotonic() + limit
            while not marker.exists() and proc.live() and time.monotonic() < deadline:
                proc.poll()
                time.sleep(0.1)
        finally:
            reached = marker.exists()
            proc.kill_group()
            proc.wait()
            deadline = time.monotonic() + HANG_LIMIT
            while proc.live() and time.monotonic() < deadline:  # SIGKILL'd processes end at once; reaped by others
                time.sleep(0.1)
            left = proc.live()
    text = log.read_text()
    assert reached, f"the run did not reach its marker ({marker.name}):\n{text[-4000:]}"
    assert not left, f"processes left after the kill: {left}\n{text[-4000:]}"
    return text


def session_processes(session: int) -> list[int]:
    """The live (not ended) processes of ``session``: the launcher and the ranks it started."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":  # field 6 of stat: the session id
                found.append(int(entry))
    return found


def unused_pid() -> int:
    """A process id no process has now."""
    pid = 2 ** 22 - 1
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


SETUP_FAULT_TRAINER = Path(__file__).resolve().parents[1] / "scripts" / "setup_fault_trainer.py"


@dataclass
class RankRun:
    """One rank's process, as :func:`run_ranks` saw it end: exit code, stderr, and when it ended (``time.time()``)."""

    code: int | None
    err: str
    ended: float


def run_ranks(out: Path, options: dict, world: int = 2, delays: dict[int, float] | None = None,
              limit: float = 120.0) -> list[RankRun]:
    """setup_fault_trainer.py once per rank, each started by the test as torchrun would (rank ``r`` after
    ``delays[r]`` seconds), on 127.0.0.1 and a port of its own (from this pytest worker's block: script_runs.free_port);
    see :func:`run_many`."""
    return run_many([(out, options, delays or {})], world, limit)[0]


def run_many(runs: list[tuple[Path, dict, dict[int, float]]], world: int = 2, limit: float = 120.0
             ) -> list[list[RankRun]]:
    """Several runs of setup_fault_trainer.py side by side, each ``(out, options, delays)`` as :func:`run_ranks`
    describes; returns each run's ranks. Every rank of every run must end within ``limit`` s (a hung one is killed,
    with its session, and fails the test). Each rank's stderr goes to a file (a stopped rank would hold a pipe)."""
    started = time.monotonic()
    procs: dict[tuple[int, int], Any] = {}
    ended: dict[tuple[int, int], float] = {}
    ports = [free_port() for _ in runs]
    for out, _, _ in runs:
        out.mkdir(parents=True, exist_ok=True)
    try:
        while len(ended) < len(runs) * world:
            elapsed = time.monotonic() - started
            if elapsed > limit:
                hung = [f"--- {runs[i][0].name}, rank {r} ---\n{runs[i][0].joinpath(f'stderr_rank{r}.txt').read_text()}"
                        for (i, r) in procs if (i, r) not in ended]
                raise AssertionError(f"ranks still running after {limit} s:\n" + "\n".join(h[-3000:] for h in hung))
            for i, (out, options, delays) in enumerate(runs):
                for rank in range(world):
                    if (i, rank) not in procs and elapsed >= delays.get(rank, 0.0):
                        procs[i, rank] = _start_rank(out, options, rank, world, ports[i])
            for key, proc in procs.items():
                if key not in ended and proc.poll() is not None:
                    ended[key] = time.time()
            time.sleep(0.05)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill_group()
                proc.wait()
    return [[RankRun(procs[i, r].returncode, (out / f"stderr_rank{r}.txt").read_text(), ended[i, r])
             for r in range(world)] for i, (out, _, _) in enumerate(runs)]


def _start_rank(out: Path, options: dict, rank: int, world: int, port: int) -> Any:
    """One rank of setup_fault_trainer.py, as a fork of this worker's zygote (tests/helpers/zygote.py) when there is
    one, or else a process of its own; either answers poll(), returncode and kill_group()."""
    env = script_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                     WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo", LIGHTNING_PIPEDREAM_FLIGHT_RECORDER=str(out / "flight"))
    argv = [sys.executable, str(SETUP_FAULT_TRAINER), str(out), json.dumps(options)]
    with (out / f"stderr_rank{rank}.txt").open("w") as err:
        return start_group(argv, out, env, err)


RESTART_TRAINER = Path(__file__).resolve().parents[1] / "scripts" / "restart_trainer.py"
TORCHRUN_LIMIT = 400.0  # seconds a torchrun job with one restart may take in all: an outer limit only a hang reaches


@dataclass
class TorchrunJob:
    """A torchrun job started by :func:`start_torchrun`: its agents (one per "node") and their stderr files."""

    agents: list[Any]
    logs: list[Path]

    def live(self) -> list[int]:
        for a in self.agents:
            a.poll()
        return [pid for a in self.agents for pid in a.live()]

    def end(self) -> tuple[list[int], str]:
        """Kill what is left (a hang), then each agent's exit code and their stderr, one after the other."""
        for a in self.agents:
            if a.live():
                a.kill_group()
            a.wait()
        return [a.returncode for a in self.agents], "\n".join(log.read_text() for log in self.logs)


def start_torchrun(out: Path, options: dict | None = None, nproc: int = 2, nodes: int = 1,
                   rendezvous: str = "static", max_restarts: int = 1, runs: list[tuple[Path, dict]] | None = None
                   ) -> TorchrunJob:
    """restart_trainer.py under torchrun as a user starts it: ``nodes`` agents on loopback ("nodes", ``nproc``
    processes each), ``--max-restarts max_restarts``, the static rendezvous (``--master-port``) or the c10d one
    (``--rdzv-endpoint``); ``options`` (a kill among them: see the script) for one run, or ``runs`` for several in
    the same processes. Each agent's stderr goes to ``torchrun_node{n}.txt`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    if runs is not None:
        (out / "runs.json").write_text(json.dumps([[str(o), opts] for o, opts in runs]))
        args = ["--runs", str(out / "runs.json")]
    else:
        args = [str(out), json.dumps(options or {})]
    port = free_port()
    env = script_env(MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    for name in ("MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        env.pop(name, None)  # torchrun's to set, not this worker's
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={nproc}",
              f"--max-restarts={max_restarts}", "--monitor-interval=0.1"]
    if rendezvous == "c10d":
        launch += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=job-{port}"]
    job = TorchrunJob([], [])
    for node in range(nodes):
        node_args = [] if rendezvous == "c10d" else [f"--node-rank={node}", "--master-addr=127.0.0.1",
                                                      f"--master-port={port}"]
        job.logs.append(out / f"torchrun_node{node}.txt")
        with job.logs[-1].open("w") as err:
            job.agents.append(start_group([*launch, *node_args, str(RESTART_TRAINER), *args], out, env, err))
    return job


def finish_torchrun(jobs: list[TorchrunJob], limit: float = TORCHRUN_LIMIT) -> list[tuple[list[int], str]]:
    """Wait for ``jobs`` (running side by side) to end; returns each one's exit codes and stderr. Every process of
    every job must end within ``limit`` s: a hung one is killed with its group, and fails the test."""
    deadline = time.monotonic() + limit
    try:
        while any(job.live() for job in jobs) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {i: job.live() for i, job in enumerate(jobs) if job.live()}
    finally:
        ended = [job.end() for job in jobs]
    assert not left, f"processes of torchrun jobs left after {limit} s: {left}\n" + \
        "\n".join(ended[i][1][-4000:] for i in left)
    return ended


def torchrun_job(out: Path, options: dict | None = None, limit: float = TORCHRUN_LIMIT, **how: Any
                 ) -> tuple[list[int], str]:
    """One torchrun job (:func:`start_torchrun`'s arguments), waited for as :func:`finish_torchrun` does."""
    return finish_torchrun([start_torchrun(out, options, **how)], limit)[0]
