"""Pipeline-parallel training for PyTorch Lightning: GPipe, 1F1B and PipeDream with weight stashing.

The top-level names load on first use, so that ``lightning_pipedream.schedule``, ``.plan`` and
``.cli`` never import Lightning. ``import lightning_pipedream`` still registers
``Trainer(strategy="pipedream")`` (and ``"pipedream_1f1b"``, ``"pipedream_gpipe"``): at once if
Lightning is already imported, otherwise as soon as ``lightning.pytorch`` finishes importing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it
_LAZY = {
    "PipeDreamStrategy": "lightning_pipedream.strategy",
    "Pipeline": "lightning_pipedream.runtime.pipeline",
    "SCHEDULES": "lightning_pipedream.schedule.builders",
    "build_schedule": "lightning_pipedream.schedule.builders",
    "generate": "lightning_pipedream.strategy.inference.generation",
    "generates": "lightning_pipedream.strategy.inference.generation",
}

__all__ = ["PipeDreamStrategy", "Pipeline", "SCHEDULES", "build_schedule", "generate", "generates",
           "__version__"]

_LIGHTNING = "lightning.pytorch"
_STRATEGY = "lightning_pipedream.strategy"  # registers its names with Lightning's StrategyRegistry on import


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'lightning_pipedream' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when ``lightning.pytorch`` is imported, wraps its loader so that the
    strategy module is imported (and registers its names) right after ``lightning.pytorch`` is complete.

    Hooking the finished top package rather than ``lightning.pytorch.strategies`` matters: the strategy
    module imports ``Trainer`` and ``LightningModule``, which exist only once ``lightning.pytorch`` is done.
    """

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _LIGHTNING:
            return None
        _remove_hook()  # one shot, and no recursion through the find_spec below
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    """A loader that runs another one, then imports the strategy module."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        importlib.import_module(_STRATEGY)

    def __getattr__(self, name: str) -> Any:  # resource readers and the like: the real loader's
        return getattr(self._loader, name)


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterAfterLightning)]


def _register_strategy_names() -> None:
    if _LIGHTNING in sys.modules:
        importlib.import_module(_STRATEGY)
    elif not any(isinstance(f, _RegisterAfterLightning) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightning())


_register_strategy_names()
