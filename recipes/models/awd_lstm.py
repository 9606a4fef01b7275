"""AWD-LSTM (Merity et al. 2018) as a layer sequence: embedding dropout, locked (variational) dropout and
weight-dropped (DropConnect on hidden-to-hidden weights) LSTM layers.

`carry_state=True` carries each LSTM's hidden state from one training batch to the next (truncated
backpropagation through time, as the AWD-LSTM code does; the data must then come as parallel streams, see
recipes/data/language_model.py). The state lives in the layer, so under a pipeline each stage carries its own
layers' state and nothing extra crosses stages. `tie_weights=True` shares the embedding with the decoder (as
the paper does); PipeDreamStrategy gives the two stages holding them a copy each and sums their gradients.
While decoding (`lightning_pipedream.generate`, evaluation without `carry_in_eval`) each stage keeps its own LSTMs'
(h, c) per lane, so a step feeds one token (`carried_lstm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from lightning_pipedream.runtime.execution.decode import carried_lstm


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

    With `carry_state`, each training forward starts from the (detached) final state of the same rows of the batch
    before: the layer keeps one state row per batch row (`set_rows`, else the first input's rows) and a pointer, and
    each input takes the next rows in turn, so with micro-batches, run in order, micro-batch k of a batch continues
    micro-batch k of the batch before. Evaluation starts from zeros unless `carry_in_eval` is set (the held-out
    evaluation sets it).
    """

    def __init__(self, input_size: int, hidden_size: int, wdrop: float, dropout: float,
                 carry_state: bool = False) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True)
        self.wdrop = wdrop
        self.locked = LockedDropout(dropout)
        self.carry_state = carry_state
        self.carry_in_eval = False
        self.reset_state()

    @property
    def carries_decode_state(self) -> bool:
        """Whether a decode step feeds this layer one token (its state kept per lane): not while it carries its own
        state in evaluation."""
        return not self.carry_in_eval

    def reset_state(self) -> None:
        """Forget the carried state and the row count (the next batch starts from zeros)."""
        self._rows: int | None = None
        self._state: tuple[torch.Tensor, torch.Tensor] | None = None
        self._next_row = 0

    def set_rows(self, rows: int) -> None:
        """Rows of each whole batch on this process (micro-batches take them in turn); a change starts over."""
        if rows != self._rows:
            self.reset_state()
            self._rows = rows

    def _initial_state(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._rows is None:
            self._rows = x.size(0)
        if self._next_row + x.size(0) > self._rows:  # inputs that do not tile the batch: start over from zeros
            self.reset_state()
            self._rows = x.size(0)
        if self._state is None:
            return None
        rows = slice(self._next_row, self._next_row + x.size(0))
        return self._state[0][:, rows], self._state[1][:, rows]

    def _keep_state(self, h: torch.Tensor, c: torch.Tensor) -> None:
        """Store the final state of these rows, detached: the gradient stops at the batch boundary (truncated BPTT).
        Out of place: autograd may still hold the old state tensors."""
        assert self._rows is not None
        if self._state is None:
            self._state = (h.new_zeros(1, self._rows, h.size(2)), c.new_zeros(1, self._rows, c.size(2)))
        lo, hi = self._next_row, self._next_row + h.size(1)
        self._state = tuple(torch.cat([old[:, :lo], new.detach(), old[:, hi:]], dim=1)
                            for old, new in zip(self._state, (h, c)))
        self._next_row = hi % self._rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        carry = self.carry_state and (self.training or self.carry_in_eval)
        state = self._initial_state(x) if carry else None
        if self.training and self.wdrop > 0:
            # functional_call swaps in the dropped weight for this call only; the raw weight keeps its gradient
            dropped = F.dropout(self.lstm.weight_hh_l0, p=self.wdrop, training=True)
            out, (h, c) = functional_call(self.lstm, {"weight_hh_l0": dropped}, (x, state), strict=False)
        elif not carry:  # plain lstm(x) outside decoding; the lane's own state while decoding
            return self.locked(carried_lstm(self.lstm, x))
        else:
            out, (h, c) = self.lstm(x, state)
        if carry:
            self._keep_state(h, c)
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
