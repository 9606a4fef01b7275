"""A token vocabulary with the special ids the sequence models expect (0 is padding) and batch padding."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SPECIALS = (PAD, UNK, BOS, EOS)


class Vocab:
    """Tokens <-> ids. Built deterministically (by count, then alphabetically) so every rank gets the same ids."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self.itos = list(tokens)
        self.stoi = {tok: i for i, tok in enumerate(self.itos)}

    @classmethod
    def build(
        cls, sentences: Iterable[Sequence[str]], max_size: int | None = None, specials: Sequence[str] = SPECIALS
    ) -> Vocab:
        counts = Counter(tok for sentence in sentences for tok in sentence)
        ranked = sorted((t for t in counts if t not in specials), key=lambda t: (-counts[t], t))
        if max_size is not None:
            ranked = ranked[: max(0, max_size - len(specials))]
        return cls([*specials, *ranked])

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokens: Sequence[str]) -> list[int]:
        unk = self.stoi.get(UNK, 0)
        return [self.stoi.get(tok, unk) for tok in tokens]

    def decode(self, ids: Iterable[int], stop_at_eos: bool = True) -> list[str]:
        """Ids -> tokens, without padding and BOS, stopping at the first EOS."""
        out = []
        for i in ids:
            tok = self.itos[int(i)]
            if tok == EOS and stop_at_eos:
                break
            if tok not in (PAD, BOS):
                out.append(tok)
        return out


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int = 0) -> torch.Tensor:
    """Right-pad integer sequences to one (B, T) long tensor."""
    longest = max(len(s) for s in sequences)
    out = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out


def teacher_forcing_pair(vocab: Vocab, tokens: Sequence[str]) -> tuple[list[int], list[int]]:
    """(<bos> w1 .. wn, w1 .. wn <eos>): the decoder input and the target it must predict."""
    ids = vocab.encode(tokens)
    return [vocab.stoi[BOS], *ids], [*ids, vocab.stoi[EOS]]
