"""Per-stage construction: a model built on the meta device gets real weights only for this rank's stage."""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Collection

import torch
from torch import nn


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the meta device (shapes without storage)."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def balance_by_parameters(layers: nn.Sequential, stages: int) -> list[int]:
    """Layers per stage that even out the stages' parameter bytes, read from the shapes (nothing is allocated
    or run: a model on the meta device cannot be profiled)."""
    from lightning_pipedream.plan.partition import partition
    from lightning_pipedream.plan.profile import LayerProfile, Profile
    from lightning_pipedream.plan.topology import Topology

    sizes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
    profile = Profile([LayerProfile(name, 0.0, 0.0, 0, size) for name, size in zip(layers._modules, sizes)])
    return partition(profile, Topology.flat(stages), "parameters").balance


def layer_seed(base: int, name: str) -> int:
    """The seed that initializes submodule ``name``: the same whatever stage holds it, so that a model built
    per stage equals the same model built whole (by :func:`materialize` on one process)."""
    digest = hashlib.sha256(f"{base}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def materialize(module: nn.Module, device: torch.device, base_seed: int, prefix: str = "", *,
                names: Collection[str] | None = None, loaded: Collection[str] = ()) -> int:
    """Give every parameter and buffer of ``module`` still on the meta device real storage on ``device``,
    initialized by its submodule's own ``reset_parameters()`` under :func:`layer_seed` of its qualified name.

    A submodule without ``reset_parameters()`` is initialized by the nearest enclosing module's
    ``_init_weights(submodule)`` (Hugging Face models' convention, which also recomputes a rotary embedding's
    ``inv_freq``), under the same seed.

    ``names``: only the submodules holding one of these (qualified) tensors: this rank's stage of a model split
    from its graph; ``None`` for all. ``loaded``: qualified names whose values come from pretrained weights next;
    a submodule whose tensors are all among them only gets storage (no initialization to overwrite).

    Returns the bytes allocated. Modules already materialized are left as they are.
    """
    allocated = 0
    wanted = set(names) if names is not None else None
    loaded = set(loaded)
    initializers = _enclosing_initializers(module)
    for name, sub in module.named_modules():
        qualified = f"{prefix}{name}" if name else prefix.rstrip(".")
        own = [(f"{qualified}.{leaf}" if qualified else leaf, t)
               for table in (sub._parameters, sub._buffers) for leaf, t in table.items() if t is not None]
        if not any(t.is_meta for _, t in own):
            continue
        if wanted is not None and not any(n in wanted for n, _ in own):
            continue
        sub.to_empty(device=device, recurse=False)
        allocated += sum(t.numel() * t.element_size() for _, t in own)
        if all(n in loaded for n, _ in own):
            continue
        reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
        if reset is None and name in initializers:
            reset = functools.partial(initializers[name], sub)
        if reset is None:
            raise ValueError(
                f"{type(sub).__name__} {qualified!r} was built on the meta device but has no reset_parameters(), "
                "so PipeDreamStrategy cannot initialize its weights on the stage that holds it. Give it a "
                "reset_parameters() method that initializes its parameters and buffers, or build it on a real device."
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(base_seed, qualified))
            reset()
    left = [n for n, t in itertools.chain(module.named_parameters(), module.named_buffers())
            if t.is_meta and (wanted is None or f"{prefix}{n}" in wanted)]
    if left:  # e.g. a reset_parameters() that left a buffer alone
        raise ValueError(
            f"After reset_parameters(), {left[:4]} are still on the meta device: PipeDreamStrategy cannot "
            "initialize them. Make their module's reset_parameters() set them, or build that module on a real device."
        )
    return allocated


def _enclosing_initializers(module: nn.Module) -> dict[str, Callable[[nn.Module], None]]:
    """Submodule name -> the ``_init_weights`` of the nearest module above it (or itself) that has one."""
    found: dict[str, Callable[[nn.Module], None]] = {}

    def walk(sub: nn.Module, name: str, inherited: Callable[[nn.Module], None] | None) -> None:
        own = getattr(sub, "_init_weights", None)
        current = own if callable(own) else inherited
        if current is not None:
            found[name] = current
        for child_name, child in sub.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, current)

    walk(module, "", None)
    return found


def keep_meta_tensors(module: nn.Module) -> None:
    """Let ``module.to(device)`` and the like pass over the tensors that stay on the meta device (the other stages'
    weights of a model split from its graph: this process never holds them)."""
    def apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        return nn.Module._apply(module, lambda t: t if t.is_meta else fn(t), recurse)

    module._apply = apply  # type: ignore[method-assign]
