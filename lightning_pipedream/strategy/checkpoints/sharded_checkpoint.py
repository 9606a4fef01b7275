"""Sharded checkpoints: a directory in which each rank writes its own stage's weights and optimizer state, by name.

The layout is Lightning's for model-parallel strategies: torch.distributed.checkpoint files (every tensor under one
flat name, ``model/<parameter name>`` and ``optimizer<i>/<parameter name>/<state>``, see
:mod:`~lightning_pipedream.runtime.stages.named_tensors`) and ``meta.pt``, which rank 0 writes with the rest of
Lightning's checkpoint (loops, callbacks, schedulers, hyperparameters), each optimizer's groups in single-device form
and the model's key order. No rank gathers another's share: a 4-stage checkpoint resumes on 2 stages, on replicas or
shards, each rank reading only the names it holds. Under ``shard=`` a name's tensor is a DTensor, saved as each
replica's own piece with its offsets in the whole (the name and global shape as an unsharded save writes them), and
read back into each replica's own piece from the saved pieces it overlaps: no replica holds its stage whole.
``python -m lightning_pipedream checkpoint consolidate`` turns it into one ordinary file (:func:`consolidate`). A save
writes ``<path>.tmp-<pid>`` and, once every rank's data and then the metadata are in it, swaps it into place: a kill
while saving leaves the previous checkpoint whole, and a resume names the unfinished save it skipped.
"""

from __future__ import annotations

import ctypes
import glob
import io
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_pipedream.runtime.stages.materialize import has_meta_tensors
from lightning_pipedream.runtime.stages.named_tensors import (
    empty_targets,
    read_all,
    read_named,
    saved_entries,
    tensor_bytes,
    write_named,
)
from lightning_pipedream.runtime.stages.sharding import sharded_model_state
from lightning_pipedream.strategy.checkpoints.async_save import (
    ASYNC_MODE,
    BackgroundSaves,
    check_async_saves,
    write_bytes,
)
from lightning_pipedream.strategy.checkpoints.checkpoint import (
    CheckpointGather,
    OptimizerLayout,
    load_own_share,
    remove_stale_temporaries,
    say_skipped_saves,
)


class StagePipeline(Protocol):
    """What a checkpoint reads of setup's :class:`~lightning_pipedream.strategy.setup.stage_pipeline.StagePipeline`
    (checkpoints sit below setup, which builds the pipeline with its :class:`CheckpointGather`)."""

    @property
    def module(self) -> torch.nn.Module: ...
    @property
    def checkpoint(self) -> CheckpointGather: ...
    @property
    def optimizer_layouts(self) -> list[OptimizerLayout]: ...
    @property
    def local_names(self) -> dict[int, str]: ...
    @property
    def graph(self) -> Any: ...  # a GraphPath, or None: the module is one nn.Sequential
    @property
    def shard(self) -> str | None: ...
    def state_share(self, is_global_zero: bool, gather: bool = True) -> dict[str, Tensor]: ...
    def optimizer_state(self, optimizer: torch.optim.Optimizer, index: int) -> dict[str, Tensor]: ...
    def load_optimizer_states(self, optimizers: list[torch.optim.Optimizer], states: list[dict]) -> None: ...

CHECKPOINT_MODES = ("auto", "sharded", "sharded-async", "full")
SHARDED_FROM = 2**30  # checkpoint="auto": a model whose state dict has this many bytes or more saves sharded
META_FILE = "meta.pt"  # Lightning's name (lightning.fabric.utilities.load._METADATA_FILENAME)
INFO = "pipedream_sharded"  # meta.pt's entry that says what wrote it: the model, its keys, its optimizers' names
LOADED = "pipedream_sharded_checkpoint"  # in a loaded checkpoint: the directory to read each rank's share from
MODEL = "model/"
FORMAT = 1


