"""AWD-LSTM (Merity et al. 2018) as a layer sequence: embedding dropout, locked (variational) dropout and
weight-dropped (DropConnect on hidden-to-hidden weights) LSTM layers.

Differences from the reference, forced by pipelining: no weight tying between embedding and decoder (they
would sit in different stages) and no hidden state carried across batches (every batch starts from zeros,
so micro-batches are independent).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call


class LockedDropout(nn.Module):
    """Dropout with one mask per sequence, shared over time steps (input is batch first: B, T, H)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        mask = x.new_empty(x.size(0), 1, x.size(2)).bernoulli_(1 - self.p) / (1 - self.p)
        return x * mask


class EmbeddingLayer(nn.Module):
    """Token ids -> embeddings, dropping whole words (embedding dropout) then locked input dropout."""

    def __init__(self, vocab_size: int, embedding_size: int, dropoute: float, dropouti: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embedding_size)
        self.dropoute = dropoute
        self.locked = LockedDropout(dropouti)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.embed.weight
        if self.training and self.dropoute > 0:
            keep = weight.new_empty(weight.size(0), 1).bernoulli_(1 - self.dropoute) / (1 - self.dropoute)
            weight = weight * keep
        return self.locked(F.embedding(tokens, weight))


class WeightDropLSTM(nn.Module):
    """One LSTM layer whose hidden-to-hidden weight gets a fresh DropConnect mask every forward, then locked dropout."""

    def __init__(self, input_size: int, hidden_size: int, wdrop: float, dropout: float) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True)
        self.wdrop = wdrop
        self.locked = LockedDropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.wdrop > 0:
            # functional_call swaps in the dropped weight for this call only; the raw weight keeps its gradient
            dropped = F.dropout(self.lstm.weight_hh_l0, p=self.wdrop, training=True)
            out, _ = functional_call(self.lstm, {"weight_hh_l0": dropped}, (x,), strict=False)
        else:
            out, _ = self.lstm(x)
        return self.locked(out)


def awd_lstm(vocab_size: int, embedding_size: int = 400, hidden_size: int = 1150, num_layers: int = 3,
             dropoute: float = 0.1, dropouti: float = 0.65, dropouth: float = 0.3, dropout: float = 0.4,
             wdrop: float = 0.5) -> nn.Sequential:
    """AWD-LSTM: embedding, `num_layers` weight-dropped LSTMs (the last one back to `embedding_size`), decoder."""
    layers: list[nn.Module] = [EmbeddingLayer(vocab_size, embedding_size, dropoute, dropouti)]
    for i in range(num_layers):
        last = i == num_layers - 1
        layers.append(WeightDropLSTM(embedding_size if i == 0 else hidden_size,
                                     embedding_size if last else hidden_size,
                                     wdrop, dropout if last else dropouth))
    layers.append(nn.Linear(embedding_size, vocab_size))
    return nn.Sequential(*layers)
