"""Per-stage construction: a model built on the meta device gets real weights only for this rank's stage."""

from __future__ import annotations

import hashlib
import itertools

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


def materialize(module: nn.Module, device: torch.device, base_seed: int, prefix: str = "") -> int:
    """Give every parameter and buffer of ``module`` still on the meta device real storage on ``device``,
    initialized by its submodule's own ``reset_parameters()`` under :func:`layer_seed` of its qualified name.

    Returns the bytes allocated. Modules already materialized are left as they are.
    """
    allocated = 0
    for name, sub in module.named_modules():
        direct = list(itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False)))
        if not any(t.is_meta for t in direct):
            continue
        qualified = f"{prefix}{name}" if name else prefix.rstrip(".")
        reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
        if reset is None:
            raise ValueError(
                f"{type(sub).__name__} {qualified!r} was built on the meta device but has no reset_parameters(), "
                "so PipeDreamStrategy cannot initialize its weights on the stage that holds it. Give it a "
                "reset_parameters() method that initializes its parameters and buffers, or build it on a real device."
            )
        sub.to_empty(device=device, recurse=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(base_seed, qualified))
            reset()
        allocated += sum(t.numel() * t.element_size() for t in direct)
    if has_meta_tensors(module):  # e.g. a reset_parameters() that left a buffer alone
        left = [n for n, t in itertools.chain(module.named_parameters(), module.named_buffers()) if t.is_meta]
        raise ValueError(
            f"After reset_parameters(), {left[:4]} are still on the meta device: PipeDreamStrategy cannot "
            "initialize them. Make their module's reset_parameters() set them, or build that module on a real device."
        )
    return allocated
