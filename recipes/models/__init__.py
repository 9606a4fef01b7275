"""Model registry: name -> builder of an `nn.Sequential` that the pipeline strategy can partition."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from recipes.models.awd_lstm import awd_lstm
from recipes.models.gnmt import gnmt
from recipes.models.image import alexnet, digits_cnn, resnet50, vgg16
from recipes.models.s2vt import s2vt

# name -> (task it belongs to, builder)
MODELS: dict[str, tuple[str, Callable[..., nn.Sequential]]] = {
    "digits_cnn": ("image", digits_cnn),
    "vgg16": ("image", vgg16),
    "resnet50": ("image", resnet50),
    "alexnet": ("image", alexnet),
    "gnmt8": ("translation", gnmt),
    "gnmt16": ("translation", gnmt),
    "awd_lstm": ("language_model", awd_lstm),
    "s2vt": ("video_captioning", s2vt),
}


def models_for(task: str) -> list[str]:
    """The model names that belong to `task`."""
    return [name for name, (model_task, _) in MODELS.items() if model_task == task]


def build_model(name: str, task: str, **kwargs: Any) -> nn.Sequential:
    """Build model `name` for `task`; a clear error for an unknown name or a model of another task."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)} (e.g. model=digits_cnn)")
    model_task, builder = MODELS[name]
    if model_task != task:
        raise ValueError(f"model {name!r} is a {model_task} model, but task={task}; "
                         f"for task={task} choose one of: {', '.join(models_for(task))}")
    return builder(**kwargs)
