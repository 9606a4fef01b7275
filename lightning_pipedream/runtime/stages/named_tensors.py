"""Tensors by name in a torch.distributed.checkpoint directory: each rank writes the tensors it holds and reads only
the names it asks for.

A sharded checkpoint of a pipeline keeps every tensor under one flat name (``model/<parameter name>``,
``optimizer0/<parameter name>/<state>``), so that any layout (other stages, replicas, shards, one process) finds
its own by name. These functions know nothing of Lightning; the strategy's checkpoints and the offline commands
(consolidate, export) use them, and so can any loader keyed by parameter names.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

METADATA_FILE = ".metadata"  # what torch.distributed.checkpoint writes beside its data files


def write_named(tensors: dict[str, Any], directory: str) -> None:
    """Write this rank's ``tensors`` (and small objects) into ``directory``, a collective over all ranks when a
    process group exists: each rank writes its own; a name several ranks hold (replicas) is written once."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # alone, torch says it assumes a single process: so it is
        warnings.filterwarnings("ignore", message=".*assuming the intent")
        dcp.save(tensors, checkpoint_id=directory, no_dist=not _distributed())


def saved_entries(directory: str) -> dict[str, tuple[tuple[int, ...], torch.dtype] | None]:
    """Every name in ``directory``: its shape and dtype, or None for an object that is not a tensor."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries: dict[str, tuple[tuple[int, ...], torch.dtype] | None] = {}
    for name, md in FileSystemReader(directory).read_metadata().state_dict_metadata.items():
        entries[name] = (tuple(md.size), md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
    return entries


def read_named(targets: dict[str, Any], directory: str, collective: bool = True) -> dict[str, Any]:
    """Fill ``targets`` (name -> a tensor of the saved shape, loaded in place; or any placeholder for an object)
    from ``directory``, reading only those names. ``collective``: every rank calls it at once (under a process
    group); False reads in this process alone."""
    import torch.distributed.checkpoint as dcp

    check_complete(directory)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent")
        dcp.load(targets, checkpoint_id=directory, no_dist=not (collective and _distributed()))
    return targets


def check_complete(directory: str) -> None:
    """Refuse, with the way out, a checkpoint directory that lacks data files its metadata names: each rank wrote its
    own file, and some of them are elsewhere (a disk of another machine) or were removed."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(directory).read_metadata().storage_data or {}  # another writer may record none
    files = sorted({path for info in storage.values() if isinstance(path := getattr(info, "relative_path", None), str)})
    missing = [f for f in files if not os.path.isfile(os.path.join(directory, f))]
    if missing:
        raise FileNotFoundError(
            f"The checkpoint {directory} is incomplete: {len(missing)} of its {len(files)} data files are missing "
            f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}; __<rank>_<n>.distcp is the file rank "
            "<rank> wrote). Each rank writes its own file into the checkpoint's directory, so all ranks must save to "
            "one filesystem they share (on several machines, a shared filesystem rather than each machine's local "
            "disk). Copy every machine's files of this checkpoint into this directory, or resume from a complete one."
        )


def empty_targets(entries: dict[str, tuple[tuple[int, ...], torch.dtype] | None], names: Iterable[str],
                  device: torch.device | str = "cpu") -> dict[str, Any]:
    """Tensors to read ``names`` into (uninitialized, of their saved shapes and dtypes; None for objects)."""
    out: dict[str, Any] = {}
    for name in names:
        entry = entries[name]
        out[name] = None if entry is None else torch.empty(entry[0], dtype=entry[1], device=device)
    return out


def read_all(directory: str, prefix: str = "") -> dict[str, Any]:
    """Every entry whose name starts with ``prefix`` (in this process alone): for offline tools on one machine."""
    entries = saved_entries(directory)
    names = [n for n in entries if n.startswith(prefix)]
    return read_named(empty_targets(entries, names), directory, collective=False)


def is_named_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a torch.distributed.checkpoint (its metadata file)."""
    return os.path.isfile(os.path.join(os.fspath(directory), METADATA_FILE))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of these tensors' elements (meta tensors included: their shapes are known)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))
