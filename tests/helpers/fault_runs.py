"""Running tests/scripts/hang_trainer.py, whose ranks go wrong on purpose, and checking that every process ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HANG_TRAINER = Path(__file__).resolve().parents[1] / "scripts" / "hang_trainer.py"


def run_hang_trainer(tmp_path: Path, options: dict) -> tuple[str, int, float]:
    """hang_trainer.py with ``options``; returns its stderr, the launcher's (rank 0's) exit code, and the seconds from
    the fault to the end of the last process the launcher started (all of them must end by themselves within 150 s)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "LIGHTNING_PIPEDREAM_FLIGHT_RECORDER": str(tmp_path / "flight")}
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:  # a file, not a pipe: a stopped rank would hold a pipe open
        proc = subprocess.Popen([sys.executable, str(HANG_TRAINER), str(tmp_path), json.dumps(options)], cwd=tmp_path,
                                env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            deadline = time.monotonic() + 150
            while session_processes(proc.pid) and time.monotonic() < deadline:
                proc.poll()  # reaps the launcher; the ranks it started are reaped by init
                time.sleep(0.1)
            ended = time.time()
            if session_processes(proc.pid):
                os.kill(proc.pid, signal.SIGUSR1)  # hang_trainer.py dumps its stacks on it
                time.sleep(1)
        finally:
            left = session_processes(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL) if left else None  # anything still there fails the test below
            proc.wait()
    text = log.read_text()
    assert not left, f"processes left: {left}\n{text[-4000:]}"
    return text, proc.returncode, ended - float((tmp_path / "fault_time").read_text())


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
