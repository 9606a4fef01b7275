"""The model families of the graph tests: tiny, seeded, with a batch maker and a loss each."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torchvision
from torch import nn


class TransformerLM(nn.Module):
    """Encoder-decoder nn.Transformer LM: two token inputs, a causal mask, padding masks, one shared embedding."""

    def __init__(self, vocab: int = 23, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.transformer = nn.Transformer(d, 2, 1, 1, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1))
        padding = src == 0
        # The encoder and decoder of the nn.Transformer called in turn (as nn.Transformer.forward does), so that
        # the target's embedding runs after the encoder.
        memory = self.transformer.encoder(self.embed(src), src_key_padding_mask=padding)
        h = self.transformer.decoder(self.embed(tgt), memory, tgt_mask=mask, memory_key_padding_mask=padding)
        return self.out(h)


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TiedDecoder(nn.Module):
    """A decoder-only LM's parts: token and position embeddings, blocks in an nn.ModuleList, a LayerNorm and the
    output projection tied to the token embedding (built in this order: the seeded weights of GPT and HFStyleLM)."""

    def __init__(self, vocab: int, d: int, layers: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight


class GPT(TiedDecoder):
    """Decoder-only LM: blocks in an nn.ModuleList, the output projection tied to the token embedding."""

    def __init__(self, vocab: int = 29, d: int = 16, layers: int = 4, context: int = 16) -> None:
        super().__init__(vocab, d, layers, context)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(length, device=idx.device))
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=idx.device), 1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


class LSTMLM(nn.Module):
    """Two-layer LSTM LM with the decoder tied to the embedding (AWD-LSTM's shape, without its regularisers)."""

    def __init__(self, vocab: int = 31, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn1 = nn.LSTM(d, d, batch_first=True)
        self.rnn2 = nn.LSTM(d, d, batch_first=True)
        self.dec = nn.Linear(d, vocab)
        self.dec.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn1(self.emb(x))
        h, _ = self.rnn2(h)
        return self.dec(h)


class LSTMOutput(nn.Module):
    """An LSTM as one layer of a Sequential: its output sequence only."""

    def __init__(self, lstm: nn.LSTM) -> None:
        super().__init__()
        self.lstm = lstm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


def tied_sequential_lstm() -> nn.Sequential:
    """The LSTM LM as a Sequential of 4 layers whose first (embedding) and last (decoder) share the weight."""
    model, _ = make("lstm")
    return nn.Sequential(model.emb, LSTMOutput(model.rnn1), LSTMOutput(model.rnn2), model.dec)


class KeyValueCache:
    """A stand-in for Hugging Face's DynamicCache: a plain object (no pytree node) holding each layer's keys."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []

    def update(self, key: torch.Tensor) -> torch.Tensor:
        self.keys.append(key)
        return key


@dataclass
class CausalLMOutput:
    """A stand-in for Hugging Face's ModelOutput: a dataclass torch's pytree does not know, with a cache field."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: KeyValueCache | None = None


class HFStyleLM(TiedDecoder):
    """A decoder LM called as Hugging Face's are: ``model(input_ids, labels=labels).loss``, with a cache unless
    ``use_cache=False``, the output projection tied to the embedding, and a token-mean loss that skips the
    label -100 (padding)."""

    def __init__(self, vocab: int = 29, d: int = 16, layers: int = 3, context: int = 16) -> None:
        super().__init__(vocab, d, layers, context)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                use_cache: bool = True) -> CausalLMOutput:
        cache = KeyValueCache() if use_cache else None
        length = input_ids.size(1)
        x = self.tok(input_ids) + self.pos(torch.arange(length, device=input_ids.device))
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=input_ids.device), 1)
        for block in self.blocks:
            if cache is not None:
                cache.update(x)
            x = block(x, mask)
        logits = self.head(self.ln(x))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                               ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits, past_key_values=cache)


def make(family: str) -> tuple[nn.Module, tuple]:
    """A seeded model of ``family`` and one example call's arguments."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if family == "transformer":
        return TransformerLM(), (torch.randint(1, 23, (2, 7), generator=g), torch.randint(0, 23, (2, 5), generator=g))
    if family == "resnet":
        return torchvision.models.resnet18(num_classes=10), (torch.randn(2, 3, 16, 16, generator=g),)
    if family == "gpt":
        return GPT(), (torch.randint(0, 29, (2, 8), generator=g),)
    if family == "lstm":
        return LSTMLM(), (torch.randint(0, 31, (2, 6), generator=g),)
    if family == "hf":
        return HFStyleLM(), (torch.randint(0, 29, (2, 8), generator=g),)
    if family in HF_MODELS:
        return hf_model(family), (torch.randint(0, 29, (2, 8), generator=g),)
    raise ValueError(family)


# Real Hugging Face causal LMs, tiny, with 4 decoder layers (the graph path cuts between the traced graph's nodes, so
# 4 processes' 8 model chunks cut inside the blocks, e.g. after a block's attention): Llama
# (grouped-query attention, rotary positions, untied head) and GPT-2 (its head tied to the token embedding). No dropout
# and no cache: the same steps as one device, and nothing but the loss and logits out of the forward.
HF_MODELS = ("llama", "gpt2")


def hf_model(family: str) -> nn.Module:
    """A tiny seeded ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` (transformers is imported only here)."""
    import transformers

    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16, use_cache=False))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=32, n_embd=16, n_layer=4, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))


def tiny_decoder(kind: str, pad: int = 0) -> nn.Module:
    """A tiny seeded ``LlamaForCausalLM`` (``kind="llama"``) or ``GPT2LMHeadModel`` (its head tied to the embedding)
    in evaluation mode, with pad, BOS and EOS ids (``pad``, 1, 2), for the decoding tests."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          pad_token_id=pad, bos_token_id=1, eos_token_id=2)
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=64, pad_token_id=pad,
                                     bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(config).eval()


def batches(family: str, steps: int, size: int) -> list[tuple[tuple, torch.Tensor]]:
    """``steps`` batches of ``size`` samples: (call arguments, targets)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        if family == "resnet":
            out.append(((torch.randn(size, 3, 16, 16, generator=g),), torch.randint(0, 10, (size,), generator=g)))
        else:
            vocab, length = {"gpt": (29, 8), "hf": (29, 8), "llama": (29, 8), "gpt2": (29, 8), "lstm": (31, 6), "transformer": (23, 5)}[family]
            tokens = torch.randint(1, vocab, (size, length + 1), generator=g)
            args = (tokens[:, :-1],) if family != "transformer" else (tokens[:, 1:], tokens[:, :-1])
            out.append((args, tokens[:, 1:]))
    return out


def padded(items: list[tuple[tuple, torch.Tensor]], seed: int = 3) -> list[tuple[tuple, torch.Tensor]]:
    """LM batches with right padding: each sample keeps a random number (>= 1) of its tokens; the padding's
    labels are -100, so a token-mean loss counts unequal numbers of tokens per sample."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for args, labels in items:
        keep = torch.randint(1, labels.size(1) + 1, (labels.size(0), 1), generator=g)
        pad = torch.arange(labels.size(1)).expand_as(labels) >= keep
        out.append(((args[0].masked_fill(pad, 0), *args[1:]), labels.masked_fill(pad, -100)))
    return out


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if output.dim() == 3:
        return nn.functional.cross_entropy(output.reshape(-1, output.size(-1)), targets.reshape(-1))
    return nn.functional.cross_entropy(output, targets)
