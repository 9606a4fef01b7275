"""The four recipes as users run them: each task's default configuration (conf/task/*.yaml, not a smoke one), the
whole run on 2 processes with validation and (the language model) samples on, as `python recipes/train.py
task=<task>` (issue #52: the language model's default run hung at its 32nd batch, which no smoke run reaches).

python -m benchmarks.paper.recipes_long [--tasks image translation language_model video_captioning]
                                        [--out benchmarks/results/recipes_long.json] [--limit SECONDS]

Writes, per task: the training batches it ran (at least 100 each), the seconds from the start of the job to its first
validation and to its target, the final metric, the job's wall time, its exit code, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.figures import write_result

ROOT = Path(__file__).resolve().parents[2]
TASKS = ("image", "translation", "language_model", "video_captioning")
MIN_BATCHES = 100


def command(task: str, run_dir: Path) -> list[str]:
    """The user's command for ``task`` (the main job, image, is the config's default), its output in ``run_dir``."""
    return [sys.executable, "recipes/train.py", *([] if task == "image" else [f"task={task}"]),
            f"hydra.run.dir={run_dir}"]


def run_task(task: str, limit: float) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"recipe_{task}_"))
    load_before = os.getloadavg()
    start = time.perf_counter()
    try:
        proc = subprocess.run(command(task, run_dir), cwd=ROOT, capture_output=True, text=True, timeout=limit)
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired as err:  # a hang: say so, with what it printed last
        code, tail = None, str(err.stdout or "")[-2000:]
    wall = time.perf_counter() - start
    found = run_dir / "results.json"
    results = json.loads(found.read_text()) if found.exists() else {}
    history = results.get("history") or []
    return {
        "task": task, "command": " ".join(command(task, Path("<run dir>"))[1:]).replace(sys.executable, "python"),
        "exit_code": code, "wall_s": round(wall, 1), "load_before": load_before,
        "batches": history[-1]["step"] if history else 0,
        "first_validation_s": round(history[0]["seconds"], 1) if history else None,
        "validations": len(history),
        "time_to_target_s": results.get("time_to_target_s"), "metric_name": results.get("metric_name"),
        "metric": results.get("metric"), "samples_file": (run_dir / "samples.txt").exists(),
        "error": results.get("error"), "tail": tail if code != 0 else "",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "recipes_long.json")
    parser.add_argument("--limit", type=float, default=1800.0, help="seconds a task's run may take (a hang's bound)")
    args = parser.parse_args(argv)
    runs = []
    for task in args.tasks:
        run = run_task(task, args.limit)
        print(f"{task}: exit {run['exit_code']}, {run['batches']} batches, first validation at "
              f"{run['first_validation_s']} s, {run['metric_name']}={run['metric']}, wall {run['wall_s']} s",
              flush=True)
        runs.append(run)
    write_result(args.out, {"machine": f"{os.cpu_count()} cores", "processes": 2, "runs": runs})
    ok = all(r["exit_code"] == 0 and r["batches"] >= MIN_BATCHES for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
