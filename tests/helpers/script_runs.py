"""Running the training scripts of the tests: one run or a batch of runs per launch, and a launch from a test."""

from __future__ import annotations

import atexit
import gc
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import zygote


def exit_without_final_collections() -> None:
    """At this script's exit, skip the garbage collector's last passes over torch's and Lightning's heap: about 1.3 s
    of CPU per process (the suite starts hundreds), and nothing a test reads is left to them (every run writes and
    closes its files before it returns). Every atexit handler registered after this one still runs first."""
    atexit.register(gc.freeze)


def main_runs(train: Callable[[str, dict[str, Any]], None]) -> None:
    """`SCRIPT OUT_DIR JSON_OPTIONS`, or `SCRIPT --runs RUNS.json` with a list of [OUT_DIR, OPTIONS] run one after
    the other in the same processes (they start once: Lightning's launcher runs only for the first)."""
    exit_without_final_collections()
    if sys.argv[1] == "--runs":
        with open(sys.argv[2]) as f:
            runs = json.load(f)
    else:
        runs = [[sys.argv[1], json.loads(sys.argv[2])]]
    for out, options in runs:
        train(out, options)


def trainer_args(**args: Any) -> dict[str, Any]:
    """A quiet CPU Trainer's keyword arguments (no logger, checkpoints, progress bar or model summary), then ``args``:
    the start of every script's ``L.Trainer(...)``."""
    return {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
            "enable_model_summary": False, **args}


def write_json(path: str | Path, value: Any) -> None:
    """What a run leaves for its test to read."""
    with open(path, "w") as f:
        json.dump(value, f)


def refuse_unused(options: dict[str, Any]) -> None:
    """A run reads its options by popping them: any left over (a misspelt name) fails it rather than being ignored."""
    if options:
        raise SystemExit(f"unused options: {options}")


def run_script(script: Path, out: Path, options: dict, timeout: float, expect_ok: bool = True
               ) -> subprocess.CompletedProcess:
    """Train with ``script`` in a subprocess (Lightning's launcher re-runs sys.argv, which inside pytest would re-run
    pytest); ``{"--runs": path}`` runs a batch. A hung run is killed with its ranks and fails the test."""
    out.mkdir(parents=True, exist_ok=True)
    args = ["--runs", options["--runs"]] if "--runs" in options else [str(out), json.dumps(options)]
    proc = run_killable([sys.executable, str(script), *args], out, timeout, script_env())
    if expect_ok:
        assert proc.returncode == 0, f"{script.name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc


def script_env(**extra: str) -> dict[str, str]:
    """The environment of a training script: a rendezvous port of this pytest worker's own, and one thread per
    process. Lightning's launcher gives each rank ``cpus // processes`` threads unless OMP_NUM_THREADS is set, while
    a one-device run keeps the script's own count: on a 16-core machine the ranks summed in another order than the
    reference they are compared with (ResNet's BatchNorm over two values made that 5e-2 apart). A MASTER_PORT in
    ``extra`` (a port the caller drew from :func:`free_port` already, for ranks it starts itself) stands."""
    port = extra.get("MASTER_PORT") or str(free_port())
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **extra, "MASTER_PORT": port}


# Rendezvous ports come from below the kernel's ephemeral range (which bind(0) and every outgoing connection draw
# from, so a port found free that way can be taken again before the run listens on it), in a block per pytest-xdist
# worker: gw3 never picks one of gw5's ports. A random start in the block keeps two suites on one machine apart.
_PORTS_FROM, _BLOCK = 10_000, 512


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def port_block(worker: str) -> range:
    """The rendezvous ports of pytest-xdist worker ``worker`` ("gw3"; "master" or "" without xdist)."""
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    blocks = max(1, (_ephemeral_low() - _PORTS_FROM) // _BLOCK)
    first = _PORTS_FROM + (index % blocks) * _BLOCK
    return range(first, first + _BLOCK)


def _port_cycle() -> Iterator[int]:
    block = port_block(os.environ.get("PYTEST_XDIST_WORKER", ""))
    start = random.randrange(_BLOCK)
    return itertools.cycle([block[(start + k) % _BLOCK] for k in range(_BLOCK)])


_PORTS: Iterator[int] | None = None


def free_port() -> int:
    """A port nobody listens on now, from this pytest worker's own block (see above), for one run's rendezvous."""
    global _PORTS
    if _PORTS is None:
        _PORTS = _port_cycle()
    for _ in range(_BLOCK):
        port = next(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in this worker's block of {_BLOCK} from {_PORTS_FROM}")


def run_killable(argv: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess:
    """Run ``argv`` in a session of its own; past ``timeout`` the whole process group goes (the ranks a launcher
    started included) and the test fails, so that a hung run neither lingers nor passes. A Python script or module
    starts as a fork of this worker's zygote (tests/helpers/zygote.py: torch and Lightning imported already), and
    the ranks its launcher starts too; its output is read until every one of them has closed it."""
    import pytest

    env = dict(os.environ if env is None else env)
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        with open(os.devnull) as null:
            child = zygote.start(argv, cwd, env, (null.fileno(), out_write, err_write))
    finally:
        os.close(out_write)
        os.close(err_write)
    if child is None:
        os.close(out_read)
        os.close(err_read)
        return _run_cold(argv, cwd, timeout, env)
    chunks: dict[int, list[bytes]] = {out_read: [], err_read: []}
    if not _read_until_closed(chunks, timeout):
        child.kill_group()
        _read_until_closed(chunks, 30)
        stdout, stderr = _texts(chunks)
        pytest.fail(f"{' '.join(argv[1:3])} did not finish in {timeout} s:\n{stdout[-3000:]}\n{stderr[-4000:]}")
    stdout, stderr = _texts(chunks)
    return subprocess.CompletedProcess(argv, child.wait(60), stdout, stderr)


def _read_until_closed(chunks: dict[int, list[bytes]], timeout: float) -> bool:
    """Read the pipes (``chunks``' keys, still open) until every writer has closed them (True; closed here too), or
    ``timeout`` passes (False)."""
    import select
    import time

    deadline = time.monotonic() + timeout
    while not all(fd < 0 for fd in chunks) and time.monotonic() < deadline:
        for fd in select.select([fd for fd in chunks if fd >= 0], [], [], 0.5)[0]:
            data = os.read(fd, 1 << 16)
            if data:
                chunks[fd].append(data)
            else:
                os.close(fd)
                chunks[-fd - 1] = chunks.pop(fd)  # closed: kept under a negative key, in order
    return all(fd < 0 for fd in chunks)


def _texts(chunks: dict[int, list[bytes]]) -> tuple[str, str]:
    first, second = sorted(chunks, key=lambda fd: fd if fd >= 0 else -fd - 1)
    return tuple(b"".join(chunks[fd]).decode(errors="replace") for fd in (first, second))  # type: ignore[return-value]


def _run_cold(argv: list[str], cwd: Path, timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    import pytest

    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(argv[1:3])} did not finish in {timeout} s:\n{stdout[-3000:]}\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
