"""AWD-LSTM (Merity et al. 2018) as a layer sequence: embedding dropout, locked (variational) dropout and
weight-dropped (DropConnect on hidden-to-hidden weights) LSTM layers.

`carry_state=True` carries each LSTM's hidden state from one training batch to the next (truncated
backpropagation through time, as the AWD-LSTM code does; the data must then come as parallel streams, see
recipes/data/language_model.py). The state lives in the layer, so under a pipeline each stage carries its own
layers' state and nothing extra crosses stages. `tie_weights=True` shares the embedding with the decoder.
"""

from __future__ import annotations

from collections import deque

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
    """One LSTM layer whose hidden-to-hidden weight gets a fresh DropConnect mask every forward, then locked dropout.

    With `carry_state`, each training forward starts from the (detached) final state of an earlier one: a queue
    holds one state per micro-batch, so with `chunks` micro-batches per batch, run in order, micro-batch k of a batch
    continues micro-batch k of the batch before (the same rows of the same streams). A batch of another size starts
    from zeros. Evaluation starts from zeros unless `carry_in_eval` is set (the held-out evaluation sets it).
    """

    def __init__(self, input_size: int, hidden_size: int, wdrop: float, dropout: float,
                 carry_state: bool = False) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True)
        self.wdrop = wdrop
        self.locked = LockedDropout(dropout)
        self.carry_state = carry_state
        self.carry_in_eval = False
        self._states: deque[tuple[torch.Tensor, torch.Tensor]] = deque()

    def reset_state(self) -> None:
        self._states.clear()

    def _initial_state(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._states and self._states[0][0].size(1) != x.size(0):
            self._states.clear()  # the batch size changed: the rows no longer continue the same streams
        return self._states.popleft() if self._states else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        carry = self.carry_state and (self.training or self.carry_in_eval)
        state = self._initial_state(x) if carry else None
        if self.training and self.wdrop > 0:
            # functional_call swaps in the dropped weight for this call only; the raw weight keeps its gradient
            dropped = F.dropout(self.lstm.weight_hh_l0, p=self.wdrop, training=True)
            out, (h, c) = functional_call(self.lstm, {"weight_hh_l0": dropped}, (x, state), strict=False)
        else:
            out, (h, c) = self.lstm(x, state)
        if carry:  # detached: the gradient stops at the batch boundary (truncated BPTT)
            self._states.append((h.detach(), c.detach()))
        return self.locked(out)


def awd_lstm(vocab_size: int, embedding_size: int = 400, hidden_size: int = 1150, num_layers: int = 3,
             dropoute: float = 0.1, dropouti: float = 0.65, dropouth: float = 0.3, dropout: float = 0.4,
             wdrop: float = 0.5, carry_state: bool = False, tie_weights: bool = False) -> nn.Sequential:
    """AWD-LSTM: embedding, `num_layers` weight-dropped LSTMs (the last one back to `embedding_size`), decoder."""
    embedding = EmbeddingLayer(vocab_size, embedding_size, dropoute, dropouti)
    layers: list[nn.Module] = [embedding]
    for i in range(num_layers):
        last = i == num_layers - 1
        layers.append(WeightDropLSTM(embedding_size if i == 0 else hidden_size,
                                     embedding_size if last else hidden_size,
                                     wdrop, dropout if last else dropouth, carry_state))
    decoder = nn.Linear(embedding_size, vocab_size)
    if tie_weights:  # AWD-LSTM's weight tying: the decoder reads the embedding matrix
        decoder.weight = embedding.embed.weight
    layers.append(decoder)
    return nn.Sequential(*layers)