def check_checkpoint_mode(mode: str) -> str:
    if mode not in CHECKPOINT_MODES:
        raise ValueError(
            f"PipeDreamStrategy(checkpoint={mode!r}) is not a checkpoint form; use 'sharded' (a directory, each rank "
            "writing its own stage), 'sharded-async' (the same, written in the background while training goes on), "
            "'full' (one file gathered on rank 0) or 'auto' (sharded from 1 GiB of weights)."
        )
    return mode


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """A directory with ``meta.pt`` (Lightning's test for a sharded checkpoint)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, META_FILE))


def optimizer_prefix(index: int) -> str:
    return f"optimizer{index}/"


def split_state_name(rest: str) -> tuple[str, str]:
    """``<parameter name>/<state>`` -> its two parts (parameter names hold dots, never slashes)."""
    name, key = rest.rsplit("/", 1)
    return name, key


def refuse_after_failure(failure: BaseException | None) -> None:
    if failure is not None:
        raise RuntimeError(
            f"PipeDreamStrategy does not save a checkpoint after a pipeline step failed or was interrupted "
            f"({type(failure).__name__}: {failure}): its stages stopped in different places, "
            "holding weights of different minibatches, and some may be gone. Resume from the last checkpoint "
            "saved before the failure; it was left as it was."
        )


@dataclass
class SavedShards:
    """A sharded checkpoint being read: its directory, what ``meta.pt`` says wrote it, and its entries' shapes."""

    path: str
    info: dict[str, Any]
    entries: dict[str, Any] = field(default_factory=dict)

    def check_model(self, keys: list[str], targets: Mapping[str, Any], strict: bool) -> list[str]:
        """The names of ``targets`` to read; refuses a checkpoint of another model (under ``strict``) or a tensor of
        another shape, naming them."""
        saved, here = list(self.info["keys"]), set(keys)
        missing = [k for k in keys if k not in set(saved)]
        unexpected = [k for k in saved if k not in here]
        if strict and (missing or unexpected):
            raise ValueError(
                f"The sharded checkpoint {self.path} was written by {self.info.get('module')} and does not fit this "
                f"model: {len(missing)} of this model's names are not in it {missing[:4]}, and it holds "
                f"{len(unexpected)} this model lacks {unexpected[:4]}. Resume from a checkpoint of this model, or "
                "set the LightningModule's strict_loading = False to load the names both have."
            )
        for name, tensor in targets.items():
            entry = self.entries.get(MODEL + name)
            if entry is not None and isinstance(tensor, Tensor) and tuple(entry[0]) != tuple(tensor.shape):
                raise ValueError(
                    f"The sharded checkpoint {self.path} holds {name} of shape {tuple(entry[0])}, but this model's "
                    f"is {tuple(tensor.shape)}: it was written by another model ({self.info.get('module')}). "
                    "Resume from a checkpoint of this model."
                )
        return [k for k in targets if MODEL + k in self.entries]


