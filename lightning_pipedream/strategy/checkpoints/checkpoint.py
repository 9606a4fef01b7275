"""Consolidated checkpoints of a pipeline: every stage's weights and optimizer state in single-device form."""

from __future__ import annotations

import glob
import io
import logging
import os
import re
import shutil
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor

from lightning_pipedream.runtime.faults.failures import pipeline_failures
from lightning_pipedream.strategy.checkpoints.single_file import StreamedSave
from lightning_pipedream.tree import map_tensors

_log = logging.getLogger("lightning_pipedream")


def _to_cpu(t: Tensor) -> Tensor:
    """A copy on the CPU; a DTensor (this replica's shard of a sharded tensor) as it is: a sharded checkpoint's
    writer copies its pieces."""
    from torch.distributed.tensor import DTensor

    return t.detach() if isinstance(t, DTensor) else t.detach().cpu()


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

    def named_state(self, optimizer: torch.optim.Optimizer, local_names: dict[int, str], on_cpu: bool = True
                    ) -> dict[str, Any]:
        """This rank's optimizer state keyed by parameter name, and its groups' settings (``on_cpu``: its tensors
        copied to the CPU; else as they are)."""
        state = optimizer.state_dict()
        order = self._local_order(optimizer, local_names)
        named = {order[int(i)]: map_tensors(_to_cpu, s) if on_cpu else s for i, s in state["state"].items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
        return {"state": named, "groups": groups}

    def to_full(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
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


class CheckpointGather:
    """Gathers one rank's share of the model (and of its optimizer state) into a single-device checkpoint on rank 0.

    Every rank holds the parameters and buffers of its own stage under the module's own names, so
    the full state dict is the union of the shares, put back in the module's own key order.
    """

    def __init__(self, rank: int, world_size: int, full_keys: list[str]) -> None:
        self.rank = rank
        self.world_size = world_size
        self.full_keys = full_keys
        self.stream: StreamedSave | None = None  # inside trainer.save_checkpoint: stand-ins, the data sent later

    def gather(self, share: Any) -> list[Any] | None:
        """Every rank's ``share`` on rank 0 (None elsewhere). Replicas of a stage send the same share. Inside
        ``trainer.save_checkpoint``, its tensors are stand-ins on rank 0 that the file's writer fills in
        (:mod:`~lightning_pipedream.strategy.checkpoints.single_file`)."""
        if self.stream is not None:
            return self.stream.gather(share)
        if self.world_size == 1:
            return [share]
        on_zero = self.rank == 0
        gathered: list[Any] = [None] * self.world_size if on_zero else []
        with pipeline_failures(self.rank, waiting="the checkpoint gather to rank 0"):
            dist.gather_object(share, gathered if on_zero else None, dst=0)
        return gathered if on_zero else None

    def state_dict(self, share: dict[str, Tensor]) -> dict[str, Any]:
        """The whole model's state dict on rank 0 from every rank's ``share``, keyed and ordered like the module's
        own; ``{}`` elsewhere."""
        shares = self.gather(share if self.stream is not None else map_tensors(_to_cpu, share))
        if shares is None:
            return {}
        full: dict[str, Any] = {}
        for share in shares:
            full.update(share)
        return {k: full[k] for k in self.full_keys if k in full}

    def optimizer_state(
        self, optimizer: torch.optim.Optimizer, layout: OptimizerLayout, local_names: dict[int, str]
    ) -> dict[str, Any]:
        """The optimizer's state in single-device form (indices over the whole model) on rank 0; ``{}`` elsewhere."""
        shares = self.gather(layout.named_state(optimizer, local_names, on_cpu=self.stream is None))
        return layout.to_full(shares) if shares is not None else {}


STALE_AFTER = 60.0  # seconds since its last write after which a dead writer's temporary file is removed


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint to a temporary file beside its path, flushed to disk, then renames it into place.

    A process killed while saving (by a scheduler, a user, the out-of-memory killer) leaves the
    previous checkpoint at that path whole and loadable; the temporary file's name does not end in
    ``.ckpt``, so nothing resumes from it, and the next save in that folder removes it (a temporary file of
    this writer, ``<name>.tmp-<pid>``, whose process is gone and which has not changed for a minute). Remote
    filesystems keep Lightning's own writer. A checkpoint that cannot be read is named, with what is wrong with it.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = os.fspath(path)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        remove_stale_temporaries(os.path.dirname(path) or ".")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        temporary = f"{path}.tmp-{os.getpid()}"
        try:
            self._write(temporary, buffer.getvalue())
            os.replace(temporary, path)  # atomic on one filesystem: the old file or the new one, never half
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)

    def _write(self, path: str, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        where = {} if map_location is None else {"map_location": map_location}  # else Lightning's default
        try:
            return super().load_checkpoint(path, weights_only=weights_only, **where)
        except FileNotFoundError:
            raise
        except Exception as err:  # torch.load's errors on a damaged file vary (OSError, IndexError, KeyError, ...)
            if not isinstance(get_filesystem(path), LocalFileSystem) or not os.path.isfile(os.fspath(path)):
                raise
            raise CheckpointReadError(unreadable_words(os.fspath(path), err)) from err


class CheckpointReadError(RuntimeError):
    """A checkpoint file exists but cannot be read (cut short, empty, not written by torch.save)."""


_TEMPORARY = re.compile(r".+\.tmp-(\d+)$")


def remove_stale_temporaries(directory: str) -> list[str]:
    """Remove the temporary files a killed :class:`AtomicCheckpointIO` left in ``directory`` (``*.tmp-<pid>``, the
    pid gone from this machine, unchanged for :data:`STALE_AFTER` seconds), and the temporary directories of a killed
    sharded save; returns their paths."""
    removed = []
    for candidate in glob.glob(os.path.join(glob.escape(directory), "*.tmp-*")):
        found = _TEMPORARY.match(os.path.basename(candidate))
        if found is None or int(found.group(1)) == os.getpid() or _alive(int(found.group(1))):
            continue
        try:
            if time.time() - os.path.getmtime(candidate) > STALE_AFTER:
                shutil.rmtree(candidate) if os.path.isdir(candidate) else os.remove(candidate)
                removed.append(candidate)
        except OSError:  # another process removed it, or it is not ours to remove
            continue
    return removed


def unfinished_saves(path: str) -> list[str]:
    """The saves beside checkpoint ``path`` that began after it was written and never finished (``*.tmp-<pid>``: a
    file or a sharded directory that a kill left before it was renamed into place), newest last."""
    directory = os.path.dirname(path) or "."
    try:
        written = os.path.getmtime(path)
    except OSError:
        return []
    found = [c for c in glob.glob(os.path.join(glob.escape(directory), "*.tmp-*"))
             if _TEMPORARY.match(os.path.basename(c)) and os.path.getmtime(c) > written]
    return sorted(found, key=os.path.getmtime)


def say_skipped_saves(path: str) -> None:
    """Say in the log which newer saves a resume from ``path`` skips because they did not finish."""
    skipped = unfinished_saves(path)
    if skipped and rank_zero_only.rank == 0:  # every rank loads; one says it
        _log.info("Resuming from %s, the newest complete checkpoint; %d newer save(s) did not finish and are skipped: "
                  "%s", path, len(skipped), ", ".join(os.path.basename(s) for s in skipped))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


def unreadable_words(path: str, err: BaseException) -> str:
    """Which checkpoint file cannot be read, what is wrong with it, and what to do."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if size == 0:
        what = "it is empty (0 bytes): its write never began, or the disk was full"
    elif head.startswith(b"PK") and not zipfile.is_zipfile(path):
        what = (f"it is cut short ({size} bytes, and the archive's directory that torch.save writes at its end is "
                "missing): a copy or a write that did not finish (a full disk, a killed process)")
    elif not head.startswith(b"PK") and not head.startswith(b"\x80"):
        what = f"it was not written by torch.save (it begins with {head!r}, {size} bytes)"
    else:
        what = f"torch.load fails on it ({size} bytes)"
    first = (str(err).splitlines() or [""])[0][:200]
    return (f"The checkpoint {path} cannot be read: {what}. ({type(err).__name__}: {first}) "
            "Resume from another checkpoint (the previous one is kept whole by PipeDreamStrategy's writer), or "
            "copy this one again.")


def load_own_share(module: torch.nn.Module, state: Mapping[str, Any], strict: bool) -> None:
    """Load this rank's part of a consolidated (or single-device) state dict into ``module``."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    if strict and missing:
        raise KeyError(
            f"The checkpoint lacks {missing[:5]} of this model's keys; is it from another model? "
            "Load it with strict=False to keep those parameters as they are."
        )
    module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


def writes_itself(checkpoint_io: Any, path: Any, storage_options: Any) -> bool:
    """Whether the strategy writes a single-file checkpoint itself, stage by stage (its own CheckpointIO, to a local
    path, no storage options); otherwise the CheckpointIO the user gave writes the whole dict."""
    return (type(checkpoint_io) is AtomicCheckpointIO and storage_options is None
            and isinstance(get_filesystem(path), LocalFileSystem))
