"""Trainer(strategy=PipeDreamStrategy) on models that are not one nn.Sequential: split from the traced forward graph.

Each family of tests/scripts/graph_models.py, wrapped in a LightningModule (tests/scripts/graph_trainer.py),
trains in a subprocess on 2 or 3 processes; the consolidated checkpoint must equal one-device training
(every parameter and buffer, 1e-5) and carry exactly the module's own state_dict keys.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from graph_trainer import FamilyModule
from script_runs import run_script

from lightning_pipedream import PipeDreamStrategy

SCRIPT = Path(__file__).parent / "scripts" / "graph_trainer.py"


def run(out: Path, options: dict, expect_ok: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_script(SCRIPT, out, options, timeout, expect_ok)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=False, map_location="cpu")["state_dict"]


CASES = {
    # family: (processes, strategy, model options)
    "gpt": (3, {"schedule": "gpipe", "chunks": 2, "split_points": ["model.blocks.1", "model.blocks.3"]}, {}),
    "resnet": (2, {"schedule": "1f1b", "chunks": 1}, {"lr": 0.01}),  # split points from profiling; BatchNorm
    "transformer": (2, {"schedule": "gpipe", "chunks": 1}, {}),  # two inputs, masks, one shared embedding
    "lstm": (3, {"schedule": "1f1b", "chunks": 2}, {}),  # profiled split points; decoder tied to the embedding
    # A forward with a branch on a value cannot be traced; split points inside self.model make it train.
    "lstm_untraceable": (2, {"schedule": "1f1b", "chunks": 2, "split_points": ["model.rnn2"]}, {}),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Every family on one device and as a pipeline; the runs of one process count share one launch."""
    base = tmp_path_factory.mktemp("graph")
    runs: dict[int, list] = {1: [], 2: [], 3: []}
    for case, (processes, strategy, model) in CASES.items():
        family, _, untraceable = case.partition("_")
        common = {"family": family, "model": model, "limit_val_batches": 1, "untraceable": bool(untraceable)}
        runs[1].append([str(base / case / "single"), common])
        runs[processes].append([str(base / case / "pipe"), {**common, "devices": processes, "strategy": strategy}])
    for processes, group in runs.items():
        if group:
            (base / f"runs{processes}.json").write_text(json.dumps(group))
            run(base, {"--runs": str(base / f"runs{processes}.json")})
    return base


@pytest.mark.parametrize("family", sorted(CASES))
def test_training_equals_one_device(trained, family):
    single, pipe = trained / family / "single", trained / family / "pipe"
    got, want = weights(pipe / "final.ckpt"), weights(single / "final.ckpt")
    assert list(got) == list(want)  # the module's own keys, in its order: tied names and BatchNorm buffers too
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    metrics = [json.loads((d / "metrics.json").read_text()) for d in (pipe, single)]
    assert metrics[0]["val_loss"] == pytest.approx(metrics[1]["val_loss"], rel=1e-5)  # an eval-mode capture
    if family == "gpt":  # the output projection tied to the embedding: one tensor under both names
        assert torch.equal(got["model.head.weight"], got["model.tok.weight"])
    # The checkpoint loads without the strategy.
    FamilyModule.load_from_checkpoint(pipe / "final.ckpt", map_location="cpu")


def test_pipedream_refuses_weights_tied_across_stages(tmp_path):
    proc = run(tmp_path, {"family": "lstm", "devices": 2, "strategy": {"schedule": "pipedream",
                                                                    "split_points": ["model.rnn2"]}},
               expect_ok=False)
    assert proc.returncode != 0
    assert ("Parameters ['model.emb.weight'] are used on several stages (tied weights); under schedule='pipedream' "
            "the stages apply their copies' gradients at different steps") in proc.stderr


def test_an_untraceable_model_gets_the_way_out(tmp_path):
    proc = run(tmp_path, {"family": "lstm", "untraceable": True, "strategy": {"schedule": "1f1b"}}, expect_ok=False)
    assert proc.returncode != 0
    assert "GraphCaptureError" in proc.stderr and "graph_trainer.py" in proc.stderr  # names the user's line
    assert ("Move the branch out of forward (into training_step, say); or name where stages begin, "
            "PipeDreamStrategy(split_points=['model.layers.4', ...]): then only the innermost module holding them "
            "that the step calls is traced") in proc.stderr


def test_layers_and_split_points_are_exclusive():
    with pytest.raises(ValueError, match="takes layers= .* or split_points= .*, not both"):
        PipeDreamStrategy(layers="layers", split_points=["layers.2"])
