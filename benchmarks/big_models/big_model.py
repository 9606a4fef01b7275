"""A pretrained Hugging Face Llama fine-tuned on 4 CPU processes, built on the meta device and loaded per stage.

Run from the repository root::

    python -m benchmarks.big_models.big_model            # a 0.8 GB model, a few minutes: results/big_model.json
    python -m benchmarks.big_models.big_model --big  # an ~8 GB model (the issue's size: a third of a 24 GB machine)
    python -m benchmarks.big_models.big_model --big --whole  # and the whole-model path at that size (~17 GB in all)

The model is saved with ``save_pretrained`` (sharded safetensors and their index) to a temporary directory, then:

* ``from_pretrained``: one process loads it whole, as a user would before the strategy splits it: the load's
  wall time and the resident peak above the process's imports;
* ``per_stage``: a LightningModule builds it in ``configure_model`` (on the meta device under the strategy) and
  ``PipeDreamStrategy(schedule="1f1b", chunks=2, pretrained=DIR)`` gives each of 4 ranks its own stage, read
  from the files that hold it; 3 SGD steps. Per rank: ``setup_s`` (trace, split, materialize and read, up to
  the first step), ``read_s`` (materializing and reading the stage alone), ``peak_before_first_step_mb`` and
  ``peak_training_mb`` above the imports (torch.export's first-trace imports included), ``stage_weights_mb``, then
  ``trainer.save_checkpoint`` of a sharded checkpoint (each rank its stage's weights and SGD state):
  ``save_s`` and ``peak_saving_mb``, the resident peak during the save above the resident size before it; then a
  single-file save (``checkpoint="auto"``, the model being under 1 GiB), written on rank 0 stage by stage:
  ``full_save_s`` and ``peak_full_save_mb`` (goal on rank 0: at most the largest stage's weights and optimizer state);
* ``skeleton``: the same run on the same architecture (layers, heads' layout) at a width of 64 and a vocabulary of 256,
  whose weights are negligible: each rank's peak before the first step there is the fixed overhead (the trace and its
  graph, the planner's tables, Lightning's and gloo's buffers), and the goal for the real model is a peak of at most
  1.25x the rank's own parameter bytes plus that overhead (``peak_over_goal`` per rank: under 1 meets it);
* ``whole_model`` (at the default size, and with ``--big --whole``; ``--no-whole`` skips it): the path a user takes
  without the meta device, ``from_pretrained`` in the LightningModule's ``__init__`` and
  ``PipeDreamStrategy(schedule="1f1b", chunks=2)`` without ``pretrained=``: every rank's peaks, where rank 0
  profiles the whole model. ``--big`` alone also quotes what rank 0 would need by the default run's ratio.
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

from benchmarks.common.proc_memory import reset_peak_rss, status_mb

ROOT = Path(__file__).resolve().parents[2]
SIZES = {  # hidden, intermediate, layers, vocabulary
    "default": (1024, 4096, 12, 8192),
    "big": (2048, 8192, 30, 32000),
}
GOAL_FACTOR = 1.25  # the peak before the first step: at most this times the rank's own parameters, plus the overhead


def _config(size: str, skeleton: bool = False):  # noqa: ANN202 - transformers is imported lazily
    from transformers import LlamaConfig

    hidden, intermediate, layers, vocab = SIZES[size]
    heads, kv_heads = hidden // 64, hidden // 256
    if skeleton:  # the same layers and heads, negligible weights: what a rank holds besides its parameters
        hidden, intermediate, vocab = 4 * heads, 16 * heads, 256
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=128)


def _save(size: str, directory: str, skeleton: bool = False) -> float:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(size, skeleton))
    model.to_empty(device="cpu")
    with torch.no_grad():  # values do not matter to memory or time; normal_ is cheaper than the full init
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(directory, max_shard_size="500MB")
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def _from_pretrained(directory: str) -> dict:
    import lightning  # noqa: F401 - the same imports as a rank
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    base = status_mb("VmRSS")
    reset_peak_rss()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(directory)
    sum(float(p.sum()) for p in model.parameters())  # touch every weight (a lazy mapping is not a load)
    return {"load_s": time.perf_counter() - started, "peak_mb": status_mb("VmHWM") - base}


def _per_stage(spec: dict) -> None:
    import lightning as L
    import torch

    from lightning_pipedream import PipeDreamStrategy

    torch.set_num_threads(1)
    torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),), strict=False).run_decompositions({})
    directory, out, whole = spec["dir"], Path(spec["out"]), spec.get("whole", False)

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None
            if whole:  # the whole-model path: every rank loads all of it before the strategy splits it
                from transformers import AutoModelForCausalLM

                self.model = AutoModelForCausalLM.from_pretrained(directory)

        def configure_model(self) -> None:
            if self.model is None:
                from transformers import AutoConfig, AutoModelForCausalLM

                self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))

        def forward(self, ids):  # the strategy pipelines the call self(...)
            return self.model(ids, use_cache=False).logits

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            logits = self(ids)
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    class Measure(L.Callback):
        def __init__(self) -> None:
            self.base, self.started = status_mb("VmRSS"), time.perf_counter()
            reset_peak_rss()
            self.first: dict | None = None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if self.first is None:
                self.first = {"setup_s": time.perf_counter() - self.started,
                              "peak_before_first_step_mb": status_mb("VmHWM") - self.base}

        def on_train_end(self, trainer, module):
            stage, graph = trainer.strategy._pipeline.stage, trainer.strategy._pipeline.graph
            self.result = {"rank": trainer.global_rank, **(self.first or {}),
                           "read_s": graph.weights.read_s if graph is not None and graph.weights else None,
                           "peak_training_mb": status_mb("VmHWM") - self.base,
                           "stage_weights_mb": sum(p.numel() * p.element_size() for p in stage.parameters()) / 2**20}

    class Batches:
        def __init__(self) -> None:
            generator = torch.Generator().manual_seed(0)
            self.items = [(torch.randint(0, spec["vocab"], (4, 64), generator=generator),) for _ in range(3)]

        def __len__(self) -> int:
            return len(self.items)

        def __iter__(self):
            return iter(self.items)

    measure = Measure()
    options = {} if whole else {"pretrained": directory, "checkpoint": "sharded"}
    trainer = L.Trainer(accelerator="cpu", devices=4, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[measure], strategy=PipeDreamStrategy(schedule="1f1b", chunks=2, **options))
    trainer.fit(FineTune(), Batches())
    result = measure.result
    if not whole:  # a sharded save: each rank writes its own stage; its peak above what it held before
        before = status_mb("VmRSS")
        reset_peak_rss()
        started = time.perf_counter()
        trainer.save_checkpoint(f"{spec['out']}/saved.ckpt")
        result.update(save_s=time.perf_counter() - started, peak_saving_mb=status_mb("VmHWM") - before)
        # one file (checkpoint="auto" under 1 GiB): rank 0 writes it, receiving one stage's tensors after another
        trainer.strategy.checkpoints.mode = "auto"
        single = "full" if not trainer.strategy.checkpoints.sharded else "sharded"
        before = status_mb("VmRSS")
        reset_peak_rss()
        started = time.perf_counter()
        trainer.save_checkpoint(f"{spec['out']}/single.ckpt")
        result.update(full_save_form=single, full_save_s=time.perf_counter() - started,
                      peak_full_save_mb=status_mb("VmHWM") - before)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _python(args: list[str], timeout: float) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.big_models.big_model", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{args[0]} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    parser.add_argument("--big", action="store_true", help="an ~8 GB model (the issue's size)")
    parser.add_argument("--no-whole", action="store_true", help="skip the whole-model path")
    parser.add_argument("--whole", action="store_true", help="run the whole-model path with --big too (needs memory)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    if args.worker:
        _per_stage(json.loads(args.worker))
        return
    if args.load:
        print(json.dumps(_from_pretrained(args.load)))
        return
    size = "big" if args.big else "default"
    out_json = args.json or ROOT / "benchmarks" / "results" / f"big_model{'_big' if args.big else ''}.json"
    with tempfile.TemporaryDirectory() as tmp:
        weights_mb = _save(size, f"{tmp}/hf")
        loaded = json.loads(_python(["--load", f"{tmp}/hf"], args.timeout).strip().splitlines()[-1])
        (Path(tmp) / "out").mkdir()
        spec = {"dir": f"{tmp}/hf", "out": f"{tmp}/out", "vocab": SIZES[size][3]}
        _python(["--worker", json.dumps(spec)], args.timeout)
        ranks = [json.loads((Path(tmp) / "out" / f"rank{r}.json").read_text()) for r in range(4)]
        _save(size, f"{tmp}/skeleton_hf", skeleton=True)
        (Path(tmp) / "skeleton").mkdir()
        _python(["--worker", json.dumps({**spec, "dir": f"{tmp}/skeleton_hf", "out": f"{tmp}/skeleton",
                                         "vocab": 256})], args.timeout)
        skeleton = [json.loads((Path(tmp) / "skeleton" / f"rank{r}.json").read_text()) for r in range(4)]
        for r, s in zip(ranks, skeleton):  # the goal: 1.25x own parameters plus the skeleton's peak (the overhead)
            r["overhead_mb"] = s["peak_before_first_step_mb"]
            r["peak_over_own"] = r["peak_before_first_step_mb"] / r["stage_weights_mb"]
            r["goal_mb"] = GOAL_FACTOR * r["stage_weights_mb"] + r["overhead_mb"]
            r["peak_over_goal"] = r["peak_before_first_step_mb"] / r["goal_mb"]
        whole, whole_error = None, None
        if (args.whole or not args.big) and not args.no_whole:
            (Path(tmp) / "whole").mkdir()
            try:
                _python(["--worker", json.dumps({**spec, "out": f"{tmp}/whole", "whole": True})], args.timeout)
                whole = [json.loads((Path(tmp) / "whole" / f"rank{r}.json").read_text()) for r in range(4)]
            except RuntimeError as err:  # what stopped it (the out-of-memory killer: a model too big for the machine)
                whole_error = str(err)[-2000:]
    result = {"model": f"Llama {SIZES[size]} (hidden, intermediate, layers, vocabulary), fp32",
              "weights_mb": weights_mb, "processes": 4, "schedule": "1f1b, chunks=2, SGD, 3 steps",
              "when": time.strftime("%Y-%m-%d %H:%M"), "load_avg": os.getloadavg(),
              "from_pretrained": loaded, "per_stage": ranks, "skeleton": skeleton,
              "goal": f"peak before the first step <= {GOAL_FACTOR} x own parameters + the skeleton's peak; rank 0's "
                      "single-file save growth <= the largest stage's weights (SGD: no state)",
              "full_save_rank0_growth_over_largest_stage": ranks[0]["peak_full_save_mb"]
              / max(r["stage_weights_mb"] for r in ranks)}
    if whole_error is not None:
        result["whole_model_error"] = whole_error
        print(f"whole-model path failed:\n{whole_error}")
    if whole is not None:
        result["whole_model"] = whole
        result["whole_model_rank0_peak_over_weights"] = whole[0]["peak_before_first_step_mb"] / weights_mb
    if args.big:  # what the whole-model path needs, by its measured ratio at the default size
        default = ROOT / "benchmarks" / "results" / "big_model.json"
        ratio = json.loads(default.read_text()).get("whole_model_rank0_peak_over_weights") if default.exists() else None
        if ratio is not None:
            result["whole_model_rank0_needs_mb_by_default_run_ratio"] = {"ratio": ratio, "mb": ratio * weights_mb}
    print(f"model {weights_mb:.0f} MB; from_pretrained on one process: {loaded['load_s']:.1f} s, peak "
          f"{loaded['peak_mb']:.0f} MB")
    for r in ranks:
        print(f"rank {r['rank']}: setup {r['setup_s']:.1f} s (materialize + read {r['read_s']:.1f} s), peak before "
              f"first step {r['peak_before_first_step_mb']:.0f} MB, training {r['peak_training_mb']:.0f} MB, "
              f"stage weights {r['stage_weights_mb']:.0f} MB ({r['peak_over_own']:.2f}x; goal {r['goal_mb']:.0f} MB "
              f"with the skeleton's {r['overhead_mb']:.0f} MB: {r['peak_over_goal']:.2f}); sharded save "
              f"{r['save_s']:.1f} s, peak +{r['peak_saving_mb']:.0f} MB; single-file save {r['full_save_s']:.1f} s, "
              f"peak +{r['peak_full_save_mb']:.0f} MB")
    for r in whole or []:
        print(f"whole-model path, rank {r['rank']}: peak before first step {r['peak_before_first_step_mb']:.0f} MB")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1))
    print(f"wrote {out_json}")


if __name__ == "__main__":
    main()
