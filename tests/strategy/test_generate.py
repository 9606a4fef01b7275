"""``lightning_pipedream.generate`` through a Trainer on 2 and 3 processes (one launch each, every lane count in
it, and a predict_step marked @generates) equals greedy decoding of the same weights on one device, on every rank,
and a tiny Hugging Face GPT-2 and Llama (graph path, per-stage caches) equal their own ``generate(do_sample=False)``
(ragged left-padded prompts, an EOS that some sequences reach early), also when built per stage on the meta device
from a saved model (configure_model, ``pretrained=``), no rank materializing another stage's parameters (and a
training split inside a block refused on every rank);
and the same call without the strategy decodes on one device."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from generate_trainer import TinyLM, prompts, tiny_gpt2, tiny_llama
from script_runs import run_script

from lightning_pipedream import generate

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "generate_trainer.py"
META_POINTS = {"gpt2": ["model.transformer.h.1", "model.transformer.h.3"],
               "llama": ["model.model.layers.1", "model.model.layers.3"]}


def greedy(module: TinyLM, ids: torch.Tensor, mask: torch.Tensor, new: int, eos: int) -> torch.Tensor:
    """Plain greedy decoding: the whole prefix every step, ended sequences padded with 0, stop when all ended."""
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(new):
            token = module(ids)[:, -1].argmax(-1)
            token = torch.where(done, torch.zeros_like(token), token)
            done = done | (token == eos)
            ids = torch.cat([ids, token[:, None]], 1)
            if done.all():
                break
    return ids


def eos_of() -> int:
    """A token that ends some sequences early: the second new token of sequence 1."""
    ids, mask = prompts()
    return int(greedy(TinyLM(), ids, mask, 5, eos=-1)[1, ids.shape[1] + 1])


@pytest.mark.parametrize(("processes", "balance"), [(2, [3, 2]), (3, [2, 2, 1])])
def test_generate_under_the_strategy_equals_one_device(tmp_path, processes, balance):
    eos = eos_of()
    ids, mask = prompts()
    want = greedy(TinyLM(), ids, mask, 5, eos)
    lanes = sorted({1, processes - 1, processes, processes + 1})
    hf = importlib.util.find_spec("transformers") is not None  # in the test extra; not in the oldest environment
    options = {"processes": processes, "balance": balance, "lanes": lanes, "eos": eos, "hf": hf}
    if hf:  # Llama's EOS: the second new token of sequence 1, so that it ends early and the others go on
        llama = tiny_llama()
        options["llama_eos"] = llama_eos = int(llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                                                              do_sample=False, pad_token_id=0, eos_token_id=None)
                                               [1, ids.shape[1] + 1])
        llama_want = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                    pad_token_id=0, eos_token_id=llama_eos)
        ended = (llama_want[:, ids.shape[1]:] == llama_eos).any(1)
        assert ended[1] and not ended.all(), llama_want  # some end early, some do not
        # the same models saved, then built per stage on the meta device (configure_model, pretrained=): the FLOP
        # estimate's split on 2 processes (at block boundaries), split_points at block boundaries on 3 (the estimate
        # cuts inside a block there, which generate() refuses: tests/runtime/test_decode_meta.py)
        tiny_gpt2().save_pretrained(tmp_path / "gpt2")
        llama.save_pretrained(tmp_path / "llama")
        three = processes == 3
        options["meta"] = [
            ["meta_gpt2", str(tmp_path / "gpt2"), eos, META_POINTS["gpt2"] if three else None],
            ["meta_llama", str(tmp_path / "llama"), llama_eos, META_POINTS["llama"] if three else None]]
        if not three:  # split inside block 1: refused on every rank, saying where to split
            options["refuse"] = [str(tmp_path / "llama"), ["model.model.layers.1.mlp"]]
        # trainer.predict as a new Trainer's first call, every lane count from 1 to the batch's sequences: the Llama
        # built whole and on the meta device with pretrained=, and a plain module split from its graph
        options["first"] = [["whole", None, llama_eos, None],
                            ["meta", str(tmp_path / "llama"), llama_eos, META_POINTS["llama"] if three else None],
                            ["plain", None, eos, None]]
        options["unmarked"] = not three
    run_script(SCRIPT, tmp_path, options, 600)
    hf_want = tiny_gpt2().generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                   pad_token_id=0, eos_token_id=eos) if hf else None
    for rank in range(processes):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for m in lanes:
            assert torch.equal(torch.tensor(got[str(m)]), want), f"rank {rank}, {m} lanes"
        for key in ("hf", "llama") if hf else ():  # trainer.validate() traced the model once, in evaluation mode
            assert got[f"{key}_modes"] == [False], (rank, key, got[f"{key}_modes"])
        for m in lanes if hf else ():  # a Hugging Face GPT-2 on the graph path, each stage caching its own layers
            assert torch.equal(torch.tensor(got["hf"][str(m)]), hf_want), f"rank {rank}, GPT-2, {m} lanes"
            assert torch.equal(torch.tensor(got["llama"][str(m)]), llama_want), f"rank {rank}, Llama, {m} lanes"
        for key, want_hf in (("meta_gpt2", hf_want), ("meta_llama", llama_want)) if hf else ():
            for m in lanes:
                assert torch.equal(torch.tensor(got[key]["tokens"][str(m)]), want_hf), f"rank {rank}, {key}, {m} lanes"
            # no rank materialized a parameter it does not hold, and none holds the whole model
            assert got[key]["real_after"] == got[key]["real_before"], f"rank {rank}, {key}"
            assert 0 < sum(got[key]["real_after"].values()) < got[key]["model_bytes"], f"rank {rank}, {key}"
        # predict_step on batches of 3 and 2 prompts
        for rows, batch in zip((slice(0, 3), slice(3, 5)), got["predict"]):
            want_batch = greedy(TinyLM(), ids[rows], mask[rows], 5, eos)
            assert torch.equal(torch.tensor(batch), want_batch), f"rank {rank}, predict_step rows {rows}"


    for rank in range(processes) if hf else ():  # trainer.predict first: HF's own tokens, every lane count
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        plain_want = greedy(TinyLM(), ids, mask, 5, eos)
        for key, first_want in (("whole", llama_want), ("meta", llama_want), ("plain", plain_want)):
            first = got[f"first_{key}"]
            assert sorted(first["tokens"]) == [str(m) for m in range(1, len(ids) + 1)], key
            for m, tokens in first["tokens"].items():
                assert torch.equal(torch.tensor(tokens), first_want), f"rank {rank}, predict first, {key}, {m} lanes"
            # built on meta, each rank materialized its own stage only; built whole, every rank holds it whole
            assert (0 < first["real"] < first["model_bytes"]) if key == "meta" else \
                first["real"] == first["model_bytes"], (rank, key, first)
        if processes == 2:
            assert got["unmarked"] == (
                "Unmarked.predict_step calls generate() but is not marked with @generates, so PipeDreamStrategy "
                "splits it at its model call between the stages instead of decoding around the pipeline's ring. Mark "
                "the step: `from lightning_pipedream import generates`, then `@generates` on the line above "
                "`def predict_step`."), got["unmarked"]

    if hf and processes == 2:
        for rank in range(processes):
            refused = json.loads((tmp_path / f"rank{rank}.json").read_text())["refused"]
            assert refused.startswith("generate() runs each stage's own blocks of MetaHF's model.model.layers (4 "
                                      "blocks), the stages the model was split into for training, but that split cuts "
                                      "inside block model.model.layers.1: stages [0, 1] each hold part of it. Split "
                                      "the model at block boundaries, e.g. PipeDreamStrategy(split_points="
                                      "['model.model.layers.1'])"), refused
    for key in ("meta_gpt2", "meta_llama") if hf else ():  # together the ranks hold every parameter
        ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text())[key] for rank in range(processes)]
        every = tiny_gpt2() if key == "meta_gpt2" else llama
        assert set().union(*(r["real_after"] for r in ranks)) == {f"model.{n}" for n, _ in every.named_parameters()}


def test_without_the_strategy_generate_decodes_on_one_device():
    ids, mask = prompts()
    eos = eos_of()
    module = TinyLM()
    assert torch.equal(generate(module, ids, attention_mask=mask, max_new_tokens=5, eos_token_id=eos, pad_token_id=0,
                                micro_batches=2), greedy(module, ids, mask, 5, eos))
