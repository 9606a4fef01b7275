"""Starts a benchmark worker (a Lightning run) in a fresh interpreter: one thread per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker_env() -> dict[str, str]:
    """The environment of a worker: this one, one thread per process, and the repository on the path."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def run_worker(module: str, spec: dict, cwd: str | Path, timeout: float) -> subprocess.CompletedProcess:
    """``python -m module --worker <spec as JSON>`` in ``cwd`` (Lightning starts the other ranks the same way)."""
    return subprocess.run(
        [sys.executable, "-m", module, "--worker", json.dumps(spec)],
        check=False, cwd=cwd, env=worker_env(), capture_output=True, text=True, timeout=timeout,
    )
