"""Data-module registry: name -> (task, LightningDataModule class)."""

from __future__ import annotations

from typing import Any

from recipes.data.common import RecipeDataModule
from recipes.data.image import DigitsDataModule, ImageFolderDataModule
from recipes.data.language_model import ShakespeareDataModule, TokenFileDataModule
from recipes.data.translation import NumbersDataModule, ParallelTextDataModule
from recipes.data.video import MSVDDataModule, ShapesDataModule

DATA: dict[str, tuple[str, type[RecipeDataModule]]] = {
    "digits": ("image", DigitsDataModule),
    "imagefolder": ("image", ImageFolderDataModule),
    "numbers": ("translation", NumbersDataModule),
    "wmt16": ("translation", ParallelTextDataModule),
    "shakespeare": ("language_model", ShakespeareDataModule),
    "wikitext": ("language_model", TokenFileDataModule),
    "shapes": ("video_captioning", ShapesDataModule),
    "msvd": ("video_captioning", MSVDDataModule),
}


def build_datamodule(name: str, task: str, **kwargs: Any) -> RecipeDataModule:
    """Build data module `name` for `task`; a clear error for an unknown name or data of another task."""
    if name not in DATA:
        raise ValueError(f"unknown data {name!r}; choose one of: {', '.join(DATA)}")
    data_task, cls = DATA[name]
    if data_task != task:
        choices = ", ".join(n for n, (t, _) in DATA.items() if t == task)
        raise ValueError(
            f"data {name!r} is for task={data_task}, but task={task}; for task={task} choose one of: {choices}"
        )
    return cls(**kwargs)
