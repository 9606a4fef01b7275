"""Pretrained weights read per stage: each process opens only the files that hold its own tensors and reads only those.

:class:`PretrainedWeights` knows, from headers and indexes alone, which tensors a checkpoint holds and where: one
safetensors file, a Hugging Face directory (``model.safetensors.index.json`` mapping names to files, or one
``model.safetensors``), a torch state-dict file (read with ``mmap=True``: only the pages of the tensors taken are
read), or a torch.distributed.checkpoint directory. :func:`match_names` maps its keys onto a module's state-dict
names (with a prefix, found when exactly one submodule's names match) and lists what is missing or unexpected;
:func:`load_own` copies this stage's tensors into its materialized parameters and buffers: from safetensors each
tensor's bytes are read from the file straight into the parameter's memory (no mapping kept, no second copy; through a
buffer of :data:`CHUNK_BYTES` where the dtype differs or the parameter is on a GPU), so that loading a stage holds no
more than the stage; a torch file is mapped anew for each tensor (its pages leave with the mapping), and a
torch.distributed.checkpoint's tensor is read into the parameter itself where it can be.
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
CHUNK_BYTES = 16 * 2**20  # the host buffer of a read that casts or goes to a GPU
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    **({"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2} if hasattr(torch, "float8_e5m2") else {}),
}
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
                start, header = safetensors_header(file)
                for name in names:
                    entry = header[name]
                    value = torch.empty(entry["shape"], dtype=_safetensors_dtype(entry["dtype"], name, file))
                    read_entry(file, start, entry, value)
                    yield name, value
            elif self.kind == "torch":
                for name in names:
                    # Mapped anew for each tensor: the pages read leave with the mapping once the tensor is copied,
                    # instead of the whole stage's pages staying resident beside the stage itself.
                    state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
                    state = state["state_dict"] if isinstance(state.get("state_dict"), dict) else state
                    value = state[name]
                    del state
                    yield name, value
                    del value
            else:
                yield from self._read_dcp(file, names)

    def shapes(self, keys: Collection[str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """Shape and dtype of each of ``keys`` from the headers alone (safetensors); None for another kind."""
        if self.kind != "safetensors":
            return None
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.files[key], []).append(key)
        for file, names in by_file.items():
            _, header = safetensors_header(file)
            for name in names:
                out[name] = (tuple(header[name]["shape"]), _safetensors_dtype(header[name]["dtype"], name, file))
        return out

    def read_into(self, targets: dict[str, torch.Tensor]) -> None:
        """Read each of ``targets``' keys into its tensor (same shape; cast where the dtype differs): safetensors
        straight from the file into the tensor's memory, one tensor after another."""
        by_file: dict[Path, list[str]] = {}
        for key in targets:
            by_file.setdefault(self.files[key], []).append(key)
        for file, names in by_file.items():
            start, header = safetensors_header(file)
            for name in names:
                read_entry(file, start, header[name], targets[name])

    def _read_dcp(self, directory: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        import torch.distributed.checkpoint as dcp

        reader = dcp.FileSystemReader(str(directory))
        metadata = reader.read_metadata().state_dict_metadata
        for name in names:  # one tensor at a time: the peak is this stage plus one tensor
            stored = metadata[self.prefix_in_file + name]
            holder = {self.prefix_in_file + name: torch.empty(stored.size, dtype=stored.properties.dtype)}
            dcp.load(holder, storage_reader=reader, no_dist=True)
            yield name, holder[self.prefix_in_file + name]


def safetensors_header(file: Path) -> tuple[int, dict[str, Any]]:
    """Where a safetensors file's data begins, and its header: key -> dtype, shape, data_offsets (from the data)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


def _safetensors_dtype(code: str, name: str, file: Path) -> torch.dtype:
    if code not in _SAFETENSORS_DTYPES:
        raise PretrainedError(f"Pretrained tensor {name!r} in {file} is stored as {code}, a dtype PipeDreamStrategy "
                              f"does not read; convert the checkpoint to one of {sorted(_SAFETENSORS_DTYPES)}.")
    return _SAFETENSORS_DTYPES[code]


def read_entry(file: Path, start: int, entry: dict[str, Any], target: torch.Tensor) -> None:
    """Read a safetensors entry (``start``: where the file's data begins) into ``target``: straight into its memory
    when it is a contiguous CPU tensor of the stored dtype, else through a host buffer of at most
    :data:`CHUNK_BYTES`, copied (and cast) into it piece by piece."""
    dtype = _safetensors_dtype(entry["dtype"], "?", file)
    begin, end = entry["data_offsets"]
    size = torch.empty((), dtype=dtype).element_size()
    flat = target.detach().view(-1) if target.is_contiguous() else None
    with open(file, "rb", buffering=0) as f:
        f.seek(start + begin)
        if flat is not None and flat.device.type == "cpu" and dtype == target.dtype:
            _read_fully(f, flat.view(torch.uint8).numpy(), end - begin)
            return
        step = max(size, CHUNK_BYTES // size * size)
        staged = target if flat is None else None  # a strided target takes the whole tensor at once, then a copy
        whole = torch.empty(target.shape, dtype=dtype) if staged is not None else None
        done = 0
        while done < end - begin:
            count = min(step, end - begin - done)
            buffer = torch.empty(count, dtype=torch.uint8)
            _read_fully(f, buffer.numpy(), count)
            if whole is not None:
                whole.view(-1).view(torch.uint8)[done:done + count].copy_(buffer)
            else:
                assert flat is not None
                flat[done // size:(done + count) // size].copy_(buffer.view(dtype))
            done += count
        if whole is not None:
            target.detach().copy_(whole)


def _read_fully(f: Any, into: Any, count: int) -> None:
    view, done = memoryview(into).cast("B"), 0
    while done < count:
        got = f.readinto(view[done:count])
        if not got:
            raise PretrainedError(f"{f.name} ends {count - done} bytes before the tensor it holds: the file is cut "
                                  "short. Copy or download it again.")
        done += got


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
    shapes = weights.shapes(list(wanted))
    if shapes is not None:  # safetensors: checked from the headers, then read straight into the tensors
        for key, (shape, dtype) in shapes.items():
            target = targets[wanted[key]]
            if shape != tuple(target.shape):
                raise PretrainedError(
                    f"Pretrained tensor {key!r} has shape {shape}, but {wanted[key]} of the module has "
                    f"shape {tuple(target.shape)}. Build the model with the checkpoint's config."
                )
            if dtype != target.dtype:
                cast.add((str(dtype).removeprefix("torch."), str(target.dtype).removeprefix("torch.")))
            read += _numel(shape) * torch.empty((), dtype=dtype).element_size()
        with torch.no_grad():
            weights.read_into({key: targets[name] for key, name in wanted.items()})
        _say_cast(cast)
        return read
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
            if target.device.type == "cpu" or value.numel() * value.element_size() <= CHUNK_BYTES:
                target.copy_(value)
            else:  # to a GPU: through a pinned buffer of at most CHUNK_BYTES, never a host copy of the tensor
                _copy_in_chunks(value, target)
            read += value.numel() * value.element_size()
            del value
    _say_cast(cast)
    return read


def _copy_in_chunks(value: torch.Tensor, target: torch.Tensor) -> None:
    flat_value, flat_target = value.reshape(-1), target.view(-1)
    step = max(1, CHUNK_BYTES // max(1, value.element_size()))
    for at in range(0, flat_value.numel(), step):
        flat_target[at:at + step].copy_(flat_value[at:at + step])


def _say_cast(cast: set[tuple[str, str]]) -> None:
    for stored, used in sorted(cast):
        log.warning("PipeDreamStrategy: pretrained weights stored as %s are cast to the module's %s.", stored, used)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def tensors_of(module: nn.Module, names: Collection[str]) -> dict[str, Any]:
    """The tensors of ``module`` named in ``names`` (for tests and reports)."""
    state = module.state_dict(keep_vars=True)
    return {n: state[n] for n in names if n in state}
