"""How a LightningModule meets the pipeline: its Sequential, its self.log calls, its optimizer layout."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn


class InputCaptured(BaseException):
    """Raised inside the user's step to stop it once the pipeline's input is known.

    A BaseException, so that a user's ``except Exception`` does not swallow it.
    """

    def __init__(self, value: Any) -> None:
        super().__init__("pipeline input captured")
        self.value = value


def find_layers(module: LightningModule, name: str | None) -> tuple[str, nn.Sequential]:
    """Find the module's ``nn.Sequential`` to split into stages, and check the module fits the contract."""
    cls = type(module).__name__
    if name is not None:
        layers = getattr(module, name, None)
        if not isinstance(layers, nn.Sequential):
            raise ValueError(
                f"PipeDreamStrategy(layers={name!r}): {cls}.{name} is {type(layers).__name__}, not an nn.Sequential. "
                "Name the attribute that holds the model's layers as an nn.Sequential."
            )
    else:
        candidates = [n for n, child in module.named_children() if isinstance(child, nn.Sequential)]
        if not candidates:
            children = ", ".join(f"{n} ({type(c).__name__})" for n, c in module.named_children()) or "none"
            raise ValueError(
                f"PipeDreamStrategy needs the model's layers in one nn.Sequential attribute, e.g. "
                f"`self.layers = nn.Sequential(...)` with forward returning `self.layers(x)`; {cls} has none "
                f"(its children: {children}). Put the layers to split into stages in an nn.Sequential, or pass "
                "PipeDreamStrategy(layers='<attribute name>')."
            )
        if len(candidates) > 1:
            raise ValueError(
                f"{cls} has several nn.Sequential attributes ({', '.join(candidates)}); name the one to split "
                "into stages with PipeDreamStrategy(layers='...')."
            )
        name = candidates[0]
        layers = getattr(module, name)
    outside = [n for n, p in module.named_parameters() if not n.startswith(f"{name}.")]
    if outside:
        raise ValueError(
            f"{cls} has parameters outside self.{name}: {', '.join(outside[:5])}. Under PipeDreamStrategy every "
            f"trainable parameter must belong to one layer of self.{name}; move them into a layer."
        )
    owner: dict[int, str] = {}
    for layer_name, layer in layers._modules.items():  # named_children() would hide a repeated layer
        for p in layer.parameters():
            if owner.setdefault(id(p), layer_name) != layer_name:
                raise ValueError(
                    f"Layers {owner[id(p)]!r} and {layer_name!r} of {cls}.{name} share a parameter; stages on "
                    "different processes cannot share weights. Tie weights only within one layer."
                )
    if len(layers) == 0:
        raise ValueError(f"{cls}.{name} is an empty nn.Sequential; it needs at least one layer per stage.")
    return name, layers


@contextmanager
def swap_layers(module: nn.Module, name: str, replacement: nn.Module) -> Iterator[None]:
    """Temporarily put ``replacement`` where the module's Sequential is."""
    original = module._modules[name]
    module._modules[name] = replacement
    try:
        yield
    finally:
        module._modules[name] = original


_LOG_SIGNATURE = inspect.signature(LightningModule.log)


@dataclass
class _Record:
    value: float
    weight: float
    options: dict[str, Any]


class LogRecorder:
    """Collects the ``self.log`` calls of a step's micro-batches, to log their batch value once on every rank.

    The last stage runs the user's step once per micro-batch; each value is averaged over the
    micro-batches weighted by their size, which for mean-reduced metrics gives the batch's value.
    Metric objects are logged by their value on that micro-batch.
    """

    def __init__(self) -> None:
        self.records: dict[str, list[_Record]] = {}

    @contextmanager
    def capture(self, module: LightningModule, weight: float) -> Iterator[None]:
        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            bound = _LOG_SIGNATURE.bind(module, name, value, *args, **kwargs)
            options = {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}
            options.update(options.pop("kwargs", {}) or {})
            w = float(options.pop("batch_size", None) or weight)
            self.records.setdefault(name, []).append(_Record(_as_float(value, name), w, options))

        module.log = log  # type: ignore[method-assign]  # an instance attribute shadows the method
        try:
            yield
        finally:
            del module.log

    def aggregate(self) -> list[tuple[str, float, dict[str, Any]]]:
        out = []
        for name, records in self.records.items():
            total = sum(r.weight for r in records)
            value = sum(r.value * r.weight for r in records) / total
            options = dict(records[-1].options)
            options["sync_dist"] = False  # every rank logs the same value: nothing to reduce
            options["batch_size"] = int(total)
            out.append((name, value, options))
        return out

    @staticmethod
    def replay(module: LightningModule, logs: list[tuple[str, float, dict[str, Any]]]) -> None:
        for name, value, options in logs:
            module.log(name, torch.tensor(value), **options)


def _as_float(value: Any, name: str) -> float:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover
        Metric = ()  # type: ignore[assignment]
    if isinstance(value, Metric):
        cached = getattr(value, "_forward_cache", None)
        value = cached if cached is not None else value.compute()
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; log a scalar.")
        return float(value.detach().float().cpu())
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(f"self.log({name!r}, ...) got {type(value).__name__}; under PipeDreamStrategy log scalars or Metrics.")


