"""Video-captioning data: generated clips of moving coloured shapes (offline default) and MSVD-style
frame features with captions from a path. A batch is (frame features (B, F, D), caption in, caption out)."""

from __future__ import annotations

import csv
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recipes.data.common import ListDataset, RecipeDataModule, find_file, require_dir
from recipes.data.vocab import Vocab, pad_batch, teacher_forcing_pair

COLOURS = {
    "red": (1.0, 0.1, 0.1),
    "green": (0.1, 0.9, 0.1),
    "blue": (0.1, 0.2, 1.0),
    "yellow": (1.0, 0.9, 0.1),
    "white": (1.0, 1.0, 1.0),
}
SHAPES = ("square", "circle", "triangle", "cross")
MOTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}


def _shape_mask(shape: str, size: int) -> np.ndarray:
    yy, xx = np.mgrid[:size, :size] - (size - 1) / 2
    r = size / 2
    masks = {
        "square": np.ones((size, size), bool),
        "circle": xx**2 + yy**2 <= r * r,
        "triangle": yy >= 2 * np.abs(xx) - r,
        "cross": (np.abs(xx) < r / 3) | (np.abs(yy) < r / 3),
    }
    return masks[shape]


def make_clip(
    colour: str, shape: str, motion: str, rng: random.Random, frames: int = 8, size: int = 16, shape_size: int = 5
) -> np.ndarray:
    """A (frames, size, size, 3) clip of one shape crossing the frame in one direction over a noisy background."""
    dy, dx = MOTIONS[motion]
    travel = size - shape_size
    step = travel / max(1, frames - 1)
    # the moving coordinate sweeps the frame; the other one is random
    fixed = rng.randint(0, travel)
    clip = np.random.default_rng(rng.randint(0, 2**31)).uniform(0, 0.15, (frames, size, size, 3))
    mask = _shape_mask(shape, shape_size)
    for t in range(frames):
        pos = round(t * step)
        y = fixed if dy == 0 else (pos if dy > 0 else travel - pos)
        x = fixed if dx == 0 else (pos if dx > 0 else travel - pos)
        patch = clip[t, y : y + shape_size, x : x + shape_size]
        patch[mask] = COLOURS[colour]
    return clip.astype(np.float32)


def caption(colour: str, shape: str, motion: str) -> list[str]:
    return ["a", colour, shape, "moves", motion]


def tokenize_caption(text: str) -> list[str]:
    """Lower-case words without punctuation, as MSVD captions are usually prepared."""
    return re.findall(r"[a-z0-9']+", text.lower())


class CaptionDataModule(RecipeDataModule):
    """Shared collate: pad frames (at the end) and captions of a batch."""

    vocab: Vocab
    feature_size: int

    def encode(self, clips: list[tuple[np.ndarray, list[str]]]) -> ListDataset:
        samples = []
        for feats, words in clips:
            cap_in, cap_out = teacher_forcing_pair(self.vocab, words)
            samples.append((torch.as_tensor(feats, dtype=torch.float32), cap_in, cap_out))
        return ListDataset(samples)

    def collate(self, samples: list[tuple[torch.Tensor, list[int], list[int]]]) -> tuple:
        feats, cap_in, cap_out = zip(*samples)
        longest = max(f.size(0) for f in feats)
        frames = torch.zeros(len(feats), longest, feats[0].size(1))
        for i, f in enumerate(feats):
            frames[i, : f.size(0)] = f
        return frames, pad_batch(cap_in), pad_batch(cap_out)

    def model_kwargs(self) -> dict[str, Any]:
        self.setup()
        return {"feature_size": self.feature_size, "vocab_size": len(self.vocab)}


