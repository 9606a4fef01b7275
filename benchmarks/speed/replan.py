"""A split chosen from a wrong profile, corrected by one rerun: plan again from what a fit measured.

Run from the repository root::

    python -m benchmarks.speed.replan                  # 3 rounds, ~2 min per round on 2 busy cores: results/replan.json
    python -m benchmarks.speed.replan --rounds 1 --json /tmp/r.json

The model (``lightning_pipedream/testing/slow_layers.py``): 8 layers, each a Linear(16, 16) and a sleep of 0.25 ms
per sample in the forward (0.5 ms in the backward), so equal layers as the strategy's profiler times them (12 ms
per batch of 16); layer 1 sleeps 1.5 ms more per sample (24 ms per batch, two layers' worth) from the train start
on, after the profiling. Two CPU processes, ``pipedream`` (its steady state is the slowest stage's time, the
partitioner's model), 32 batches of 16; sleeping rather than computing keeps the layers' costs what they are said to
be on a machine whose cores are busy (a sleeping rank leaves the cores to the others). The profile's even 4-4 split
runs 72 ms against 48; stage 0's compute measured 1.5x its profile, its layers scaled so, the partitioner gives it
3 layers: 36 + 24 ms against 60, if the sleeps keep their time.

Each round, in one process after another:

1. ``profiled``: ``PipeDreamStrategy(trace=...)`` profiles the layers on the first batch, plans (an even 4-4 split:
   the profile sees equal layers) and trains; the merged trace keeps the plan and every stage's measured means;
2. the plan again from that trace (``plan.explain.replan``: each layer's profiled time scaled by its stage's measured
   compute over its predicted, PipeDream's partitioner again; what ``python -m lightning_pipedream plan
   --from-trace`` does);
3. ``replanned``: the same fit with ``plan=`` that plan.

Figures per round: each fit's layers per stage, its mean step (the slowest stage's, all of it: the pipeline, the
update, Lightning's work) and each stage's compute, and the ratio ``replanned / profiled`` of the mean steps; their
medians over the rounds. The explanation of the profiled fit (``strategy.explanation``) is kept too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SPEC = {"layers": 8, "per_sample_s": 0.00025, "slow_layer": 1, "extra_s": 0.0015, "batch": 16, "chunks": 1,
        "batches": 32, "schedule": "pipedream", "devices": 2}


def fit(out: str, plan: str | None) -> None:
    """One fit (every rank runs this: Lightning's launcher re-runs the command); rank 0 writes ``result.json``."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipedream import PipeDreamStrategy
    from lightning_pipedream.testing.slow_layers import arm, sleepy_layers

    class Sleepy(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = sleepy_layers(SPEC["layers"], SPEC["per_sample_s"], SPEC["slow_layer"], SPEC["extra_s"])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_train_start(self) -> None:
            arm(self)  # after the strategy profiled the layers

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    n = SPEC["batch"] * SPEC["batches"]
    data = TensorDataset(torch.randn(n, 8), torch.randint(0, 4, (n,)))
    strategy = PipeDreamStrategy(schedule=SPEC["schedule"], chunks=SPEC["chunks"], plan=plan,
                                 trace=os.path.join(out, "trace"), trace_steps=(4, 2))
    trainer = L.Trainer(accelerator="cpu", devices=SPEC["devices"], strategy=strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(Sleepy(), DataLoader(data, batch_size=SPEC["batch"]))
    if trainer.global_rank == 0:
        explanation = trainer.strategy.explanation
        Path(out, "result.json").write_text(json.dumps({
            "balance": trainer.strategy.balance,
            "explanation": None if explanation is None else explanation.to_json(),
        }))


def _run_fit(out: Path, plan: Path | None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "benchmarks.speed.replan", "--fit", str(out)]
    if plan is not None:
        command += ["--plan", str(plan)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"the fit in {out} failed:\n{done.stderr[-4000:]}")
    result = json.loads((out / "result.json").read_text())
    e = result["explanation"]
    result["step_s"] = e["measured_s"]
    result["stage_compute_s"] = [s["compute"] for s in e["stages"]]
    result["stage_step_s"] = [s["step"] for s in e["stages"]]
    return result


def one_round(work: Path) -> dict[str, Any]:
    from lightning_pipedream.plan.explain import from_trace, replan

    profiled = _run_fit(work / "profiled", None)
    plan, measured = from_trace(json.loads((work / "profiled" / "trace" / "pipeline_trace.json").read_text()))
    again = replan(plan, measured)
    again.save(work / "replanned.json")
    replanned = _run_fit(work / "replanned", work / "replanned.json")
    keep = ("balance", "step_s", "stage_compute_s", "stage_step_s")
    return {"profiled": {k: profiled[k] for k in keep}, "replanned": {k: replanned[k] for k in keep},
            "replanned_predicted_s": again.time_per_minibatch,
            "step_ratio_replanned_over_profiled": replanned["step_s"] / profiled["step_s"],
            "profiled_explanation": profiled["explanation"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "replan.json"))
    parser.add_argument("--fit", help=argparse.SUPPRESS)  # one fit into this directory (run by the driver)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit:
        fit(args.fit, args.plan)
        return
    load_before = os.getloadavg()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            rounds.append(one_round(Path(tmp) / f"round{r}"))
            summary = {k: v for k, v in rounds[-1].items() if k != "profiled_explanation"}
            print(json.dumps(summary), flush=True)
    result = {
        "command": "python -m benchmarks.speed.replan " + " ".join(sys.argv[1:]),
        "cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(), "spec": SPEC,
        **summary_of(rounds),
        "rounds": rounds,
    }
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary_of(rounds)))


def summary_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds: each fit's mean step and its slowest stage's compute (the bottleneck the split
    decides), and the rounds' ratios replanned / profiled of both."""
    kinds = ("profiled", "replanned")
    return {
        "median_step_s": {k: statistics.median(r[k]["step_s"] for r in rounds) for k in kinds},
        "median_bottleneck_compute_s": {k: statistics.median(max(r[k]["stage_compute_s"]) for r in rounds)
                                        for k in kinds},
        "median_step_ratio_replanned_over_profiled": statistics.median(
            r["step_ratio_replanned_over_profiled"] for r in rounds),
        "median_bottleneck_ratio_replanned_over_profiled": statistics.median(
            max(r["replanned"]["stage_compute_s"]) / max(r["profiled"]["stage_compute_s"]) for r in rounds),
        "balances": [[r["profiled"]["balance"], r["replanned"]["balance"]] for r in rounds],
    }


if __name__ == "__main__":
    main()