@dataclass
class OptimizerLayout:
    """One optimizer's parameter groups over the whole model, by parameter name.

    Checkpoints keep optimizer state in single-device form (indices over the whole model's
    groups), so a checkpoint resumes with any number of stages, and a single-device one too.
    """

    groups: list[list[str]]

    @classmethod
    def of_module(cls, module: LightningModule, init: Callable[[LightningModule], Any]) -> list[OptimizerLayout]:
        """Build the layouts by running ``configure_optimizers`` once on the whole model."""
        optimizers = init(module)[0]
        names = {id(p): n for n, p in module.named_parameters()}
        return [cls([[names[id(p)] for p in g["params"]] for g in opt.param_groups]) for opt in optimizers]

    @staticmethod
    def _local_order(optimizer: torch.optim.Optimizer, local_names: dict[int, str]) -> list[str]:
        return [local_names[id(p)] for g in optimizer.param_groups for p in g["params"]]

    def named_state(self, optimizer: torch.optim.Optimizer, local_names: dict[int, str]) -> dict[str, Any]:
        """This rank's optimizer state keyed by parameter name, and its groups' settings."""
        state = optimizer.state_dict()
        order = self._local_order(optimizer, local_names)
        named = {order[int(i)]: _cpu(s) for i, s in state["state"].items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
        return {"state": named, "groups": groups}

    def to_full(self, optimizer: torch.optim.Optimizer, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """Merge every rank's named state into one single-device optimizer state dict."""
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part["state"])
        state, groups, j = {}, [], 0
        for gi, names in enumerate(self.groups):
            settings = next((p["groups"][gi] for p in parts if gi < len(p["groups"])), {})
            indices = []
            for name in names:
                if name in merged:
                    state[j] = merged[name]
                indices.append(j)
                j += 1
            groups.append({**settings, "params": indices})
        return {"state": state, "param_groups": groups}

    def to_local(
        self, optimizer: torch.optim.Optimizer, full: dict[str, Any], local_names: dict[int, str]
    ) -> dict[str, Any]:
        """Pick this rank's part of a single-device optimizer state dict."""
        full_names = [n for names in self.groups for n in names]
        count = sum(len(g["params"]) for g in full["param_groups"])
        if count != len(full_names) or len(full["param_groups"]) != len(self.groups):
            raise ValueError(
                f"The checkpoint's optimizer has {len(full['param_groups'])} groups over {count} parameters, but "
                f"configure_optimizers now builds {len(self.groups)} groups over {len(full_names)}; the checkpoint "
                "is from a different model or optimizer setup."
            )
        by_name = {full_names[int(j)]: s for j, s in full["state"].items()}
        order = self._local_order(optimizer, local_names)
        groups, offset = [], 0
        for gi, group in enumerate(optimizer.param_groups):
            settings = {k: v for k, v in full["param_groups"][gi].items() if k != "params"}
            groups.append({**settings, "params": list(range(offset, offset + len(group["params"])))})
            offset += len(group["params"])
        state = {i: by_name[n] for i, n in enumerate(order) if n in by_name}
        return {"state": state, "param_groups": groups}


def _cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    return value


class Elsewhere(nn.Module):
    """Stands in for a layer that lives on another stage's process."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.layer_name, self.stage = name, stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Layer {self.layer_name!r} lives on pipeline stage {self.stage}, another process. Under "
            "PipeDreamStrategy the layers run only through the pipeline: call self(x) (or the Sequential) "
            "from training/validation/test/predict_step, not a single layer."
        )

    def extra_repr(self) -> str:
        return f"{self.layer_name!r} on stage {self.stage}"


class Replay(nn.Module):
    """Stands in for the whole Sequential on the last stage: returns the pipeline's output."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


class _Capture(nn.Module):
    """Stands in for the whole Sequential on the first stage: catches its input and stops the step."""

    def forward(self, x: Any, *rest: Any, **kwargs: Any) -> Any:
        if rest or kwargs:
            raise TypeError(
                "The pipelined nn.Sequential must be called with one argument (a tensor or a tuple/dict of tensors); "
                f"it got {1 + len(rest)} positional and {len(kwargs)} keyword arguments."
            )
        raise InputCaptured(x)


def capture_layers_input(module: LightningModule, name: str, hook: str, *args: Any, **kwargs: Any) -> Any:
    """Run the user's step until it calls the Sequential, and return that call's input."""
    step = getattr(module, hook)
    try:
        with swap_layers(module, name, _Capture()), LogRecorder().capture(module, 1):
            step(*args, **kwargs)
    except InputCaptured as captured:
        return captured.value
    raise RuntimeError(
        f"{type(module).__name__}.{hook} returned without calling self.{name} (through self(x) / forward). "
        f"Under PipeDreamStrategy every step must run the model's layers exactly once, via self(x)."
    )


def loss_of(step_output: Any) -> Tensor:
    value = step_output.get("loss") if isinstance(step_output, Mapping) else step_output
    if not isinstance(value, Tensor) or value.dim() != 0:
        raise TypeError(
            "Under PipeDreamStrategy training_step must return the loss as a scalar tensor (or a dict with a "
            f"'loss' scalar); it returned {type(step_output).__name__}. Skipping a step by returning None is "
            "not supported: the other stages have already run it."
        )
    return value
