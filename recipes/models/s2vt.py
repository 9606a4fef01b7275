"""S2VT (Venugopalan et al. 2015) as a layer sequence: a visual LSTM reads the frame features, then a
language LSTM reads [visual state; previous word] and predicts the caption.

Both LSTMs run over frames followed by words (F + T steps); frames see zero words and words see zero frames,
as in the paper. Tuples between layers (batch first): (feats, cap_in) -> (frames, cap_in) -> (h1, cap_in)
-> (h1, words, cap_in) -> h2 over the caption steps -> logits (B, T, V).
While decoding (`lightning_pipedream.generate`) each stage keeps its LSTMs' (h, c) per lane, so a step feeds one
word and no frames (`carried_lstm`).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipedream.runtime.execution.decode import carried_lstm, has_carried_state

PAD = 0


class FrameEmbedding(nn.Module):
    """Project per-frame features (B, F, D) to the LSTM input size."""

    def __init__(self, feature_size: int, hidden_size: int, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(feature_size, hidden_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        feats, cap_in = inputs
        return self.dropout(self.linear(feats)), cap_in


class VisualLSTM(nn.Module):
    """First LSTM: frames, then zero padding for the caption steps -> hidden states (B, F + T, H); while decoding,
    after a lane's first step, the new caption steps only (the frames were read)."""

    carries_decode_state = True

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(hidden_size, hidden_size, batch_first=True)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        frames, cap_in = inputs
        pad = frames.new_zeros(frames.size(0), cap_in.size(1), frames.size(2))
        if has_carried_state(self.lstm):
            return carried_lstm(self.lstm, pad), cap_in
        return carried_lstm(self.lstm, torch.cat([frames, pad], dim=1)), cap_in


class WordEmbedding(nn.Module):
    """Embed the caption words and put zero 'words' in front of them for the frame steps."""

    def __init__(self, vocab_size: int, hidden_size: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size, padding_idx=PAD)
        self.dropout = nn.Dropout(dropout)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h1, cap_in = inputs
        words = self.dropout(self.embed(cap_in))
        num_frames = h1.size(1) - cap_in.size(1)
        words = torch.cat([words.new_zeros(words.size(0), num_frames, words.size(2)), words], dim=1)
        return h1, words, cap_in


class LanguageLSTM(nn.Module):
    """Second LSTM over [h1; words]; returns only the caption steps (B, T, H), which predict the words."""

    carries_decode_state = True

    def __init__(self, hidden_size: int, dropout: float) -> None:
        super().__init__()
        self.lstm = nn.LSTM(2 * hidden_size, hidden_size, batch_first=True)
        self.dropout = nn.Dropout(dropout)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h1, words, cap_in = inputs
        h2 = carried_lstm(self.lstm, torch.cat([h1, words], dim=-1))
        return self.dropout(h2[:, h2.size(1) - cap_in.size(1):])


def s2vt(feature_size: int, vocab_size: int, hidden_size: int = 1000, dropout: float = 0.5) -> nn.Sequential:
    """S2VT with two stacked LSTMs of `hidden_size` units (1000 in the paper, on 4096-d VGG fc7 features)."""
    return nn.Sequential(
        FrameEmbedding(feature_size, hidden_size, dropout),
        VisualLSTM(hidden_size),
        WordEmbedding(vocab_size, hidden_size, dropout),
        LanguageLSTM(hidden_size, dropout),
        nn.Linear(hidden_size, vocab_size),
    )