class PipelineCheckpoints:
    """What the strategy's checkpoint hooks delegate to: which form to save (``checkpoint=``), each rank's share of a
    sharded save, and reading a sharded checkpoint back after setup, when each rank knows its stage."""

    def __init__(self, mode: str) -> None:
        self.mode = check_checkpoint_mode(mode)
        if self.mode == ASYNC_MODE:
            check_async_saves()
        self.model_bytes: int | None = None  # the whole model's state dict, measured before setup splits it
        # what to load once the stage exists: a sharded checkpoint, or a file's state dict for a model built on meta
        self.pending: tuple[SavedShards | dict[str, Any], bool] | None = None
        self.background = BackgroundSaves()  # checkpoint="sharded-async": the save in flight, its group and memory

    def measure(self, module: torch.nn.Module) -> None:
        """The whole model's size (meta tensors count by shape), for ``checkpoint="auto"``; once, before the split."""
        if self.model_bytes is None:
            self.model_bytes = tensor_bytes(module.state_dict().values())

    @property
    def sharded(self) -> bool:
        return self.mode in ("sharded", ASYNC_MODE) or (self.mode == "auto" and (self.model_bytes or 0) >= SHARDED_FROM)

    def open_background(self, fitting: bool) -> None:
        """A fit's saves go to the background (``checkpoint="sharded-async"``) from setup to the end of training."""
        self.background.open = fitting and self.mode == ASYNC_MODE

    def end_background(self, failed: bool = False) -> None:
        """The end of training (or of a failed fit, whose save's own error would hide the failure): wait for the save
        in flight; saves after it are written before they return."""
        self.background.close(raise_errors=not failed)

    def remove(self, path: str, remove: Callable[[], None]) -> None:
        """Remove checkpoint ``path`` (``remove`` does it), once the save in flight, if any, is complete."""
        self.background.remove_after(remove)

    # -- saving ----------------------------------------------------------------------------------------------------
    def model_state(self, pipeline: StagePipeline, is_global_zero: bool) -> dict[str, Any]:
        """Sharded: this rank's share under the module's names (under ``shard=``, its own shards of the stage, as
        DTensors: nothing gathered). Full: the whole state dict on rank 0."""
        share = pipeline.state_share(is_global_zero, gather=not self.sharded)
        return share if self.sharded else pipeline.checkpoint.state_dict(share)

    def optimizer_state(self, pipeline: StagePipeline, optimizer: torch.optim.Optimizer, index: int) -> dict[str, Any]:
        """Sharded: this rank's optimizer state by parameter name (under ``shard=``, the state of its own shards, as
        DTensors). Full: single-device form on rank 0."""
        if not self.sharded:
            return pipeline.optimizer_state(optimizer, index)
        raw: Any = getattr(optimizer, "_optimizer", optimizer)
        return pipeline.optimizer_layouts[index].named_state(raw, pipeline.local_names)

    def save(self, checkpoint: dict[str, Any], path: str, pipeline: StagePipeline, is_global_zero: bool,
             broadcast: Callable[[Any], Any], write_full: Callable[[dict[str, Any], str], None],
             storage_options: Any | None = None, streamable: bool = False,
             device: torch.device | None = None) -> None:
        """Every rank calls it: sharded, each writes its share into ``<path>.tmp-<pid>`` and rank 0 renames it into
        place (``sharded-async`` during a fit: in the background, :mod:`.async_save`); full, rank 0 writes the file
        (``write_full``) that the gather made, or inside ``trainer.save_checkpoint`` the file stage by stage
        (``streamable``: rank 0 writes it itself, each rank's tensors received in turn; else the stand-ins are filled
        in on rank 0 first and ``write_full`` writes the whole dict)."""
        if self.sharded and storage_options is not None:
            raise TypeError(
                "PipeDreamStrategy(checkpoint='sharded') writes a directory on a local or shared filesystem itself, "
                "without the CheckpointIO, so it takes no storage_options. Use checkpoint='full' to save through the "
                "CheckpointIO with storage_options, or save to a local path."
            )
        background = self.background.open and self.mode == ASYNC_MODE
        self.background.wait()  # the save in flight first, whatever this one is (one at a time, in order)
        stream = pipeline.checkpoint.stream
        if not self.sharded and stream is not None:  # every rank: rank 0 writes, the others send their tensors
            from lightning_pipedream.strategy.checkpoints.single_file import fill_in, message_device, write_streamed

            if streamable:
                write_streamed(checkpoint, path, stream, message_device(device), put_in_place=replace_path,
                               clear_leftovers=remove_stale_temporaries)
                return
            checkpoint = fill_in(checkpoint, stream, message_device(device))
        if not self.sharded:  # rank 0 writes the file, as Lightning does (no collective)
            if is_global_zero and os.path.isdir(path):  # a sharded checkpoint at this path before
                replace_path(path, lambda target: write_full(checkpoint, target))
            elif is_global_zero:
                write_full(checkpoint, path)
            return
        path = broadcast(path)  # one path for all ranks, as rank 0 names it
        temporary = f"{path}.tmp-{os.getpid()}"
        if is_global_zero:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            remove_stale_temporaries(os.path.dirname(path) or ".")
            if os.path.isdir(temporary):  # this process's own save that failed before
                shutil.rmtree(temporary)
        temporary = broadcast(temporary)  # after rank 0 cleared the way
        model = checkpoint.pop("state_dict")
        optimizers = checkpoint.pop("optimizer_states", None)
        named = {MODEL + k: v for k, v in model.items()}
        for i, share in enumerate(optimizers or []):
            for name, state in share["state"].items():
                named.update({f"{optimizer_prefix(i)}{name}/{key}": value for key, value in state.items()})
        if not background:
            write_named(named, temporary)  # collective: each rank writes its own; rank 0 the global metadata
        groups = [pipeline.checkpoint.gather(share["groups"]) for share in optimizers or []]  # settings, no tensors
        if not is_global_zero:
            if background:
                self.background.start(named, temporary, path, checkpoint.get("global_step", 0), None)
            return
        layouts = pipeline.optimizer_layouts
        if optimizers is not None:  # each optimizer's groups in single-device form; the state is in the shards
            checkpoint["optimizer_states"] = [layouts[i].to_full([{"state": {}, "groups": g} for g in parts or []])
                                              for i, parts in enumerate(groups)]
        checkpoint[INFO] = {"format": FORMAT, "module": type(pipeline.module).__qualname__,
                            "keys": list(pipeline.checkpoint.full_keys),
                            "optimizers": [layout.groups for layout in layouts],
                            "world_size": pipeline.checkpoint.world_size}
        if background:  # meta.pt as it is now (training goes on), written once every rank's data is
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)

            def complete() -> None:  # rank 0, in the background, once every rank's data is written
                write_bytes(buffer.getvalue(), os.path.join(temporary, META_FILE))
                move_into_place(temporary, path)

            self.background.start(named, temporary, path, checkpoint.get("global_step", 0), complete)
            return
        _write_file(checkpoint, os.path.join(temporary, META_FILE))
        move_into_place(temporary, path)

    # -- loading ---------------------------------------------------------------------------------------------------
    def load(self, path: str, weights_only: bool | None, read_file: Callable[[str], dict[str, Any]]
             ) -> dict[str, Any]:
        """What Lightning restores from ``path``: a file as before, or a sharded directory's ``meta.pt`` with a
        promise to read this rank's share once setup has built its stage."""
        if not os.path.exists(path):
            path = interrupted_replacement(path) or path
        say_skipped_saves(path)
        if not os.path.isdir(path):
            return read_file(path)
        if not is_sharded_checkpoint(path):
            raise FileNotFoundError(
                f"The checkpoint {path} is a directory without {META_FILE}: not a sharded checkpoint (or its save did "
                "not finish). Give a checkpoint file or a directory PipeDreamStrategy(checkpoint='sharded') wrote."
            )
        meta = torch.load(os.path.join(path, META_FILE), map_location="cpu", weights_only=bool(weights_only))
        info = meta.pop(INFO, None)
        if info is None:
            raise ValueError(
                f"The sharded checkpoint {path} was not written by PipeDreamStrategy (its {META_FILE} has no "
                f"{INFO!r}): another strategy's parameter names and optimizer layout differ. Convert it to one file "
                "with that strategy, then resume from the file."
            )
        shards = SavedShards(path, info, saved_entries(path))
        return {**meta, "state_dict": {}, LOADED: shards}

    def load_model(self, checkpoint: Mapping[str, Any], strict: bool, module: torch.nn.Module, shard: bool) -> None:
        """A sharded checkpoint's weights wait for :meth:`after_setup` (each rank reads its own); so do a file's for
        a model built on the meta device (Lightning restores before setup, whose materialization would initialize
        them again); otherwise a file's are loaded now, this rank's part (``shard``: cut to this replica's shards)."""
        if LOADED in checkpoint or has_meta_tensors(module):
            self.pending = (checkpoint.get(LOADED, checkpoint["state_dict"]), strict)
            return
        state = checkpoint["state_dict"]
        if shard:
            state = sharded_model_state(module, dict(state))
        load_own_share(module, state, strict)

    def after_setup(self, pipeline: StagePipeline) -> None:
        """Read this rank's weights (only those) from the pending sharded checkpoint; every rank at once."""
        if self.pending is None:
            return
        shards, strict = self.pending
        self.pending = None
        if not isinstance(shards, SavedShards):  # a file's state dict, for a model that was built on meta
            state = sharded_model_state(pipeline.module, shards) if pipeline.shard is not None else shards
            load_own_share(pipeline.module, state, strict)
            return
        targets = own_tensors(pipeline)
        names = shards.check_model(pipeline.checkpoint.full_keys, targets, strict)
        # In place; a sharded stage's DTensor takes this replica's shard only, read from the saved pieces it overlaps.
        read_named({MODEL + k: targets[k] for k in names}, shards.path)

    def load_optimizers(self, checkpoint: Mapping[str, Any], pipeline: StagePipeline,
                        optimizers: list[torch.optim.Optimizer]) -> None:
        """Each optimizer takes the state of the parameters it trains; from a sharded checkpoint it reads only those."""
        shards = checkpoint.get(LOADED)
        if shards is None:
            pipeline.load_optimizer_states(optimizers, checkpoint["optimizer_states"])
            return
        states = []
        for i, optimizer in enumerate(optimizers):
            raw = getattr(optimizer, "_optimizer", optimizer)
            own = {pipeline.local_names[id(p)]: p for g in raw.param_groups for p in g["params"]}
            prefix = optimizer_prefix(i)
            names = [n for n in shards.entries if n.startswith(prefix) and split_state_name(n[len(prefix):])[0] in own]
            read = read_named(state_targets(shards.entries, names, prefix, own), shards.path)
            index = {name: j for j, name in enumerate(n for group in shards.info["optimizers"][i] for n in group)}
            state: dict[int, dict[str, Any]] = {}
            for key, value in read.items():
                name, part = split_state_name(key[len(prefix):])
                state.setdefault(index[name], {})[part] = value
            states.append({"state": state, "param_groups": checkpoint["optimizer_states"][i]["param_groups"]})
        pipeline.load_optimizer_states(optimizers, states)


