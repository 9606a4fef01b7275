"""Pretrained weights read per stage: each process opens only the files that hold its own tensors and reads only those.

:class:`PretrainedWeights` knows, from headers and indexes alone, which tensors a checkpoint holds and where: one
safetensors file, a Hugging Face directory (``model.safetensors.index.json`` mapping names to files, or one
``model.safetensors``), a torch state-dict file (read with ``mmap=True``: only the pages of the tensors taken are
read), or a torch.distributed.checkpoint directory. :func:`match_names` maps its keys onto a module's state-dict
names (with a prefix, found when exactly one submodule's names match) and lists what is missing or unexpected;
:func:`load_own` copies this stage's tensors into its materialized parameters and buffers.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger("lightning_pipedream.runtime")

INDEX = "model.safetensors.index.json"
FORMATS = ("a .safetensors file, a directory with model.safetensors or model.safetensors.index.json "
           "(Hugging Face's save_pretrained layout), a torch state-dict file (torch.save), or a "
           "torch.distributed.checkpoint directory (with its .metadata file)")


class PretrainedError(ValueError):
    """The pretrained weights cannot be read into the module as given."""


@dataclass
class PretrainedWeights:
    """The tensors of a checkpoint, by key, and which file holds each (nothing but headers is read here)."""

    path: Path
    kind: str  # "safetensors", "torch" or "dcp"
    files: dict[str, Path]  # key -> the file holding it (the directory itself for dcp)
    prefix_in_file: str = ""  # keys are stored under this (a Lightning checkpoint's "state_dict.")

    @classmethod
    def open(cls, path: str | os.PathLike) -> PretrainedWeights:
        where = Path(path)
        if not where.exists():
            raise PretrainedError(f"pretrained={str(path)!r} does not exist. Give {FORMATS}.")
        if where.is_dir():
            if (where / INDEX).is_file():
                weight_map = json.loads((where / INDEX).read_text())["weight_map"]
                return cls(where, "safetensors", {k: where / f for k, f in weight_map.items()})
            if (where / "model.safetensors").is_file():
                return cls._safetensors(where / "model.safetensors")
            if (where / ".metadata").is_file():
                return cls._dcp(where)
            raise PretrainedError(f"pretrained={str(path)!r} is a directory without {INDEX}, model.safetensors or "
                                  f".metadata. Give {FORMATS}.")
        if where.suffix == ".safetensors":
            return cls._safetensors(where)
        try:
            state = torch.load(where, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unreadable file gets the same words
            raise PretrainedError(f"pretrained={str(path)!r} is not a checkpoint PipeDreamStrategy can read "
                                  f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
                                  f"Give {FORMATS}.") from err
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]  # a Lightning checkpoint
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise PretrainedError(f"pretrained={str(path)!r} holds a {type(state).__name__}, not a state dict of "
                                  f"tensors. Give {FORMATS}.")
        return cls(where, "torch", dict.fromkeys(state, where))

    @classmethod
    def _safetensors(cls, file: Path) -> PretrainedWeights:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            return cls(file, "safetensors", dict.fromkeys(f.keys(), file))

    @classmethod
    def _dcp(cls, directory: Path) -> PretrainedWeights:
        from torch.distributed.checkpoint import FileSystemReader

        keys = [k for k, v in FileSystemReader(str(directory)).read_metadata().state_dict_metadata.items()
                if hasattr(v, "size")]
        within = "state_dict." if any(k.startswith("state_dict.") for k in keys) else ""
        return cls(directory, "dcp", {k[len(within):]: directory for k in keys if k.startswith(within)}, within)

    def keys(self) -> list[str]:
        return list(self.files)

    def read(self, keys: Collection[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of ``keys``, each read on its own, opening only the files that hold them."""
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.files[key], []).append(key)
        for file, names in by_file.items():
            if self.kind == "safetensors":
                from safetensors import safe_open

                for name in names:
                    # The file is memory-mapped: the pages read stay resident (and count in this process's peak)
                    # until it is closed, so it is opened for each tensor, and the peak is the stage plus one tensor.
                    with safe_open(str(file), framework="pt") as f:
                        tensor = f.get_tensor(name)
                    yield name, tensor
            elif self.kind == "torch":
                state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
                state = state["state_dict"] if isinstance(state.get("state_dict"), dict) else state
                for name in names:
                    yield name, state[name]
            else:
                yield from self._read_dcp(file, names)

    def _read_dcp(self, directory: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        import torch.distributed.checkpoint as dcp

        reader = dcp.FileSystemReader(str(directory))
        metadata = reader.read_metadata().state_dict_metadata
        for name in names:  # one tensor at a time: the peak is this stage plus one tensor
            stored = metadata[self.prefix_in_file + name]
            holder = {self.prefix_in_file + name: torch.empty(stored.size, dtype=stored.properties.dtype)}
            dcp.load(holder, storage_reader=reader, no_dist=True)
            yield name, holder[self.prefix_in_file + name]


def module_names(module: nn.Module) -> dict[str, list[str]]:
    """Each tensor of ``module``'s state dict (persistent buffers and parameters, tied ones once) by its first
    name -> every name it has."""
    aliases: dict[int, list[str]] = {}
    persistent = set(module.state_dict(keep_vars=True))
    for named in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        for name, tensor in named:
            if name in persistent:
                aliases.setdefault(id(tensor), []).append(name)
    return {names[0]: names for names in aliases.values()}


def find_prefix(keys: Collection[str], module: nn.Module, given: str | None) -> str:
    """The prefix that turns the checkpoint's keys into ``module``'s names: ``given``, else the one submodule
    (or the module itself) under which the most keys name a tensor, when exactly one does best."""
    if given is not None:
        return given
    names = set(module.state_dict(keep_vars=True))
    counts = {}
    for sub, _ in module.named_modules():
        prefix = f"{sub}." if sub else ""
        counts[prefix] = sum(prefix + k in names for k in keys)
    best = max(counts.values(), default=0)
    winners = [p for p, c in counts.items() if c == best]
    if best == 0 or len(winners) > 1:
        shown = ", ".join(repr(p) for p in winners[:4]) if best else "none"
        raise PretrainedError(
            f"PipeDreamStrategy could not tell where the pretrained keys ({sorted(keys)[:3]}, ...) go in "
            f"{type(module).__name__}: prefixes that match best: {shown}. Give pretrained_prefix= (the submodule's "
            "name and a dot, e.g. 'model.'), the prefix that turns a checkpoint key into a state_dict name."
        )
    return winners[0]


def match_names(keys: Collection[str], module: nn.Module, prefix: str) -> dict[str, str]:
    """Each of ``module``'s tensors (first name) -> the checkpoint key that holds it (a tied tensor through any of
    its names). Raises, listing them, if a tensor has no key or a key no tensor."""
    key_set = set(keys)
    source: dict[str, str] = {}
    missing: list[str] = []
    for first, aliases in module_names(module).items():
        found = [a[len(prefix):] for a in aliases if a.startswith(prefix) and a[len(prefix):] in key_set]
        if found:
            source[first] = found[0]
        else:
            missing.append(first)
    known = {a[len(prefix):] for aliases in module_names(module).values() for a in aliases if a.startswith(prefix)}
    unexpected = sorted(key_set - known)
    if missing or unexpected:
        raise PretrainedError(
            f"The pretrained weights do not match {type(module).__name__} with pretrained_prefix={prefix!r}: "
            f"{len(missing)} missing {missing[:8]}, {len(unexpected)} unexpected {unexpected[:8]}. Give the "
            "checkpoint of this model (its config must match), or the pretrained_prefix that maps its keys onto "
            "the module's state_dict names."
        )
    return source


def load_own(module: nn.Module, weights: PretrainedWeights, source: dict[str, str], names: Collection[str]) -> int:
    """Copy the tensors among ``names`` (first names, this stage's) from ``weights`` into ``module``'s own, already
    materialized; returns the bytes read. Shapes must match; another dtype is cast (said once)."""
    wanted = {source[n]: n for n in names if n in source}
    targets = dict(module.named_parameters())
    targets.update(module.named_buffers())
    read, cast = 0, set()
    with torch.no_grad():
        for key, value in weights.read(list(wanted)):
            target = targets[wanted[key]]
            if tuple(value.shape) != tuple(target.shape):
                raise PretrainedError(
                    f"Pretrained tensor {key!r} has shape {tuple(value.shape)}, but {wanted[key]} of the module has "
                    f"shape {tuple(target.shape)}. Build the model with the checkpoint's config."
                )
            if value.dtype != target.dtype:
                cast.add((str(value.dtype).removeprefix("torch."), str(target.dtype).removeprefix("torch.")))
            target.copy_(value)
            read += value.numel() * value.element_size()
    for stored, used in sorted(cast):
        log.warning("PipeDreamStrategy: pretrained weights stored as %s are cast to the module's %s.", stored, used)
    return read


def tensors_of(module: nn.Module, names: Collection[str]) -> dict[str, Any]:
    """The tensors of ``module`` named in ``names`` (for tests and reports)."""
    state = module.state_dict(keep_vars=True)
    return {n: state[n] for n in names if n in state}
