"""Shared pieces of the data modules: path checks with clear errors, seeded splits, loader settings."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


def require_dir(path: str | None, what: str, expected: str) -> Path:
    """Return `path` as a directory or raise an error that says what was expected there and how to fix it."""
    if not path:
        raise ValueError(f"{what} needs data.path: set data.path=/path/to/dataset ({expected})")
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data.path={path} does not exist: point data.path at {what} ({expected})")
    if not p.is_dir():
        raise NotADirectoryError(f"data.path={path} is a file, not a folder: point data.path at {what} ({expected})")
    return p


def find_file(folder: Path, candidates: Sequence[str], what: str) -> Path:
    """The first of `candidates` that exists in `folder`, or an error listing what was looked for."""
    for name in candidates:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"no {what} in {folder}: expected one of {', '.join(candidates)}")


def seeded_permutation(n: int, seed: int) -> list[int]:
    """A permutation that is the same on every rank (the pipeline's stages must see the same samples)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


class ListDataset(Dataset):
    """A dataset over an in-memory list of samples."""

    def __init__(self, samples: Sequence[Any]) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        return self.samples[i]


class RecipeDataModule(L.LightningDataModule):
    """Base: subclasses fill `self.train_set`/`self.val_set` in `load()`; `setup` calls it once."""

    def __init__(self, batch_size: int, val_batch_size: int | None = None, num_workers: int = 0, seed: int = 0,
                 global_batch_size: int | None = None, pin_memory: bool | None = None) -> None:
        super().__init__()
        self.batch_size = batch_size
        # rows of one update over all data-parallel processes (DDP: batch_size per process x processes)
        self.global_batch_size = global_batch_size or batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.pin_memory = pin_memory  # None: when training on a GPU (Lightning then copies batches non-blocking)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def load(self) -> None:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.load()

    def collate(self, samples: list[Any]) -> Any:
        return torch.utils.data.default_collate(samples)

    @property
    def pinned(self) -> bool:
        """Whether the loaders pin their batches: asked for, or else whether the Trainer trains on a GPU."""
        if self.pin_memory is not None:
            return self.pin_memory
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        return device is not None and device.type == "cuda"

    def train_dataloader(self) -> DataLoader:
        # drop_last keeps every batch the same size, so it always splits into the configured micro-batches
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers, collate_fn=self.collate, pin_memory=self.pinned,
                          generator=torch.Generator().manual_seed(self.seed))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.val_batch_size, shuffle=False,
                          num_workers=self.num_workers, collate_fn=self.collate, pin_memory=self.pinned)

    def model_kwargs(self) -> dict[str, Any]:
        """What the model builder needs to know about the data (classes, vocabulary sizes, feature size)."""
        raise NotImplementedError
