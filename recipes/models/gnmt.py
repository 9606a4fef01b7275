"""GNMT (Wu et al. 2016) as a layer sequence: bidirectional first encoder layer, residual stacked LSTMs,
Bahdanau attention from the first decoder layer fed to every later decoder layer.

Tensors travel between layers as tuples (batch first, so a batch splits into micro-batches along dim 0):
    (src, tgt_in) -> (enc, src, tgt_in) -> ... -> (enc, src, y) -> (dec, context) -> ... -> logits
`src` (token ids) travels with the encoder states so the attention layer can mask padding.
While decoding (`lightning_pipedream.generate`) each stage keeps its decoder LSTMs' (h, c) per lane and its encoder
LSTMs' outputs, so a step feeds one target word (`carried_lstm`).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipedream.runtime.execution.decode import carried_lstm

PAD = 0


class SourceEmbedding(nn.Module):
    """(src, tgt_in) -> (embedded src, src, tgt_in)."""

    def __init__(self, vocab_size: int, hidden_size: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size, padding_idx=PAD)
        self.dropout = nn.Dropout(dropout)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        src, tgt_in = inputs
        return self.dropout(self.embed(src)), src, tgt_in


class EncoderLSTM(nn.Module):
    """One encoder LSTM layer; `residual` adds its input to its output (GNMT does this from layer 3 on)."""

    carries_decode_state = True

    def __init__(self, input_size: int, hidden_size: int, dropout: float, bidirectional: bool = False,
                 residual: bool = False) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True, bidirectional=bidirectional)
        self.dropout = nn.Dropout(dropout)
        self.residual = residual

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, src, tgt_in = inputs
        out = carried_lstm(self.lstm, self.dropout(x), source=True)  # the source: once per decoded lane
        return (out + x if self.residual else out), src, tgt_in


class TargetEmbedding(nn.Module):
    """(enc, src, tgt_in) -> (enc, src, embedded tgt_in)."""

    def __init__(self, vocab_size: int, hidden_size: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size, padding_idx=PAD)
        self.dropout = nn.Dropout(dropout)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        enc, src, tgt_in = inputs
        return enc, src, self.dropout(self.embed(tgt_in))


class BahdanauAttention(nn.Module):
    """Normalised additive attention: score(q, k) = v . tanh(Wq q + Wk k + b), masked on source padding."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear_q = nn.Linear(hidden_size, hidden_size, bias=False)
        self.linear_k = nn.Linear(hidden_size, hidden_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.v = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        # (B, Tq, 1, H) + (B, 1, Tk, H) -> scores (B, Tq, Tk)
        scores = self.v(torch.tanh(self.linear_q(query).unsqueeze(2) + self.linear_k(keys).unsqueeze(1) + self.bias))
        scores = scores.squeeze(-1).masked_fill(~key_mask.unsqueeze(1), float("-inf"))
        return torch.bmm(torch.softmax(scores, dim=-1), keys)


class AttentionDecoderLSTM(nn.Module):
    """First decoder layer: LSTM over target embeddings, then attention over the encoder -> (dec, context)."""

    carries_decode_state = True

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(hidden_size, hidden_size, batch_first=True)
        self.attention = BahdanauAttention(hidden_size)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        enc, src, y = inputs
        dec = carried_lstm(self.lstm, y)
        context = self.attention(dec, enc, src != PAD)
        return dec, context


class DecoderLSTM(nn.Module):
    """Later decoder layers: LSTM over [dec; context], residual from the third decoder layer on."""

    carries_decode_state = True

    def __init__(self, hidden_size: int, dropout: float, residual: bool) -> None:
        super().__init__()
        self.lstm = nn.LSTM(2 * hidden_size, hidden_size, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.residual = residual

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        dec, context = inputs
        out = carried_lstm(self.lstm, self.dropout(torch.cat([dec, context], dim=-1)))
        return (out + dec if self.residual else out), context


class Classifier(nn.Module):
    """(dec, context) -> logits over the target vocabulary, (B, T, V)."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, vocab_size)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        dec, _ = inputs
        return self.linear(dec)


def gnmt(src_vocab_size: int, tgt_vocab_size: int, num_layers: int = 4, hidden_size: int = 1024,
         dropout: float = 0.2) -> nn.Sequential:
    """GNMT with `num_layers` LSTM layers in the encoder and in the decoder (GNMT-8: 4, GNMT-16: 8)."""
    if num_layers < 2:
        raise ValueError(f"GNMT needs num_layers >= 2 per side (got {num_layers}): the first encoder layer is "
                         "bidirectional and the first decoder layer carries the attention")
    h = hidden_size
    layers: list[nn.Module] = [SourceEmbedding(src_vocab_size, h, dropout),
                               EncoderLSTM(h, h, dropout, bidirectional=True),
                               EncoderLSTM(2 * h, h, dropout)]
    layers += [EncoderLSTM(h, h, dropout, residual=True) for _ in range(num_layers - 2)]
    layers += [TargetEmbedding(tgt_vocab_size, h, dropout), AttentionDecoderLSTM(h),
               DecoderLSTM(h, dropout, residual=False)]
    layers += [DecoderLSTM(h, dropout, residual=True) for _ in range(num_layers - 2)]
    layers.append(Classifier(h, tgt_vocab_size))
    return nn.Sequential(*layers)
