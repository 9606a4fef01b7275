"""Hugging Face's own idioms on the meta path, as its users write them: a model built in configure_model from its
config (its defaults: use_cache on), loaded per stage with `pretrained=`, a step returning
`self.model(input_ids=ids, labels=labels).loss` with no mean_over= and no forward of the LightningModule's own. GPT-2,
Llama and Qwen2 (causal LMs: labels the tokens, or -100 on a prompt of each sequence) and BERT's masked LM (-100 on
the unmasked tokens), on 2 processes (Llama and BERT on 4 too) through the Trainer: the final weights equal one
process that used `from_pretrained` and the same steps (1e-5). Micro-batches that hold unequal counts of labelled tokens are weighed by
them, as Hugging Face's num_items_in_batch does (strategy/setup/labels.py). One launch per process count
(tests/scripts/meta_trainer.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from meta_trainer import LabelledBatches
from script_runs import run_script

from lightning_pipedream.runtime.execution.shares import labelled_tokens

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "meta_trainer.py"
LR, EPOCHS, CHUNKS = 0.1, 2, 2
SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "max_position_embeddings": 32}
# Each config as shipped but tiny; dropout off where the config has it (the same steps as one process).
MODELS = {
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=4, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)), "ids"),
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, num_key_value_heads=2)),
              "prompt"),
    "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, num_key_value_heads=2)),
              "prompt"),
    "bert": (lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        **SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), "masked"),
}
DATA = [96, 2, 8, 10]  # [vocabulary, batches, batch size, sequence length]
PROCESSES = (2, 4)
# Every model on 2 processes; on 4, the two whose labels differ most: Llama (-100 on each sequence's prompt, so the
# micro-batches hold unequal counts) and BERT's masked LM (-100 on the unmasked tokens, unshifted). GPT-2 and Llama
# also train on 4 processes in tests/strategy/test_meta_models.py; Qwen2 is Llama's block with biases. (The suite's
# time: every model on 4 processes costs that launch about 10 s more.)
ON_FOUR = ("llama", "bert")


def cases() -> list[tuple[str, int]]:
    return [(name, p) for name in MODELS for p in PROCESSES if p == 2 or name in ON_FOUR]


@functools.cache
def reference(model_dir: Path, kind: str, weighing: str = "batch") -> dict[str, torch.Tensor]:
    """One process: from_pretrained, then the same SGD steps with the model's own loss on whole batches (``"batch"``);
    or, to show what the weighing decides, on CHUNKS micro-batches whose losses count by their samples
    (``"samples"``) or by their labels that are not -100, unshifted (``"unshifted"``)."""
    auto = transformers.AutoModelForMaskedLM if kind == "masked" else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(EPOCHS):
        for input_ids, labels in LabelledBatches(*DATA, kind):
            optimizer.zero_grad()
            if weighing == "batch":
                loss = model(input_ids=input_ids, labels=labels).loss
            else:
                parts = list(zip(input_ids.chunk(CHUNKS), labels.chunk(CHUNKS)))
                counts = [len(y) if weighing == "samples" else labelled_tokens(y) for _, y in parts]
                loss = sum(model(input_ids=x, labels=y).loss * c / sum(counts) for (x, y), c in zip(parts, counts))
            loss.backward()
            optimizer.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("hf_idioms")
    runs: dict[int, list] = {p: [] for p in PROCESSES}
    for name, (build, kind) in MODELS.items():
        torch.manual_seed(0)
        build().save_pretrained(base / name / "hf")
        for processes in (p for n, p in cases() if n == name):
            runs[processes].append([str(base / name / f"on_{processes}"), {
                "config_dir": str(base / name / "hf"), "devices": processes, "data": DATA, "labels": kind,
                "lr": LR, "epochs": EPOCHS,
                "strategy": {"schedule": "1f1b", "chunks": CHUNKS, "pretrained": str(base / name / "hf")}}])
    for processes, group in runs.items():
        (base / f"runs{processes}.json").write_text(json.dumps(group))
        proc = run_script(SCRIPT, base, {"--runs": str(base / f"runs{processes}.json")}, timeout=600)
        (base / f"launch{processes}.log").write_text(proc.stdout + proc.stderr)
    return base


def stage_weights(out: Path, processes: int) -> dict[str, torch.Tensor]:
    """The run's final weights under the HF model's names, from every rank's stage (a tied weight's copies equal)."""
    merged: dict[str, torch.Tensor] = {}
    for rank in range(processes):
        for key, value in torch.load(out / f"stage{rank}.pt").items():
            key = key.removeprefix("model.")
            if key in merged:
                torch.testing.assert_close(value, merged[key], rtol=1e-5, atol=1e-7)
            merged[key] = value
    return merged


def test_the_micro_batches_hold_unequal_counts_of_labelled_tokens():
    """What makes the weighing matter: per micro-batch, the tokens each loss averages over differ (a causal LM's
    shifted labels; BERT's masked tokens), except where the labels are the tokens themselves."""
    for name, (_, kind) in MODELS.items():
        shifted = kind != "masked"
        counts = [[labelled_tokens(part, shifted) for part in labels.chunk(CHUNKS)]
                  for _, labels in LabelledBatches(*DATA, kind)]
        assert any(len(set(c)) > 1 for c in counts) == (kind != "ids"), (name, counts)


@pytest.mark.parametrize(("name", "processes"), cases())
def test_hugging_face_s_idiom_on_meta_trains_as_from_pretrained_on_one_process(trained, name, processes):
    out = trained / name / f"on_{processes}"
    expected = reference(trained / name / "hf", MODELS[name][1])
    merged = stage_weights(out, processes)
    assert set(merged) <= set(expected) and set(expected) - set(merged) <= {"lm_head.weight", "cls.predictions.decoder.weight"}
    auto = transformers.AutoModelForMaskedLM if name == "bert" else transformers.AutoModelForCausalLM
    start = auto.from_pretrained(trained / name / "hf").state_dict()
    for key, value in merged.items():
        # 1e-5 of the tensor's norm (the summation orders of micro-batches and of one batch differ); BERT's attention
        # key biases get no gradient (softmax does not see them): 1e-13 both, rounding alone
        assert (value - expected[key]).norm() <= 1e-5 * expected[key].norm() + 1e-9, key
    # Weighing the micro-batches by their samples, or by their labels unshifted, would not be one process.
    for weighing in ("samples", "unshifted") if MODELS[name][1] != "ids" else ():
        if weighing == "unshifted" and name == "bert":
            continue  # a masked LM's loss does not shift: its labels' count is the right one
        other = reference(trained / name / "hf", MODELS[name][1], weighing)
        assert max(float((other[k] - expected[k]).norm() / expected[k].norm()) for k in merged) > 1e-4, weighing
    moved = max(float((expected[k] - start[k]).norm() / start[k].norm()) for k in merged if "weight" in k)
    assert moved > 1e-3  # training changed the weights: equality is not two copies of the pretrained ones
    # Nothing said about the cache it drops or about unequal token counts: the strategy sees the labels.
    result = json.loads((out / "memory0.json").read_text())
    assert not [w for w in result["warnings"] if "unevenly" in w], result["warnings"]
