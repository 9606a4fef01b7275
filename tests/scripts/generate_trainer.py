"""Generation under PipeDreamStrategy: `python generate_trainer.py OUT_DIR JSON_OPTIONS` (or `--runs`).

A tiny causal LM whose layers are one nn.Sequential (no cache: each stage recomputes its prefix) is validated
once through the pipeline (which builds it), then every rank calls ``lightning_pipedream.generate`` with the same
left-padded prompts for each lane count in ``options["lanes"]``, then ``trainer.predict`` runs a ``predict_step``
that generates, and each rank writes what it got. ``options["first"]``: ``trainer.predict`` as a new Trainer's first
call (straight from saved weights), its step marked ``@generates`` and generating with every lane count from 1 to the
batch's sequences: a Hugging Face Llama whose forward takes keywords, built whole and built on the meta device with
``pretrained=``, and a plain module split from its traced graph; ``options["unmarked"]``: the same step without the
mark, refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from script_runs import main_runs, trainer_args, write_json  # noqa: E402

from lightning_pipedream import PipeDreamStrategy, generate, generates  # noqa: E402

VOCAB, WIDTH = 32, 16


class CausalMix(nn.Module):
    """Each position mixes in the mean of the positions up to it: the output depends on the whole prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.linear(x))
        count = torch.arange(1, x.shape[1] + 1, device=x.device).view(1, -1, 1)
        return x + h.cumsum(1) / count


class TinyLM(L.LightningModule):
    def __init__(self, eos: int = -1) -> None:
        super().__init__()
        self.eos = eos  # what predict_step's generate stops at
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Embedding(VOCAB, WIDTH), CausalMix(), CausalMix(), CausalMix(),
                                    nn.Linear(WIDTH, VOCAB))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.layers(ids)

    def validation_step(self, batch, batch_idx):
        ids, targets = batch
        self.log("val_loss", F.cross_entropy(self(ids).flatten(0, 1), targets.flatten()))

    @generates
    def predict_step(self, batch, batch_idx):
        ids, mask = batch
        return generate(self, ids, attention_mask=mask, max_new_tokens=5, eos_token_id=self.eos, pad_token_id=0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class HFLM(L.LightningModule):
    """A tiny Hugging Face GPT-2 or Llama whose forward passes its keyword arguments on: the graph path, every rank
    holding the whole module; generate() keeps each stage's own layers' keys and values per lane."""

    def __init__(self, build=None) -> None:
        super().__init__()
        self.model = (build or tiny_gpt2)()

    def forward(self, **kwargs):
        return self.model(**kwargs)

    def validation_step(self, batch, batch_idx):
        ids, _ = batch
        self.log("val_loss", self(input_ids=ids, labels=ids, use_cache=False).loss)


class MetaHF(HFLM):
    """The Hugging Face model saved in ``model_dir``, built in configure_model: on the meta device under
    PipeDreamStrategy, each rank materializing (and loading, ``pretrained=``) only its stage's tensors."""

    def __init__(self, model_dir: str) -> None:
        L.LightningModule.__init__(self)
        self.model_dir, self.model = model_dir, None

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_dir))


class FirstLM(L.LightningModule):
    """A Hugging Face Llama as its user writes it: ``forward(self, input_ids, **kw)`` passing the keywords on, a
    ``predict_step`` marked ``@generates`` that generates with each lane count of ``lanes``; built whole from
    ``build`` or, with ``model_dir``, in configure_model (on the meta device under the strategy)."""

    def __init__(self, lanes: list[int], eos: int, model_dir: str | None = None, build=None) -> None:
        super().__init__()
        self.lanes, self.eos, self.model_dir = lanes, eos, model_dir
        self.model = None if model_dir is not None else (build or tiny_llama)()

    def configure_model(self) -> None:
        if self.model is None and self.model_dir is not None:
            from transformers import AutoConfig, AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_dir))

    def forward(self, input_ids, **kw):
        return self.model(input_ids=input_ids, **kw)

    @generates
    def predict_step(self, batch, batch_idx):
        ids, mask = batch
        return {str(m): generate(self, ids, attention_mask=mask, max_new_tokens=5, eos_token_id=self.eos,
                                 pad_token_id=0, micro_batches=m) for m in self.lanes}


class Unmarked(FirstLM):
    def predict_step(self, batch, batch_idx):  # the same step without @generates
        ids, mask = batch
        return generate(self, ids, attention_mask=mask, max_new_tokens=5, eos_token_id=self.eos, pad_token_id=0)