class ShapesDataModule(CaptionDataModule):
    """Clips of a coloured shape moving left/right/up/down, captioned 'a red circle moves left'.
    The frame features are the frames' standardised pixels (a stand-in for the CNN features S2VT reads)."""

    def __init__(
        self,
        batch_size: int = 32,
        num_train: int = 4000,
        num_val: int = 200,
        frames: int = 8,
        size: int = 16,
        **kwargs: Any,
    ) -> None:
        super().__init__(batch_size, **kwargs)
        self.num_train, self.num_val, self.frames, self.size = num_train, num_val, frames, size

    def load(self) -> None:
        rng = random.Random(self.seed)
        clips = []
        for _ in range(self.num_train + self.num_val):
            what = (rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(list(MOTIONS)))
            clip = make_clip(*what, rng, frames=self.frames, size=self.size)
            clips.append((clip.reshape(self.frames, -1), caption(*what)))
        # standardise with the training clips' statistics: on raw [0, 1] pixels the motion words stay at
        # chance for many epochs (an optimisation plateau); standardised, they are learnt in a few
        train = np.stack([feats for feats, _ in clips[: self.num_train]])
        mean, std = float(train.mean()), float(train.std())
        clips = [((feats - mean) / std, words) for feats, words in clips]
        self.feature_size = clips[0][0].shape[1]
        self.vocab = Vocab.build(words for _, words in clips)
        self.train_set = self.encode(clips[: self.num_train])
        self.val_set = self.encode(clips[self.num_train :])


class MSVDDataModule(CaptionDataModule):
    """MSVD: <path>/<captions_file> in the corpus' CSV layout (VideoID, Start, End, ..., Language, Description)
    and <path>/<features_dir>/<VideoID>_<Start>_<End>.npy, a (frames, dim) array per clip (e.g. VGG fc7).

    Clips are taken in the CSV's order: the first 1,200 train and the next 100 validate (the usual split)
    when there are at least 1,300 clips, else the first 90% train. Every English caption is a sample.
    """

    def __init__(
        self,
        path: str | None = None,
        batch_size: int = 32,
        captions_file: str = "MSR Video Description Corpus.csv",
        features_dir: str = "features",
        max_frames: int = 80,
        max_caption_len: int = 20,
        max_vocab: int = 10000,
        **kwargs: Any,
    ) -> None:
        super().__init__(batch_size, **kwargs)
        self.path, self.captions_file, self.features_dir = path, captions_file, features_dir
        self.max_frames, self.max_caption_len, self.max_vocab = max_frames, max_caption_len, max_vocab

    def _read_captions(self, root: Path) -> dict[str, list[list[str]]]:
        csv_path = find_file(root, [self.captions_file, "captions.csv"], "MSVD caption CSV")
        captions: dict[str, list[list[str]]] = {}
        with csv_path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = {"VideoID", "Start", "End", "Language", "Description"} - set(reader.fieldnames or [])
            if missing:
                raise ValueError(f"{csv_path} lacks the column(s) {', '.join(sorted(missing))} of MSVD's corpus CSV")
            for row in reader:
                words = tokenize_caption(row["Description"] or "")
                if row["Language"] == "English" and 0 < len(words) <= self.max_caption_len:
                    captions.setdefault(f"{row['VideoID']}_{row['Start']}_{row['End']}", []).append(words)
        if not captions:
            raise ValueError(f"{csv_path} has no English captions of 1..{self.max_caption_len} words")
        return captions

    def load(self) -> None:
        root = require_dir(
            self.path,
            "an MSVD-style folder",
            f"with '{self.captions_file}' and {self.features_dir}/<VideoID>_<Start>_<End>.npy",
        )
        captions = self._read_captions(root)
        clip_ids = list(captions)
        missing = [c for c in clip_ids if not (root / self.features_dir / f"{c}.npy").is_file()]
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} clip(s) have captions but no features, e.g. "
                f"{root / self.features_dir / (missing[0] + '.npy')}"
            )
        n_train = 1200 if len(clip_ids) >= 1300 else max(1, int(len(clip_ids) * 0.9))
        n_val = 100 if len(clip_ids) >= 1300 else len(clip_ids) - n_train
        if n_val < 1:
            raise ValueError(f"{root}: {len(clip_ids)} clip(s) is too few for a train and a validation split")
        split = {"train": clip_ids[:n_train], "val": clip_ids[n_train : n_train + n_val]}
        self.vocab = Vocab.build((w for c in split["train"] for w in captions[c]), max_size=self.max_vocab)
        sets = {}
        for name, ids in split.items():
            pairs = []
            for clip_id in ids:
                feats = np.load(root / self.features_dir / f"{clip_id}.npy")[: self.max_frames]
                if feats.ndim != 2:
                    raise ValueError(f"{clip_id}.npy has shape {feats.shape}; expected (frames, feature_dim)")
                pairs += [(feats, words) for words in captions[clip_id]]
            sets[name] = pairs
        self.feature_size = int(sets["train"][0][0].shape[1])
        self.train_set, self.val_set = self.encode(sets["train"]), self.encode(sets["val"])
