"""End-to-end recipe runs on 2 processes: each task's smallest config, and multirun sweeps with their summary."""

from __future__ import annotations

import ast
import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from pipedream_reference import Minibatch, PipeDreamRule
from script_runs import run_killable

from recipes.data import build_datamodule
from recipes.models import build_model
from recipes.results import NESTED_KEYS

pytestmark = pytest.mark.multiprocess  # starts several processes: not in the fast suite

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "recipes" / "train.py"
# task -> (default model, metric name, metric range)
TASKS = {
    "image": ("digits_cnn", "val_acc", (0.0, 1.0)),
    "translation": ("gnmt8", "val_bleu", (0.0, 1.0)),
    "language_model": ("awd_lstm", "perplexity", (1.0, math.inf)),
    "video_captioning": ("s2vt", "val_bleu", (0.0, 1.0)),
}
RESULT_KEYS = {"task", "model", "schedule", "stages", "chunks", "metric_name", "metric",
               "throughput_samples_per_s", "time_to_target_s", "error", "contender", "seed", "history", "explanation"}


def train(args: list[str], cwd: Path, timeout: float = 240, expect_ok: bool = True) -> subprocess.CompletedProcess:
    """Run recipes/train.py in a subprocess (Lightning re-runs sys.argv for rank 1, which must not be pytest).
    On timeout the whole process group goes, rank 1 included, so a hung run fails instead of lingering."""
    proc = run_killable([sys.executable, str(TRAIN), *args], cwd, timeout)
    assert (proc.returncode == 0) == expect_ok, (
        f"train.py {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def job_dirs(sweep: Path) -> dict[str, Path]:
    """Sweep job dirs keyed by their overrides joined with commas, e.g. 'experiment=smoke_image'."""
    dirs = {}
    for run_dir in sweep.iterdir():
        overrides = run_dir / ".hydra" / "overrides.yaml"
        if overrides.is_file():
            dirs[",".join(line[2:] for line in overrides.read_text().splitlines())] = run_dir
    return dirs


@pytest.fixture(scope="module")
def smoke_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """One multirun of the four tasks' smallest configs (one Python start-up for all four)."""
    tmp = tmp_path_factory.mktemp("smoke")
    experiments = ",".join(f"smoke_{task}" for task in TASKS)
    proc = train(["-m", f"experiment={experiments}", f"hydra.sweep.dir={tmp / 'sweep'}"], cwd=tmp)
    return proc, tmp / "sweep"


def check_results(results: dict, task: str, schedule: str, chunks: int) -> None:
    model, metric_name, (low, high) = TASKS[task]
    assert set(results) == RESULT_KEYS
    assert (results["task"], results["model"], results["metric_name"]) == (task, model, metric_name)
    assert (results["schedule"], results["stages"], results["chunks"]) == (schedule, 2, chunks)
    assert isinstance(results["metric"], float) and low <= results["metric"] <= high
    assert results["throughput_samples_per_s"] > 0
    assert results["time_to_target_s"] is None or results["time_to_target_s"] >= 0
    assert results["error"] is None
    # one entry per validation, the last one the final metric; the target's time is one of them
    assert results["history"] and results["history"][-1]["metric"] == results["metric"]
    assert results["time_to_target_s"] in (None, *(entry["seconds"] for entry in results["history"]))


@pytest.mark.parametrize("task", list(TASKS))
def test_smallest_config_runs_two_steps_on_two_processes(smoke_sweep, task: str) -> None:
    proc, sweep = smoke_sweep
    run_dir = job_dirs(sweep)[f"experiment=smoke_{task}"]
    check_results(json.loads((run_dir / "results.json").read_text()), task, "pipedream", 1)
    # the rank-0 validation line of that job: two optimizer steps were taken before it
    metric_name = TASKS[task][1]
    assert any(" step     2  " in line and f"{metric_name}=" in line for line in proc.stdout.splitlines())
    assert (run_dir / "train_ddp_process_1.log").exists(), "rank 1 did not run in this job's directory"


def test_multirun_writes_summary_of_its_runs(smoke_sweep) -> None:
    _, sweep = smoke_sweep
    rows = json.loads((sweep / "summary.json").read_text())
    assert [row["task"] for row in rows] == list(TASKS)
    for row in rows:
        results = json.loads((sweep / row["run"] / "results.json").read_text())
        # The summary's row is the job's results.json less its nested parts (history, explanation).
        assert {k: v for k, v in row.items() if k != "run"} == {
            k: v for k, v in results.items() if k not in NESTED_KEYS}
    table = (sweep / "summary.md").read_text().splitlines()
    assert table[0].startswith("| run | task | model | schedule | stages | chunks |")
    assert len(table) == 2 + len(TASKS)


def test_sweep_over_schedules_equals_one_process_and_survives_a_bad_job(tmp_path: Path) -> None:
    """gpipe and 1f1b on 2 processes with 2 micro-batches train exactly as one process does: the same batches
    (the loader's own seeded shuffle: use_distributed_sampler=false), no dropout; every weight of the checkpoint
    after 2 Adam steps (each moves every weight by ~lr=2e-3) to 1e-5, and the same validation accuracy. The
    sweep's refused job (pipedream with chunks=2) is named in the summary and the exit status."""
    same = ["experiment=smoke_image", "model.dropout=0.0", "trainer.use_distributed_sampler=false",
            "trainer.enable_checkpointing=true", "trainer.default_root_dir=${hydra:runtime.output_dir}"]
    # pipedream with chunks=2 is refused: that job fails and the others still run (the sweep exits with 1).
    proc = train(["-m", *same, "strategy.schedule=pipedream,1f1b,gpipe", "strategy.chunks=2",
                  f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, expect_ok=False)
    assert proc.returncode == 1
    bad = [d for key, d in job_dirs(tmp_path / "sweep").items() if "strategy.schedule=pipedream," in key]
    failed = json.loads((bad[0] / "results.json").read_text())
    assert failed["error"].startswith("ValueError: schedule='pipedream' runs each batch as one PipeDream minibatch")
    assert (failed["schedule"], failed["chunks"], failed["metric"]) == ("pipedream", 2, None)
    assert "1 job(s) failed:\n  job 0: ValueError: schedule='pipedream'" in proc.stderr
    train([*same, "strategy=auto", "trainer.devices=1", f"hydra.run.dir={tmp_path / 'one'}"], cwd=tmp_path)
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    assert (one["schedule"], one["stages"]) == ("auto", 1)
    checkpoint = Path("checkpoints") / "epoch=0-step=2.ckpt"
    want = torch.load(tmp_path / "one" / checkpoint, weights_only=False, map_location="cpu")["state_dict"]
    runs = job_dirs(tmp_path / "sweep")
    for schedule in ("1f1b", "gpipe"):
        (run_dir,) = [d for key, d in runs.items() if f"strategy.schedule={schedule}," in key]
        results = json.loads((run_dir / "results.json").read_text())
        check_results(results, "image", schedule, 2)
        assert results["metric"] == pytest.approx(one["metric"], abs=1e-6)
        got = torch.load(run_dir / checkpoint, weights_only=False, map_location="cpu")["state_dict"]
        assert list(got) == list(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{schedule} {key}: {m}")
    summary = json.loads((tmp_path / "sweep" / "summary.json").read_text())
    assert [(row["schedule"], row["chunks"]) for row in summary] == [("pipedream", 2), ("1f1b", 2), ("gpipe", 2)]
    assert [row["error"] is None for row in summary] == [False, True, True]
    assert "summary of" in proc.stdout


# task -> (overrides that turn all dropout off, micro-batches). translation runs 1 micro-batch: its loss is the mean
# over non-padding tokens of each micro-batch, so 2 micro-batches with 63 and 53 such tokens weight them unlike one
# batch of 116 (~6e-3 apart after 2 steps). language_model too: with 2, one weight whose first gradient (~2e-9) is
# below Adam's eps=1e-8 turns float rounding of the micro-batch sum into a 2.5e-6 step difference.
# translation is left out to keep the suite under its 10 minutes: video_captioning has the same encoder-decoder
# recipe shape (and runs 2 micro-batches); translation's smallest config runs in the smoke sweep above.
SEQUENCE_RUNS = {
    "language_model": (["model.dropoute=0.0", "model.dropouti=0.0", "model.dropouth=0.0", "model.dropout=0.0",
                        "model.wdrop=0.0"], 1),
    "video_captioning": (["model.dropout=0.0"], 2),
}


@pytest.mark.parametrize("task", list(SEQUENCE_RUNS))
def test_sequence_recipe_on_two_processes_equals_one_process(tmp_path: Path, task: str) -> None:
    """The task's smallest config under 1f1b on 2 processes trains exactly as on one process (strategy=auto): the
    same batches (use_distributed_sampler=false), no dropout; every checkpoint weight after 2 Adam steps to 1e-5
    and the same validation metric. The language model's samples (sampled at temperature 1 with a fixed seed: after
    2 steps greedy decoding repeats one character) are the same text decoded through the pipeline's ring as on one
    device."""
    no_dropout, chunks = SEQUENCE_RUNS[task]
    samples = ["task.samples.temperature=1.0"] if task == "language_model" else []
    same = [f"experiment=smoke_{task}", *no_dropout, *samples, "trainer.use_distributed_sampler=false",
            "trainer.enable_checkpointing=true", "trainer.default_root_dir=${hydra:runtime.output_dir}"]
    train([*same, "strategy.schedule=1f1b", f"strategy.chunks={chunks}", f"hydra.run.dir={tmp_path / 'two'}"],
          cwd=tmp_path)
    train([*same, "strategy=auto", "trainer.devices=1", f"hydra.run.dir={tmp_path / 'one'}"], cwd=tmp_path)
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    assert (one["task"], one["schedule"], one["stages"]) == (task, "auto", 1)
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    check_results(two, task, "1f1b", chunks)
    assert two["metric"] == pytest.approx(one["metric"], rel=1e-5, abs=1e-6)
    checkpoint = Path("checkpoints") / "epoch=0-step=2.ckpt"
    want = torch.load(tmp_path / "one" / checkpoint, weights_only=False, map_location="cpu")["state_dict"]
    got = torch.load(tmp_path / "two" / checkpoint, weights_only=False, map_location="cpu")["state_dict"]
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{task} {key}: {m}")
    if samples:
        one_text, two_text = ((tmp_path / run / "samples.txt").read_text().splitlines() for run in ("one", "two"))
        assert one_text[0] == "samples after epoch 0 (step 2), decoded on one device:"
        assert two_text[0] == "samples after epoch 0 (step 2), decoded through the pipeline's decode ring (2 stages):"
        assert len(one_text) == 4 and two_text[1:] == one_text[1:]
        continuations = [line.split(" -> ")[1] for line in one_text[1:]]
        assert len(set(continuations)) == 3 and all(len(ast.literal_eval(c)) >= 48 for c in continuations)


def test_pipedream_recipe_follows_the_rule(tmp_path: Path) -> None:
    """The image recipe under pipedream on 2 processes equals PipeDream's rule in one process
    (tests/helpers/pipedream_reference.py) on the same model, batches and Adam: every checkpoint weight to 1e-5.
    Stage 0 computes the second minibatch's gradient at stale weights: ~3e-3 away from synchronous training."""
    train(["experiment=smoke_image", "model.dropout=0.0", "trainer.use_distributed_sampler=false",
           "trainer.enable_checkpointing=true", "trainer.default_root_dir=${hydra:runtime.output_dir}",
           "strategy.balance=[6,4]", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    check_results(results, "image", "pipedream", 1)
    got = torch.load(tmp_path / "run" / "checkpoints" / "epoch=0-step=2.ckpt", weights_only=False,
                     map_location="cpu")["state_dict"]
    # what recipes/train.py builds for experiment=smoke_image (seed 0, batch 16, width 4), in the same order
    L.seed_everything(0, verbose=False)
    datamodule = build_datamodule("digits", "image", seed=0, batch_size=16, val_fraction=0.2)
    datamodule.setup("fit")
    layers = build_model("digits_cnn", "image", width=4, dropout=0.0, **datamodule.model_kwargs())
    rule = PipeDreamRule(layers, [6, 4], lambda params: torch.optim.Adam(params, lr=0.002),
                         torch.nn.functional.cross_entropy, lambda t: {})
    data = [batch for _, batch in zip(range(2), datamodule.train_dataloader())]
    rule.segment([Minibatch(t, x, y) for t, (x, y) in enumerate(data)])
    want = rule.state_dict("layers.", [str(i) for i in range(len(layers))])
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_main_job_defaults_train_digits_to_90_percent(tmp_path: Path) -> None:
    """`python recipes/train.py` with no task arguments: the plan, per-epoch accuracy and throughput, >= 90%."""
    proc = train([f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=180)  # a hang fails at 180 s
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    check_results(results, "image", "pipedream", 1)
    assert results["metric"] >= 0.9 and results["time_to_target_s"] is not None  # target: 95%
    out = proc.stdout
    assert "pipeline: 2 stages, layers per stage" in out and "stage 1: layers" in out
    assert "time per minibatch: predicted" in out and "measured" in out and "where the gap went" in out
    # The table's parts add up to the gap between the plan's time per minibatch and the measured step.
    explanation = results["explanation"]
    assert sum(explanation["parts_s"].values()) == pytest.approx(explanation["gap_s"], rel=1e-9, abs=1e-12)
    assert len(explanation["stages"]) == 2 and all(s["compute"] > 0 for s in explanation["stages"])
    epochs = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 10 and all("val_acc=" in line and "samples/s" in line for line in epochs)


def test_reproduction_sweep_writes_curves_and_table(tmp_path: Path) -> None:
    """`train.py -m experiment=paper_image` at its smallest (2 contenders, 1 seed, 2 epochs): each job's history,
    and the sweep's reproduction table, CSV and PNG. DDP reads half of each global batch per process and 1f1b the
    whole batch on each stage: with dropout off both take the same updates on the same samples, so their held-out
    accuracy after each epoch agrees (to one of the 359 validation digits: float rounding may flip a close call)."""
    sweep = tmp_path / "sweep"
    proc = train(["-m", "experiment=paper_image", "contender=ddp,1f1b", "seed=0", "trainer.max_epochs=2",
                  "model.dropout=0.0", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    runs = {json.loads((d / "results.json").read_text())["contender"]: json.loads((d / "results.json").read_text())
            for d in job_dirs(sweep).values()}
    assert set(runs) == {"ddp", "1f1b"}
    assert (runs["ddp"]["schedule"], runs["1f1b"]["schedule"], runs["1f1b"]["chunks"]) == ("ddp", "1f1b", 4)
    ddp, pipe = runs["ddp"]["history"], runs["1f1b"]["history"]
    assert [e["epoch"] for e in ddp] == [e["epoch"] for e in pipe] == [0, 1]
    assert [e["step"] for e in ddp] == [e["step"] for e in pipe] == [22, 44]  # 1,438 digits / 64 per update
    assert [e["samples"] for e in ddp] == [e["samples"] for e in pipe] == [22 * 64, 44 * 64]
    for d, p in zip(ddp, pipe):
        assert abs(d["metric"] - p["metric"]) <= 1 / 359 + 1e-9
        assert 0 < d["seconds"] and 0 < d["train_seconds"] < d["seconds"]
    table = (sweep / "reproduction.md").read_text().splitlines()
    assert table[0] == "# image: digits_cnn"
    assert table[2].startswith("| contender | seeds reaching target | epochs | final val_acc (mean) |")
    assert [line.split(" | ")[0] for line in table[4:]] == ["| ddp", "| 1f1b"]  # the reference first
    with (sweep / "reproduction.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["contender"], float(r["epochs"])) for r in rows] == [("ddp", 2.0), ("1f1b", 2.0)]
    assert float(rows[0]["final_metric"]) == pytest.approx(runs["ddp"]["metric"])
    assert (sweep / "reproduction.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "comparison (reproduction.md, .csv, .png in" in proc.stdout
