"""Translation data: a generated numbers -> English words corpus (offline default) and WMT16-style parallel text."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from recipes.data.common import ListDataset, RecipeDataModule, find_file, require_dir
from recipes.data.vocab import Vocab, pad_batch, teacher_forcing_pair

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
         "sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_to_words(n: int) -> list[str]:
    """English words for 0 <= n < 1,000,000, e.g. 45012 -> ['forty', 'five', 'thousand', 'twelve']."""
    if not 0 <= n < 1_000_000:
        raise ValueError(f"number_to_words handles 0..999999, got {n}")
    if n < 20:
        return [_ONES[n]]
    if n < 100:
        return [_TENS[n // 10]] + (number_to_words(n % 10) if n % 10 else [])
    if n < 1000:
        return [_ONES[n // 100], "hundred"] + (number_to_words(n % 100) if n % 100 else [])
    return number_to_words(n // 1000) + ["thousand"] + (number_to_words(n % 1000) if n % 1000 else [])


class Seq2SeqDataModule(RecipeDataModule):
    """Shared collate for (source tokens, target tokens) pairs -> (src, tgt_in, tgt_out), all batch first."""

    vocab: Vocab

    def encode_pairs(self, pairs: list[tuple[list[str], list[str]]]) -> ListDataset:
        samples = []
        for src, tgt in pairs:
            tgt_in, tgt_out = teacher_forcing_pair(self.vocab, tgt)
            samples.append((self.vocab.encode(src), tgt_in, tgt_out))
        return ListDataset(samples)

    def collate(self, samples: list[tuple[list[int], list[int], list[int]]]) -> tuple:
        src, tgt_in, tgt_out = zip(*samples)
        return pad_batch(src), pad_batch(tgt_in), pad_batch(tgt_out)

    def model_kwargs(self) -> dict[str, Any]:
        self.setup()
        # one shared vocabulary for both sides, as GNMT's shared BPE vocabulary
        return {"src_vocab_size": len(self.vocab), "tgt_vocab_size": len(self.vocab)}


class NumbersDataModule(Seq2SeqDataModule):
    """Digits -> words: '4 5 0 1 2' -> 'forty five thousand twelve'. Train and validation numbers are disjoint."""

    def __init__(self, batch_size: int = 64, num_train: int = 4000, num_val: int = 500, max_number: int = 99_999,
                 **kwargs: Any) -> None:
        super().__init__(batch_size, **kwargs)
        if num_train + num_val > max_number + 1:
            raise ValueError(f"data.num_train + data.num_val ({num_train + num_val}) exceeds the "
                             f"{max_number + 1} numbers up to data.max_number={max_number}")
        self.num_train, self.num_val, self.max_number = num_train, num_val, max_number

    def load(self) -> None:
        numbers = random.Random(self.seed).sample(range(self.max_number + 1), self.num_train + self.num_val)
        pairs = [(list(str(n)), number_to_words(n)) for n in numbers]
        self.vocab = Vocab.build(src + tgt for src, tgt in pairs)
        self.train_set = self.encode_pairs(pairs[: self.num_train])
        self.val_set = self.encode_pairs(pairs[self.num_train:])


class ParallelTextDataModule(Seq2SeqDataModule):
    """WMT16 En-De as prepared for GNMT (MLPerf): <prefix>.<lang> files, one tokenized (BPE) sentence a line.

    The vocabulary is `vocab_file` in the folder when present (one token a line, e.g. vocab.bpe.32000),
    else built from the training text, capped at `max_vocab`.
    """

    def __init__(self, path: str | None = None, batch_size: int = 64, src_lang: str = "en", tgt_lang: str = "de",
                 train_prefix: str = "train.tok.clean.bpe.32000", val_prefix: str = "newstest2014.tok.bpe.32000",
                 vocab_file: str = "vocab.bpe.32000", max_len: int = 50, max_vocab: int = 32000,
                 max_train_sentences: int | None = None, **kwargs: Any) -> None:
        super().__init__(batch_size, **kwargs)
        self.path, self.src_lang, self.tgt_lang = path, src_lang, tgt_lang
        self.train_prefix, self.val_prefix, self.vocab_file = train_prefix, val_prefix, vocab_file
        self.max_len, self.max_vocab, self.max_train_sentences = max_len, max_vocab, max_train_sentences

    def _read_pairs(self, root: Path, prefix: str, limit: int | None) -> list[tuple[list[str], list[str]]]:
        src_file = find_file(root, [f"{prefix}.{self.src_lang}"], f"{prefix} source text")
        tgt_file = find_file(root, [f"{prefix}.{self.tgt_lang}"], f"{prefix} target text")
        src_lines = src_file.read_text(encoding="utf-8").splitlines()
        tgt_lines = tgt_file.read_text(encoding="utf-8").splitlines()
        if len(src_lines) != len(tgt_lines):
            raise ValueError(f"{src_file.name} has {len(src_lines)} lines but {tgt_file.name} has {len(tgt_lines)}: "
                             "parallel files must be aligned line by line")
        pairs = [(s.split(), t.split()) for s, t in zip(src_lines, tgt_lines)]
        pairs = [(s, t) for s, t in pairs if 0 < len(s) <= self.max_len and 0 < len(t) <= self.max_len]
        return pairs[:limit] if limit else pairs

    def load(self) -> None:
        expected = (f"a folder with {self.train_prefix}.{{{self.src_lang},{self.tgt_lang}}} and "
                    f"{self.val_prefix}.{{{self.src_lang},{self.tgt_lang}}}")
        root = require_dir(self.path, "the WMT16-style parallel text", expected)
        train = self._read_pairs(root, self.train_prefix, self.max_train_sentences)
        val = self._read_pairs(root, self.val_prefix, None)
        if not train or not val:
            raise ValueError(f"{root}: no sentence pairs of 1..{self.max_len} tokens in the "
                             f"{'training' if not train else 'validation'} files")
        vocab_path = root / self.vocab_file
        if self.vocab_file and vocab_path.is_file():
            tokens = [line.strip() for line in vocab_path.read_text(encoding="utf-8").splitlines() if line.strip()]
            self.vocab = Vocab.build([tokens])  # keeps the file's tokens, specials first
        else:
            self.vocab = Vocab.build((s + t for s, t in train), max_size=self.max_vocab)
        self.train_set = self.encode_pairs(train)
        self.val_set = self.encode_pairs(val)
