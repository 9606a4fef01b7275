"""The fast guard of benchmarks/paper/recipes_long.py (the four recipes' default runs, minutes each, are the benchmark's
job): it runs every task the configs define, as users type it, and its committed result shows each run whole."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.paper.recipes_long import MIN_BATCHES, TASKS, command

ROOT = Path(__file__).resolve().parents[2]


def test_it_runs_every_task_of_the_configs_with_the_users_command():
    assert sorted(TASKS) == sorted(p.stem for p in (ROOT / "conf" / "task").glob("*.yaml"))
    for task in TASKS:
        args = command(task, Path("out"))[1:]
        assert args[0] == "recipes/train.py" and args[-1] == "hydra.run.dir=out"
        assert args[1:-1] == ([] if task == "image" else [f"task={task}"])  # nothing else: no smoke settings


def test_the_committed_result_shows_every_default_run_past_its_hundredth_batch_and_validated():
    runs = {run["task"]: run for run in json.loads((ROOT / "benchmarks/results/recipes_long.json").read_text())["runs"]}
    assert sorted(runs) == sorted(TASKS)
    for task, run in runs.items():
        assert run["exit_code"] == 0 and run["error"] is None, (task, run["tail"])
        assert run["batches"] >= MIN_BATCHES and run["validations"] >= 1, (task, run)
    assert runs["language_model"]["samples_file"]