class PlainBlocks(FirstLM):
    """A plain module (no Hugging Face model, no nn.Sequential of its layers: split from its traced graph) whose
    forward takes the ids alone: TinyLM's layers, held as an embedding, a ModuleList of blocks and a head."""

    def __init__(self, lanes: list[int], eos: int) -> None:
        super().__init__(lanes, eos, build=lambda: None)
        embed, *blocks, head = TinyLM().layers
        self.embed, self.blocks, self.head = embed, nn.ModuleList(blocks), head

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def real_parameters(module: nn.Module) -> dict[str, int]:
    """Bytes of each parameter this process holds for real (not on the meta device)."""
    return {n: p.numel() * p.element_size() for n, p in module.named_parameters() if not p.is_meta}


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=4, n_head=2, n_positions=32, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(config).eval()


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (5, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[3, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def run(out: str, options: dict) -> None:
    processes = options["processes"]
    module = TinyLM(options["eos"])
    data = DataLoader(TensorDataset(torch.randint(0, VOCAB, (4, 6)), torch.randint(0, VOCAB, (4, 6))), batch_size=4)
    strategy = PipeDreamStrategy(schedule="gpipe", chunks=2, balance=options["balance"])
    trainer = L.Trainer(**trainer_args(devices=processes, strategy=strategy, use_distributed_sampler=False))
    trainer.validate(module, data)
    ids, mask = prompts()
    got = {str(m): generate(module, ids, attention_mask=mask, max_new_tokens=5, eos_token_id=options["eos"],
                            pad_token_id=0, micro_batches=m).tolist() for m in options["lanes"]}
    # generate from predict_step (marked @generates): every rank runs it around the ring, batches of 3 and 2 prompts
    loader = DataLoader(TensorDataset(ids, mask), batch_size=3)
    got["predict"] = [t.tolist() for t in trainer.predict(module, loader)]
    # the graph path: Hugging Face models, with caches (GPT-2, then Llama with an EOS of its own)
    for key, build, eos in (("hf", tiny_gpt2, options["eos"]), ("llama", tiny_llama, options.get("llama_eos"))):
        if not options.get("hf"):
            break
        hf = HFLM(build)
        hf_trainer = L.Trainer(**trainer_args(devices=processes, strategy=PipeDreamStrategy(schedule="gpipe"),
                                              use_distributed_sampler=False))
        hf_trainer.validate(hf, data)
        # the modes the graph was traced in: validate() runs every step in evaluation mode, so that one alone
        got[f"{key}_modes"] = sorted({training for training, _ in hf_trainer.strategy._pipeline.graph.graph._captured})
        got[key] = {str(m): generate(hf, ids, attention_mask=mask, max_new_tokens=5, eos_token_id=eos,
                                     pad_token_id=0, micro_batches=m).tolist() for m in options["lanes"]}
    # built per stage on the meta device, loaded from a saved model: each rank decodes with the blocks it holds
    for key, model_dir, eos, points in options.get("meta", []):
        meta = MetaHF(model_dir)
        meta_trainer = L.Trainer(**trainer_args(devices=processes, use_distributed_sampler=False, strategy=(
            PipeDreamStrategy(schedule="gpipe", pretrained=model_dir, split_points=points))))
        meta_trainer.validate(meta, data)
        before = real_parameters(meta)
        tokens = {str(m): generate(meta, ids, attention_mask=mask, max_new_tokens=5, eos_token_id=eos,
                                   pad_token_id=0, micro_batches=m).tolist() for m in options["lanes"]}
        got[key] = {"tokens": tokens, "real_before": before, "real_after": real_parameters(meta),
                    "model_bytes": sum(p.numel() * p.element_size() for p in meta.parameters())}
    # a training split that cuts inside a block: every rank refuses alike, before any message of the ring
    if options.get("refuse"):
        model_dir, points = options["refuse"]
        meta = MetaHF(model_dir)
        L.Trainer(**trainer_args(devices=processes, use_distributed_sampler=False, strategy=PipeDreamStrategy(
            schedule="gpipe", pretrained=model_dir, split_points=points))).validate(meta, data)
        try:
            generate(meta, ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0)
        except ValueError as refused:
            got["refused"] = str(refused)
    # trainer.predict as a new Trainer's first call: the pipeline is built for inference from the plain forward
    ids, mask = prompts()
    loader = DataLoader(TensorDataset(ids, mask), batch_size=len(ids))
    lanes = list(range(1, len(ids) + 1))
    for key, model_dir, eos, points in options.get("first", []):
        first = PlainBlocks(lanes, eos) if key == "plain" else FirstLM(lanes, eos, model_dir)
        first_trainer = L.Trainer(**trainer_args(devices=processes, use_distributed_sampler=False, strategy=(
            PipeDreamStrategy(schedule="gpipe", pretrained=model_dir, split_points=points))))
        (predicted,) = first_trainer.predict(first, loader)
        got[f"first_{key}"] = {"tokens": {m: t.tolist() for m, t in predicted.items()},
                               "real": sum(real_parameters(first).values()),
                               "model_bytes": sum(p.numel() * p.element_size() for p in first.parameters())}
    if options.get("unmarked"):  # the same step without @generates: refused, saying to mark it
        unmarked_trainer = L.Trainer(**trainer_args(devices=processes, use_distributed_sampler=False,
                                                    strategy=PipeDreamStrategy(schedule="gpipe")))
        try:
            unmarked_trainer.predict(Unmarked(lanes, options["eos"]), loader)
        except ValueError as refused:
            got["unmarked"] = str(refused)
    write_json(Path(out) / f"rank{trainer.global_rank}.json", got)


if __name__ == "__main__":
    main_runs(run)