def state_targets(entries: Mapping[str, Any], names: list[str], prefix: str, params: Mapping[str, Tensor]
                  ) -> dict[str, Any]:
    """Tensors to read optimizer state ``names`` into: the state of a sharded parameter that is shaped like it, as an
    empty DTensor like the parameter (this replica's shard, which the read fills from the saved pieces it overlaps);
    any other, whole, of its saved shape (a step count, or the state of a parameter that is not sharded)."""
    targets: dict[str, Any] = {}
    for name in names:
        entry, param = entries[name], params[split_state_name(name[len(prefix):])[0]]
        if entry is not None and _is_dtensor(param) and tuple(entry[0]) == tuple(param.shape):
            targets[name] = torch.empty_like(param.detach(), dtype=entry[1])
        else:
            targets.update(empty_targets(entries, [name]))
    return targets


def own_tensors(pipeline: StagePipeline) -> dict[str, Any]:
    """The tensors this rank loads, under the module's names: its stage's, and (graph path) the state no stage holds,
    which every rank keeps alike."""
    graph = pipeline.graph
    if graph is None or graph.graph is None:
        return pipeline.module.state_dict()
    own = graph.graph.state_dict()  # every model chunk's, under the module's names (as the save's share)
    own.update({k: v for k, v in pipeline.module.state_dict().items() if k not in graph.graph.graph_state_names})
    return own


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _write_file(value: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(value, f)
        f.flush()
        os.fsync(f.fileno())


def replace_path(path: str, write: Callable[[str], None]) -> None:
    """Put a new checkpoint at ``path`` (``write`` puts it at the path it is given), the previous one (file or
    directory) kept aside as ``<path>.old-<pid>`` until the new one is in place: a kill leaves one of them whole."""
    if not os.path.lexists(path):
        write(path)
        return
    old = f"{path}.old-{os.getpid()}"
    os.replace(path, old)
    write(path)
    shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)


