"""Peak host memory per rank when a 1 GB model is built whole on every rank or per stage (configure_model).

Run from the repository root::

    python -m benchmarks.big_models.stage_memory                     # ~2 min: results/stage_memory.json
    python -m benchmarks.big_models.stage_memory --quick --json /tmp/quick.json   # a 16 MB model, ~30 s

The model is one ``nn.Sequential`` of ``layers`` x ``Linear(width, width)`` (16 x 4096 x 4096 fp32:
1.07 GB of weights), trained for 2 steps under ``PipeDreamStrategy(schedule="1f1b", chunks=2)`` on
2 CPU processes with plain SGD (no optimizer state), in two ways, each in fresh processes:

* ``whole``: the LightningModule builds its layers in ``__init__`` (every rank holds the whole model
  until the strategy keeps its stage);
* ``per_stage``: it builds them in ``configure_model``, which the strategy runs on the meta device
  and then materializes only the rank's own stage (``lightning_pipedream.runtime.stages.materialize``).

Per rank: ``peak_setup_mb`` is the peak resident memory (VmHWM) up to the start of training
(construction and the strategy's setup), ``peak_train_mb`` the peak at the end (weights + gradients
+ activations), ``baseline_mb`` the resident memory before the model exists (torch and Lightning
themselves), and ``stage_weights_mb`` the bytes of the parameters the rank holds when training.
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

from benchmarks.common.figures import write_result
from benchmarks.common.proc_memory import status_mb

ROOT = Path(__file__).resolve().parents[2]
MODES = ("whole", "per_stage")


def _worker(spec: dict) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipedream import PipeDreamStrategy

    torch.set_num_threads(1)
    baseline = status_mb("VmRSS")  # torch and Lightning imported, no model yet
    width, layers, out = spec["width"], spec["layers"], Path(spec["out"])

    class Wide(L.LightningModule):
        def __init__(self, per_stage: bool) -> None:
            super().__init__()
            self.layers = None if per_stage else self._build()

        def _build(self) -> nn.Sequential:
            return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def configure_model(self) -> None:
            if self.layers is None:
                self.layers = self._build()

        def forward(self, x):
            return self.layers(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    class Measure(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.setup_peak = status_mb("VmHWM")

        def on_train_end(self, trainer, pl_module):
            weights = sum(p.numel() * p.element_size() for p in pl_module.parameters()) / 2**20
            result = {"rank": trainer.global_rank, "baseline_mb": baseline, "peak_setup_mb": self.setup_peak,
                      "peak_train_mb": status_mb("VmHWM"), "stage_weights_mb": weights,
                      "balance": trainer.strategy.balance}
            (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))

    torch.manual_seed(0)
    model = Wide(spec["mode"] == "per_stage")
    data = TensorDataset(torch.randn(16, width), torch.randn(16, width))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=PipeDreamStrategy(schedule="1f1b", chunks=2, balance=spec["balance"]),
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Measure()], use_distributed_sampler=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=8))


def _run(mode: str, width: int, layers: int, timeout: float) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"mode": mode, "width": width, "layers": layers, "out": tmp,
                "balance": [layers // 2, layers - layers // 2]}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run([sys.executable, "-m", "benchmarks.big_models.stage_memory", "--worker",
                               json.dumps(spec)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a 16 MB model (smoke run)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "stage_memory.json")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    width, layers = (1024, 4) if args.quick else (4096, 16)
    weights_mb = layers * (width * width + width) * 4 / 2**20
    result: dict = {"model": f"{layers} x Linear({width}, {width}), fp32", "weights_mb": weights_mb,
                    "largest_layer_mb": (width * width + width) * 4 / 2**20, "processes": 2,
                    "when": time.strftime("%Y-%m-%d %H:%M"), "load_before": os.getloadavg(), "runs": {}}
    for mode in MODES:
        ranks = _run(mode, width, layers, args.timeout)
        result["runs"][mode] = ranks
        for r in ranks:
            print(f"{mode:10s} rank {r['rank']}: peak after setup {r['peak_setup_mb']:8.0f} MB, peak training "
                  f"{r['peak_train_mb']:8.0f} MB, baseline {r['baseline_mb']:5.0f} MB, stage weights "
                  f"{r['stage_weights_mb']:7.0f} MB")
    write_result(args.json, result)


if __name__ == "__main__":
    main()
