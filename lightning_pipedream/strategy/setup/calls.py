"""How a LightningModule meets the pipeline: its Sequential, the stand-ins around it, how its step calls the model."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_pipedream.strategy.reporting.logs import LogRecorder


class InputCaptured(BaseException):
    """Raised inside the user's step to stop it once the pipeline's input is known.

    A BaseException, so that a user's ``except Exception`` does not swallow it.
    """

    def __init__(self, value: Any) -> None:
        super().__init__("pipeline input captured")
        self.value = value


def find_layers(module: LightningModule, name: str | None, allow_ties: bool = False) -> tuple[str, nn.Sequential]:
    """Find the module's ``nn.Sequential`` to split into stages, and check the module fits the contract.
    ``allow_ties``: layers may share a parameter (see :func:`shared_parameters`)."""
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
            if owner.setdefault(id(p), layer_name) != layer_name and not allow_ties:
                raise ValueError(
                    f"Layers {owner[id(p)]!r} and {layer_name!r} of {cls}.{name} share a parameter; "
                    "find_layers(..., allow_ties=True) accepts that (PipeDreamStrategy does: each stage holding it "
                    "keeps a copy and the copies' gradients are summed before every update)."
                )
    if len(layers) == 0:
        raise ValueError(f"{cls}.{name} is an empty nn.Sequential; it needs at least one layer per stage.")
    return name, layers


def shared_parameters(layers: nn.Sequential) -> dict[str, list[str]]:
    """Parameters that several layers of ``layers`` use (an embedding tied to the decoder): the first name of
    each (``"0.embed.weight"``) -> every name it has in the Sequential, in order."""
    names: dict[int, list[str]] = {}
    for layer_name, layer in layers._modules.items():
        for name, p in layer.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(f"{layer_name}.{name}")
    return {found[0]: found for found in names.values()
            if len({n.split(".", 1)[0] for n in found}) > 1}


@contextmanager
def swap_layers(module: nn.Module, name: str, replacement: nn.Module) -> Iterator[None]:
    """Temporarily put ``replacement`` where the module's Sequential is."""
    original = module._modules[name]
    module._modules[name] = replacement
    try:
        yield
    finally:
        module._modules[name] = original


class Elsewhere(nn.Module):
    """Stands in for a layer that lives on another stage's process."""

    def __init__(self, name: str, stage: int, shadow: nn.Module | None = None) -> None:
        super().__init__()
        self.layer_name, self.stage = name, stage
        # The layer on the meta device (setup/optimizer_layouts.py), not a child: no state, moves, or parameters.
        object.__setattr__(self, "shadow", shadow)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Layer {self.layer_name!r} lives on pipeline stage {self.stage}, another process. Under "
            "PipeDreamStrategy the layers run only through the pipeline, from training_step, validation_step, "
            "test_step or predict_step, each calling self(x) (or the Sequential) once. A forward anywhere else (a "
            "hook such as on_fit_start or on_validation_epoch_end, a callback, a single layer) cannot run on one "
            "process: move it into a step."
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


class SequentialCall:
    """The pipelined call is the module's ``nn.Sequential`` attribute ``name``; its one argument is the input."""

    def __init__(self, name: str) -> None:
        self.name = name

    def input_of(self, module: LightningModule, hook: str, *args: Any, **kwargs: Any) -> Any:
        return capture_layers_input(module, self.name, hook, *args, **kwargs)

    @contextmanager
    def replaying(self, module: LightningModule, output: Any) -> Iterator[None]:
        with swap_layers(module, self.name, Replay(output)):
            yield


