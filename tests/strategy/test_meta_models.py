"""Hugging Face models built on the meta device in configure_model, loaded per stage with `pretrained=`, trained on 4
processes through the Trainer: the final weights equal one process that used `from_pretrained`, and no rank holds
more than half the model before its first step; schedule="auto" chooses 2 data-parallel pipelines of 2 stages where
they are fastest. One launch runs every model (tests/scripts/meta_trainer.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from meta_trainer import TokenBatches, lm_loss
from script_runs import run_script

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "meta_trainer.py"
LR, EPOCHS = 0.05, 2
# Llama large enough (350 MiB) that a stage's weights stand above what tracing and setting up costs a process (about
# 45 MiB: the graph, its fake tensors, the modules configure_model imports); GPT-2 small
# (its tied embedding is held by the first and last stages).
MODELS = {
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=768, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=12,
        num_key_value_heads=4, max_position_embeddings=64)), [512, 2, 4, 8]),
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=32, n_layer=4, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),  # no dropout: the same steps as one process
        [128, 2, 4, 8]),
}

MEMORY_CONFIG = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
MEMORY_RUNS = {"memory_1f1b": {"schedule": "1f1b", "chunks": 2}, "memory_auto": {"schedule": "auto", "exact": True}}
# [vocabulary, batches, batch size, sequence length]; schedule="auto" chooses 2 pipelines of 2 stages (zb-h1) here,
# whose ranks hold half the model each: sequences of 96 keep their activations above the weights' terms
MEMORY_DATA = {"memory_1f1b": [256, 3, 8, 64], "memory_auto": [256, 3, 8, 96]}
# schedule="auto" on 4 processes where 2 data-parallel pipelines of 2 stages win in the simulator: the memory limit
# rules out 4 copies (each the whole model, its gradients and the all-reduce's copy: 532 KiB) and the fast links make
# the all-reduce between 2 copies of half the model cheaper than a 4-stage pipeline's bubble (the planner: zb-v on 2
# stages x 2 pipelines, 8.7 us per minibatch; one pipeline of 4 stages, 10.7 us).
AUTO_REPLICAS_CONFIG = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                                                max_position_embeddings=32)
AUTO_REPLICAS = {"schedule": "auto", "exact": True, "memory_limit": 400_000, "bandwidth": 1e11}
AUTO_REPLICAS_DATA = [128, 2, 4, 8]


def reference(model_dir: Path, data: list[int]) -> dict[str, torch.Tensor]:
    """One process: from_pretrained, then the same SGD steps on whole batches."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(EPOCHS):
        for (input_ids,) in TokenBatches(*data):
            optimizer.zero_grad()
            lm_loss(model(input_ids, use_cache=False).logits, input_ids).backward()
            optimizer.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("meta")
    runs = []
    for name, (build, data) in MODELS.items():
        torch.manual_seed(0)
        # Llama's in several files (Hugging Face's sharded layout, with its index), GPT-2's in one.
        build().save_pretrained(base / name / "hf", max_shard_size="1MB" if name == "llama" else "1GB")
        runs.append([str(base / name / "pipe"), {
            "config_dir": str(base / name / "hf"), "devices": 4, "data": data, "lr": LR, "epochs": EPOCHS,
            "strategy": {"schedule": "1f1b", "chunks": 2, "pretrained": str(base / name / "hf")}}])
    # The memory model against measurement: a Llama built on meta with no pretrained weights (its config alone), Adam
    # (its state is a term), activations that outweigh the weights: a fixed schedule, and schedule="auto".
    MEMORY_CONFIG.save_pretrained(base / "memory_config")
    for name, strategy in MEMORY_RUNS.items():
        runs.append([str(base / name), {"config_dir": str(base / "memory_config"), "devices": 4,
                                        "data": MEMORY_DATA[name], "lr": 0.01, "epochs": 1, "optimizer": "adam", "measure_step": 1,
                                        "strategy": strategy}])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(AUTO_REPLICAS_CONFIG).save_pretrained(base / "auto_replicas" / "hf")
    runs.append([str(base / "auto_replicas" / "pipe"), {
        "config_dir": str(base / "auto_replicas" / "hf"), "devices": 4, "data": AUTO_REPLICAS_DATA, "lr": LR,
        "epochs": EPOCHS, "strategy": {**AUTO_REPLICAS, "pretrained": str(base / "auto_replicas" / "hf")}}])
    (base / "runs.json").write_text(json.dumps(runs))
    proc = run_script(SCRIPT, base, {"--runs": str(base / "runs.json")}, timeout=500)
    (base / "launch.log").write_text(proc.stdout + proc.stderr)
    return base


@pytest.mark.parametrize("name", list(MODELS))
def test_meta_built_pretrained_pipeline_trains_as_from_pretrained_on_one_process(trained, name):
    expected = reference(trained / name / "hf", MODELS[name][1])
    merged: dict[str, torch.Tensor] = {}
    for rank in range(4):
        for key, value in torch.load(trained / name / "pipe" / f"stage{rank}.pt").items():
            key = key.removeprefix("model.")
            if key in merged:  # a tied weight: every holder ends equal
                torch.testing.assert_close(value, merged[key], rtol=1e-5, atol=1e-7)
            merged[key] = value
    if name == "gpt2":  # tied: the first stage's embedding and the last stage's head are one weight, trained alike
        torch.testing.assert_close(merged["lm_head.weight"], merged["transformer.wte.weight"], rtol=0, atol=0)
    assert set(merged) == set(expected)
    initial = transformers.AutoModelForCausalLM.from_pretrained(trained / name / "hf").state_dict()
    for key, value in expected.items():
        # 1e-5 of the tensor's norm (the summation orders of 2 micro-batches and of one batch differ; ~1e-7 here)
        assert (merged[key] - value).norm() <= 1e-5 * value.norm(), key
    moved = max(float((expected[k] - initial[k]).norm() / initial[k].norm()) for k in expected if "weight" in k)
    assert moved > 1e-3  # training changed the weights: equality is not two copies of the pretrained ones