def move_into_place(source: str, path: str) -> None:
    """Rename the finished ``source`` to ``path``, which may hold the previous checkpoint (a file or a directory):
    Linux swaps the two in one step (``renameat2(RENAME_EXCHANGE)``), so ``path`` is never missing, even for an
    instant; elsewhere, :func:`replace_path`'s two renames (a kill between them leaves ``<path>.old-<pid>``, which
    loading finds)."""
    if os.path.lexists(path) and _exchange(source, path):
        shutil.rmtree(source) if os.path.isdir(source) else os.remove(source)
        return
    replace_path(path, lambda target: os.replace(source, target))


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically; False where the system cannot (not Linux, an old kernel or C library, a filesystem
    without it)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def interrupted_replacement(path: str) -> str | None:
    """The previous checkpoint a save interrupted while replacing ``path`` left as ``<path>.old-<pid>``, if any."""
    olds = sorted(glob.glob(f"{glob.escape(path)}.old-*"), key=os.path.getmtime)
    if not olds:
        return None
    warnings.warn(f"{path} is missing: a save was interrupted while replacing it; reading the previous checkpoint, "
                  f"{olds[-1]}, instead.", stacklevel=3)
    return olds[-1]


def read_meta(directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``meta.pt`` of a sharded checkpoint, and what it says about the model that wrote it."""
    if not is_sharded_checkpoint(directory):
        raise FileNotFoundError(f"{directory} is not a sharded checkpoint (a directory with {META_FILE}).")
    meta = torch.load(os.path.join(directory, META_FILE), map_location="cpu", weights_only=False)
    info = meta.pop(INFO, None)
    if info is None:
        raise ValueError(f"{directory}/{META_FILE} was not written by PipeDreamStrategy (no {INFO!r} in it).")
    return meta, info


def consolidate(directory: str) -> dict[str, Any]:
    """The single-device checkpoint of a sharded one (in this process: the whole model), as Lightning writes it:
    ``MyModule.load_from_checkpoint`` and a one-device ``Trainer`` read it."""
    meta, info = read_meta(directory)
    check_fits_in_memory(directory, saved_entries(directory))
    tensors = read_all(directory)
    meta["state_dict"] = {k: tensors[MODEL + k] for k in info["keys"] if MODEL + k in tensors}
    for i, optimizer in enumerate(meta.get("optimizer_states", [])):
        index = {n: j for j, n in enumerate(n for group in info["optimizers"][i] for n in group)}
        prefix = optimizer_prefix(i)
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            if key.startswith(prefix):
                name, part = split_state_name(key[len(prefix):])
                state.setdefault(index[name], {})[part] = value
        optimizer["state"] = dict(sorted(state.items()))
    return meta


def available_memory() -> int | None:
    """Bytes this machine can still give a process without swapping (Linux's MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def check_fits_in_memory(directory: str, entries: Mapping[str, Any]) -> None:
    """Refuse to consolidate a checkpoint whose tensors (the whole model and its optimizer state, which one process
    holds at once) exceed this machine's available memory, rather than be killed halfway."""
    total = sum(torch.Size(e[0]).numel() * torch.empty((), dtype=e[1]).element_size()
                for e in entries.values() if e is not None)
    available = available_memory()
    if available is not None and total > available:
        raise MemoryError(
            f"Consolidating {directory} holds all of its tensors in this process at once, {total / 2**30:.2f} GiB "
            f"(the whole model and its optimizer state), and this machine has {available / 2**30:.2f} GiB available. "
            "Run it on a machine with more memory; or resume from the directory itself (any number of stages, "
            "replicas or shards reads it, each rank its own part), or export the weights alone with "
            "`python -m lightning_pipedream checkpoint export-hf`, which reads one output file at a time."
        )
