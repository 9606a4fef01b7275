"""The memory model for a model built on the meta device: each rank's predicted peak against its measured one.

Run from the repository root::

    python -m benchmarks.memory.meta_memory              # ~3 min on 2 cores: results/meta_memory.json
    python -m benchmarks.memory.meta_memory --quick      # the test's small Llama, one schedule

A Hugging Face Llama (hidden 256, 8 layers, vocabulary 2048: 27 MB of fp32 weights) is built in
``configure_model`` (on the meta device under the strategy, no pretrained weights: each stage initialized alone) and
trained by 4 CPU processes with Adam on batches of 8 sequences of 128 tokens, through the graph path: the split and
the prediction come from the meta model's shapes (``graph/estimate.py``: a FLOP estimate, and what autograd saves
and each backward holds found on fake tensors), never from weights. Per schedule (fixed ones, and
``schedule="auto"``), every rank's prediction (``StageMemory``: weights, gradients, optimizer state, activations in
flight, the backward's and the step's working sets) is compared with the live tensor bytes of its second training
step (``LiveTensorBytes``: every storage an operator returns, the quantity ``torch.cuda.max_memory_allocated`` gives
on a GPU), measured by ``tests/scripts/meta_trainer.py``.
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

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "meta_trainer.py"
SIZES = {  # vocabulary, hidden, intermediate, layers, heads, key-value heads; batches, batch size, sequence length
    "default": ((2048, 256, 1024, 8, 8, 2), (3, 8, 128)),
    "quick": ((256, 64, 256, 4, 4, 2), (3, 8, 64)),
}
SCHEDULES = {
    "default": {"1f1b": {"schedule": "1f1b", "chunks": 4}, "gpipe": {"schedule": "gpipe", "chunks": 4},
                "zb-h1": {"schedule": "zb-h1", "chunks": 4}, "auto (exact)": {"schedule": "auto", "exact": True}},
    "quick": {"1f1b": {"schedule": "1f1b", "chunks": 2}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the test's small Llama, one schedule")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "meta_memory.json")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    size = "quick" if args.quick else "default"
    from transformers import LlamaConfig

    (vocab, hidden, intermediate, layers, heads, kv), (batches, batch, length) = SIZES[size]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                         max_position_embeddings=length)
    result: dict = {"command": "python -m benchmarks.memory.meta_memory" + (" --quick" if args.quick else ""),
                    "model": config.to_dict() | {"batch": [batch, length]}, "processes": 4, "optimizer": "adam",
                    "when": time.strftime("%Y-%m-%d %H:%M"), "load_before": os.getloadavg(), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(f"{tmp}/config")
        names = list(SCHEDULES[size])
        runs = [[f"{tmp}/run{i}", {"config_dir": f"{tmp}/config", "devices": 4, "data": [vocab, batches, batch, length],
                                   "lr": 1e-3, "epochs": 1, "optimizer": "adam", "measure_step": 1,
                                   "strategy": SCHEDULES[size][name]}] for i, name in enumerate(names)]
        Path(f"{tmp}/runs.json").write_text(json.dumps(runs))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, str(SCRIPT), "--runs", f"{tmp}/runs.json"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise SystemExit(f"the runs failed:\n{proc.stderr[-4000:]}")
        result["seconds"] = round(time.perf_counter() - started, 1)
        for i, name in enumerate(names):
            ranks = []
            for rank in range(4):
                data = json.loads(Path(f"{tmp}/run{i}/memory{rank}.json").read_text())
                # one prediction per stage: schedule="auto" may choose data-parallel pipelines (a stage on 2 ranks)
                predicted, measured = data["predicted"][data["ran"]["stage"]], data["step"]
                ranks.append({"rank": rank, "ran": data["ran"], "predicted": predicted, "measured": measured,
                              "ratio": measured["peak_tensor_bytes"] / predicted["predicted_peak_bytes"]})
                print(f"{name:13s} rank {rank}: predicted {predicted['predicted_peak_bytes'] / 2**20:7.2f} MiB "
                      f"(activations {predicted['activations'] / 2**20:6.2f}, {predicted['held']} in flight), "
                      f"measured {measured['peak_tensor_bytes'] / 2**20:7.2f} MiB in {measured['peak_phase']}: "
                      f"{ranks[-1]['ratio']:.3f}")
            result["runs"][name] = ranks
        plan = [line for line in (proc.stdout + proc.stderr).splitlines() if "auto plan (" in line]
        result["auto_choice"] = plan
    write_result(args.json, result)


if __name__ == "__main__":
    main()
