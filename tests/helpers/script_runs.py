"""Running the training scripts of the tests: one run or a batch of runs per launch, and a launch from a test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def main_runs(train: Callable[[str, dict[str, Any]], None]) -> None:
    """`SCRIPT OUT_DIR JSON_OPTIONS`, or `SCRIPT --runs RUNS.json` with a list of [OUT_DIR, OPTIONS] run one after
    the other in the same processes (they start once: Lightning's launcher runs only for the first)."""
    if sys.argv[1] == "--runs":
        with open(sys.argv[2]) as f:
            runs = json.load(f)
    else:
        runs = [[sys.argv[1], json.loads(sys.argv[2])]]
    for out, options in runs:
        train(out, options)


def run_script(script: Path, out: Path, options: dict, timeout: float, expect_ok: bool = True
               ) -> subprocess.CompletedProcess:
    """Train with ``script`` in a subprocess (Lightning's launcher re-runs sys.argv, which inside pytest would re-run
    pytest); ``{"--runs": path}`` runs a batch. A hung run is killed with its ranks and fails the test."""
    out.mkdir(parents=True, exist_ok=True)
    args = ["--runs", options["--runs"]] if "--runs" in options else [str(out), json.dumps(options)]
    proc = run_killable([sys.executable, str(script), *args], out, timeout, {**os.environ, "PYTHONWARNINGS": "ignore"})
    if expect_ok:
        assert proc.returncode == 0, f"{script.name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc


def run_killable(argv: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess:
    """Run ``argv`` in a session of its own; past ``timeout`` the whole process group goes (the ranks a launcher
    started included) and the test fails, so that a hung run neither lingers nor passes."""
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