def test_no_rank_holds_more_than_half_the_model_before_its_first_step(trained):
    with torch.device("meta"):  # its shapes and dtypes alone: no 350 MiB initialized to count them
        model_bytes = sum(t.numel() * t.element_size() for t in MODELS["llama"][0]().state_dict().values())
    peaks = [json.loads((trained / "llama" / "pipe" / f"memory{rank}.json").read_text())["peak_before_first_step_bytes"]
             for rank in range(4)]
    assert model_bytes > 300 * 2**20  # big enough that a whole copy would stand out
    assert max(peaks) <= model_bytes / 2, (peaks, model_bytes)


@pytest.mark.parametrize("name", list(MEMORY_RUNS))
def test_the_predicted_memory_of_each_stage_of_a_meta_built_model_is_within_10_percent_of_the_measured(trained, name):
    """Every rank's live tensor bytes over a training step (LiveTensorBytes, what torch.cuda.max_memory_allocated gives
    on a GPU) against the prediction the strategy made from the meta model's shapes (its FLOP estimate, what autograd
    saves found on fake tensors): within 10 %, as for models built whole (docs/partitioning.md)."""
    results = [json.loads((trained / name / f"memory{rank}.json").read_text()) for rank in range(4)]
    predicted = results[0]["predicted"]
    # rank 0's, on every rank; one per stage (schedule="auto" may choose data-parallel pipelines, whose replicas of a
    # stage hold alike)
    assert all(r["predicted"] == predicted for r in results) and len(predicted) == results[0]["ran"]["stages"]
    for rank, result in enumerate(results):
        expected, measured = predicted[result["ran"]["stage"]], result["step"]
        for term in ("parameters", "gradients", "optimizer_state"):  # the weights' terms: exactly
            assert measured[term] == expected[term], (rank, term)
        # activations outweigh the weights' terms: the check is of the activation model, not of the weights alone
        assert expected["activations"] > expected["parameters"] + expected["gradients"] + expected["optimizer_state"]
        ratio = measured["peak_tensor_bytes"] / expected["predicted_peak_bytes"]
        assert 0.9 <= ratio <= 1.1, (rank, ratio, measured, expected)
    log = (trained / "launch.log").read_text()
    if name == "memory_auto":  # the planner's choice, and what it was planned from
        assert "PipeDreamStrategy(schedule='auto') chose (from a FLOP estimate of the meta model's shapes" in log
        assert "auto plan (exact schedules only" in log and "run it with PipeDreamStrategy(schedule=" in log
    else:
        assert "schedule=1f1b, from a FLOP estimate of the meta model's shapes" in log
        assert "predicted memory per rank (optimizer adam" in log


def test_schedule_auto_chooses_two_data_parallel_pipelines_of_two_stages_and_trains_as_one_process(trained):
    """The graph path's planner weighs equal replicas too: here 2 pipelines of 2 stages, which every rank runs (the
    split points for 2 stages, stages=2), and the trained weights are one process's (both replicas of each stage)."""
    ran = [json.loads((trained / "auto_replicas" / "pipe" / f"memory{rank}.json").read_text())["ran"]
           for rank in range(4)]
    assert [r["stage"] for r in ran] == [0, 0, 1, 1]  # stage s of pipeline k on rank 2s + k
    assert all({**r, "stage": 0} == {**ran[0], "stage": 0} for r in ran)  # every rank runs rank 0's choice
    assert (ran[0]["schedule"], ran[0]["stages"], ran[0]["pipelines"]) == ("zb-v", 2, 2)
    assert len(ran[0]["split_points"]) == 3  # zb-v: 2 model chunks per rank, 4 in all
    log = (trained / "launch.log").read_text()
    assert re.search(r"auto plan \(exact schedules only, memory limit 390\.62 KiB per worker, optimizer sgd\): zb-v, "
                     r"2 stages \(2-2\) x 2 chunks, \d+ micro-batch", log)
    assert "2 data-parallel pipelines of 2 stages" in log and "run it with PipeDreamStrategy(schedule='zb-v'" in log
    expected = reference(trained / "auto_replicas" / "hf", AUTO_REPLICAS_DATA)
    merged: dict[str, torch.Tensor] = {}
    for rank in range(4):
        for key, value in torch.load(trained / "auto_replicas" / "pipe" / f"stage{rank}.pt").items():
            key = re.sub(r"^(\d+\.)?model\.", "", key)  # a model chunk's index, then the module's own name
            if key in merged:  # the other pipeline's replica of the stage: the same update
                torch.testing.assert_close(value, merged[key], rtol=1e-5, atol=1e-7)
            merged[key] = value
    assert set(merged) == set(expected)
    initial = transformers.AutoModelForCausalLM.from_pretrained(trained / "auto_replicas" / "hf").state_dict()
    for key, value in expected.items():
        assert (merged[key] - value).norm() <= 1e-5 * value.norm(), key
    moved = max(float((expected[k] - initial[k]).norm() / initial[k].norm()) for k in expected if "weight" in k)
    assert moved > 1e-3