class ForwardCall:
    """The pipelined call is the LightningModule's own ``forward`` (``self(...)`` in a step); its input is
    ``(args, kwargs)`` of that call, with any tensors, masks and keyword arguments."""

    def _called(self, module: LightningModule) -> nn.Module:
        """The module whose call is pipelined."""
        return module

    def _not_called(self, module: LightningModule, hook: str) -> str:
        return (f"{type(module).__name__}.{hook} returned without calling self(...). Under PipeDreamStrategy every "
                "step must call the model's forward exactly once, through self(...), with the inputs to pipeline.")

    def input_of(self, module: LightningModule, hook: str, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Run the user's step until it makes the pipelined call, and return that call's ``(args, kwargs)``."""

        def stop(*call_args: Any, **call_kwargs: Any) -> Any:
            raise InputCaptured((call_args, call_kwargs))

        step = getattr(module, hook)
        try:
            with _forward_replaced(self._called(module), stop), LogRecorder().capture(module, 1), \
                    explaining_meta_calls(module, hook):
                step(*args, **kwargs)
        except InputCaptured as captured:
            return captured.value
        raise RuntimeError(self._not_called(module, hook))

    @contextmanager
    def replaying(self, module: LightningModule, output: Any) -> Iterator[None]:
        with _forward_replaced(self._called(module), lambda *args, **kwargs: output):
            yield


class SubmoduleCall(ForwardCall):
    """The pipelined call is the submodule ``name``'s forward, with any arguments: the model a step calls directly
    (``self.model(input_ids=ids, labels=ids)``), or split points given for a model whose own forward cannot be
    traced. The step's code around that call runs as it is on the first stage (up to the call) and on the last
    (after it)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _called(self, module: LightningModule) -> nn.Module:
        return module.get_submodule(self.name)

    def _not_called(self, module: LightningModule, hook: str) -> str:
        return (f"{type(module).__name__}.{hook} returned without calling self.{self.name}. PipeDreamStrategy "
                f"pipelines the call of self.{self.name}: every step must call it exactly once.")


class _CalledFirst(InputCaptured):
    """Which call a step made first: ``name`` "" for self(...), else the child module's name."""

    def __init__(self, name: str, value: Any) -> None:
        super().__init__(value)
        self.name = name


def whole_model_children(module: nn.Module) -> list[str]:
    """The direct children of ``module`` that hold every trainable parameter of it (a LightningModule's
    ``self.model``): a step may call one of them directly instead of ``self(...)``."""
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    if not trainable:
        return []
    return [name for name, child in module.named_children()
            if trainable <= {id(p) for p in child.parameters()}]


def pipelined_call(module: LightningModule, hook: str, *args: Any, **kwargs: Any) -> tuple[ForwardCall, Any]:
    """Which call of ``module.<hook>`` the pipeline runs, and that call's ``(args, kwargs)``: the LightningModule's
    own forward, ``self(...)``; or, when the step calls a child that holds every trainable parameter directly (Hugging
    Face's idiom ``self.model(input_ids=ids, labels=ids).loss``), that child's call (:class:`SubmoduleCall`).
    Whichever the step makes first; runs the step up to it."""
    children = whole_model_children(module)

    def stop(name: str) -> Any:
        def stopped(*call_args: Any, **call_kwargs: Any) -> Any:
            raise _CalledFirst(name, (call_args, call_kwargs))
        return stopped

    replaced = [module] + [module.get_submodule(name) for name in children]
    for target, name in zip(replaced, ["", *children]):
        target.forward = stop(name)  # an instance attribute shadows the class's forward, which __call__ runs
    try:
        with LogRecorder().capture(module, 1), explaining_meta_calls(module, hook):
            getattr(module, hook)(*args, **kwargs)
    except _CalledFirst as called:
        return (SubmoduleCall(called.name) if called.name else ForwardCall()), called.value
    finally:
        for target in replaced:
            del target.forward
    direct = " or ".join(f"self.{name}(...)" for name in children)
    raise RuntimeError(
        f"{type(module).__name__}.{hook} returned without calling self(...){' or ' + direct if direct else ''}. "
        "Under PipeDreamStrategy every step must call the model's forward exactly once, through self(...) (or a "
        "child module that holds all its parameters, such as self.model(...)), with the inputs to pipeline."
    )


def innermost_called_module(module: LightningModule, split_points: list[str], hook: str, *args: Any,
                            **kwargs: Any) -> str | None:
    """The innermost module holding every split point that ``module.<hook>(*args)`` calls exactly once (a
    container such as nn.ModuleList has no call of its own); None if there is none but the module itself.

    Runs the step once, without gradients, up to the end of ``module``'s forward (so that the code after
    it, metrics and logging, does not run), to count the calls.
    """
    parents = [point.split(".")[:-1] for point in split_points]
    common: list[str] = []
    for parts in zip(*parents):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    candidates = [".".join(common[:n]) for n in range(len(common), 0, -1)]  # innermost first
    candidates = [c for c in candidates if type(module.get_submodule(c)).forward is not nn.Module.forward]
    calls = dict.fromkeys(candidates, 0)
    handles = [module.get_submodule(c).register_forward_pre_hook(lambda *_, c=c: calls.__setitem__(c, calls[c] + 1))
               for c in candidates]
    def forward_then_stop(*call_args: Any, **call_kwargs: Any) -> Any:
        type(module).forward(module, *call_args, **call_kwargs)
        raise InputCaptured(None)

    try:
        with torch.no_grad(), LogRecorder().capture(module, 1), _forward_replaced(module, forward_then_stop):
            getattr(module, hook)(*args, **kwargs)
    except InputCaptured:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return next((c for c in candidates if calls[c] == 1), None)


@contextmanager
def _forward_replaced(module: nn.Module, forward: Any) -> Iterator[None]:
    module.forward = forward  # an instance attribute shadows the class's forward, which nn.Module.__call__ runs
    try:
        yield
    finally:
        del module.forward


def loss_of(step_output: Any) -> Tensor:
    value = step_output.get("loss") if isinstance(step_output, Mapping) else step_output
    if not isinstance(value, Tensor) or value.dim() != 0:
        if step_output is None:
            raise TypeError(
                "training_step returned None, which Lightning takes as 'skip this batch'. PipeDreamStrategy cannot "
                "skip a batch from the last stage's training_step: the other stages have already run its forward "
                "(and, asynchronously, later batches). Leave such batches out before they reach the Trainer (filter "
                "them in the dataset, sampler or collate_fn), or return the loss."
            )
        raise TypeError(
            "Under PipeDreamStrategy training_step must return the loss as a scalar tensor (or a dict with a "
            f"'loss' scalar); it returned {type(step_output).__name__}."
        )
    return value


class MetaModuleCalledError(RuntimeError):
    """A step ran a module built on the meta device outside the pipelined call."""


@contextmanager
def explaining_meta_calls(module: LightningModule, hook: str) -> Iterator[None]:
    """Torch's words for a module run with meta tensors (no data to compute with) become what happened and what to
    do, when ``module`` was built on the meta device: a step ran one of its submodules itself, outside the pipeline."""
    try:
        yield
    except (NotImplementedError, RuntimeError) as err:
        if isinstance(err, MetaModuleCalledError) or "meta" not in str(err):
            raise
        from lightning_pipedream.runtime.stages.materialize import has_meta_tensors

        if not has_meta_tensors(module):
            raise
        raise MetaModuleCalledError(
            f"{type(module).__name__}.{hook} ran a module whose weights are on the meta device, outside the pipelined "
            f"call ({type(err).__name__}: {err}). Under PipeDreamStrategy a model built in configure_model (or under "
            "trainer.init_module(empty_init=True)) stays a meta skeleton: each rank holds only its own stage's "
            "weights, inside the pipeline, so a direct call such as self.model(...) has nothing to compute with. Call "
            "the LightningModule itself, self(...), whose forward the strategy pipelines, and compute the rest from "
            "what it returns; to run the whole model in one process, consolidate a checkpoint (python -m "
            "lightning_pipedream checkpoint consolidate) and load it without the strategy."
        ) from err
