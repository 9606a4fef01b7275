"""A single-file checkpoint written stage by stage: no rank holds the whole model's state at once.

Inside ``trainer.save_checkpoint`` (ModelCheckpoint's saves included) the strategy's state hooks do not gather every
stage's tensors on rank 0: each rank keeps its own (references, no copy) and sends rank 0 only a description (names,
shapes, dtypes), from which rank 0 builds the checkpoint dict with a stand-in on the meta device for every tensor of
the model's state and optimizer state (:class:`StreamedSave`). Rank 0 then writes the file itself: the pickle of the
checkpoint (each stand-in pickled as the tensor it stands for, a CPU tensor of its shape and dtype in a storage
record of its own), then the records, asking each rank in turn for its tensors, a group of at most
:data:`GROUP_BYTES` (or one larger tensor) at a time, writing and freeing each group before the next. Rank 0's peak
grows by about the largest tensor or group, not by the model. The file is what ``torch.save`` writes (a zip of
``data.pkl`` and one record per storage), read by ``torch.load`` (``weights_only`` too), ``load_from_checkpoint`` and
``ckpt_path=`` as before.

Outside a save (``trainer.strategy.lightning_module_state_dict()`` called directly) rank 0 gathers the whole state as
before. A save through another ``CheckpointIO``, with ``storage_options`` or to a remote filesystem, fills the
stand-ins in first (every stage's tensors on rank 0, as before) and hands that CheckpointIO the whole dict.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipedream.runtime.faults.failures import pipeline_failures
from lightning_pipedream.tree import map_tensors, tensors

GROUP_BYTES = 2**20  # tensors smaller than this travel to rank 0 together, up to this many bytes a message
_PROTOCOL = 2  # torch.save's pickle protocol


@dataclass(frozen=True)
class _Described:
    """What rank 0 learns of another rank's tensor: enough to stand in for it and to receive it."""

    rank: int
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _element_size(self.dtype)


@dataclass
class StreamedSave:
    """One ``trainer.save_checkpoint``'s tensors of the model and optimizer state, on every rank: its own (what it
    sends when asked) and on rank 0 the stand-ins (meta tensors) that the file's writer replaces by them."""

    rank: int
    world_size: int
    own: list[Tensor] = field(default_factory=list)  # this rank's tensors, by index
    stand_ins: dict[int, tuple[Tensor, _Described]] = field(default_factory=dict)  # rank 0: id(stand-in) -> source

    def gather(self, share: Any) -> list[Any] | None:
        """Every rank's ``share`` (a tree of tensors) on rank 0 with its tensors replaced by stand-ins; None
        elsewhere. Only shapes and dtypes travel now; the data travels when :func:`write_streamed` asks for it."""
        described = map_tensors(self._describe, share)
        if self.world_size == 1:
            shares = [described]
        else:
            shares = [None] * self.world_size if self.rank == 0 else []
            with pipeline_failures(self.rank, waiting="the checkpoint's description to rank 0"):
                dist.gather_object(described, shares if self.rank == 0 else None, dst=0)
        if self.rank != 0:
            return None
        return [_replace_described(part, self._stand_in) for part in shares]

    def _describe(self, t: Tensor) -> _Described:
        self.own.append(t.detach())
        return _Described(self.rank, len(self.own) - 1, tuple(t.shape), t.dtype)

    def _stand_in(self, d: _Described) -> Tensor:
        stand_in = torch.empty(d.shape, dtype=d.dtype, device="meta")
        self.stand_ins[id(stand_in)] = (stand_in, d)
        return stand_in

    def source_of(self, t: Tensor) -> _Described | None:
        """The tensor ``t`` stands in for, if it is one of this save's stand-ins."""
        found = self.stand_ins.get(id(t))
        return found[1] if found is not None and found[0] is t else None

    # -- the data, rank by rank ------------------------------------------------------------------------------------
    def ask(self, wanted: list[_Described] | None) -> dict[int, list[int]]:
        """Every rank learns which of its tensors rank 0 wants (``wanted``, rank 0's list; None elsewhere), by rank."""
        requests: dict[int, list[int]] = {}
        for d in wanted or []:
            requests.setdefault(d.rank, []).append(d.index)
        if self.world_size > 1:
            box = [requests]
            with pipeline_failures(self.rank, waiting="rank 0's list of the checkpoint's tensors"):
                dist.broadcast_object_list(box, src=0)
            requests = box[0]
        return requests

    def send_own(self, indices: list[int], device: torch.device) -> None:
        """Another rank: send rank 0 the tensors ``indices`` in order, grouped as :func:`groups` says."""
        with pipeline_failures(self.rank, waiting="rank 0 receiving the checkpoint's tensors"):
            for group in groups([self.own[i].numel() * self.own[i].element_size() for i in indices]):
                parts = [_bytes_of(self.own[indices[j]]).to(device) for j in group]
                parts = [p for p in parts if p.numel()]
                if parts:
                    dist.send(parts[0] if len(parts) == 1 else torch.cat(parts), dst=0)

    def receive(self, rank: int, described: list[_Described], device: torch.device) -> Iterator[tuple[int, Tensor]]:
        """Rank 0: each of ``described`` (rank ``rank``'s, in its order) as bytes on the CPU, a group at a time."""
        for group in groups([d.nbytes for d in described]):
            sizes = [described[j].nbytes for j in group]
            whole = None
            if rank == 0:
                buffers = [_bytes_of(self.own[described[j].index]).cpu() for j in group]
            elif sum(sizes) == 0:
                buffers = [torch.empty(0, dtype=torch.uint8) for _ in group]
            else:
                whole = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
                with pipeline_failures(0, waiting=f"rank {rank} sending its stage's checkpoint tensors"):
                    dist.recv(whole, src=rank)
                whole = whole.cpu()
                buffers = list(whole.split(sizes))
            yield from zip(group, buffers)
            del buffers, whole


def groups(sizes: list[int]) -> list[list[int]]:
    """Consecutive indices of ``sizes`` in messages of at most :data:`GROUP_BYTES` (a larger tensor alone): the
    sender and rank 0 compute the same groups from the same sizes."""
    out: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not out or total + size > GROUP_BYTES:
            out.append([])
            total = 0
        out[-1].append(i)
        total += size
    return out


def _bytes_of(t: Tensor) -> Tensor:
    """``t``'s data as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _exact_storage(data: Tensor) -> Any:
    """A storage holding exactly ``data``'s bytes (a uint8 tensor): its own, or a copy of a view into a larger one (a
    group's message, a parameter inside a flat buffer)."""
    storage = data.untyped_storage()
    if data.storage_offset() == 0 and storage.nbytes() == data.numel():
        return storage
    return data.clone().untyped_storage()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _replace_described(tree: Any, fn: Any) -> Any:
    """``tree`` (dicts, lists and tuples, as :func:`map_tensors` builds them) with ``fn(d)`` for each description."""
    if isinstance(tree, _Described):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _replace_described(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_replace_described(v, fn) for v in tree)
    return tree


# -- the file ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Record:
    """A storage record that the writer fills from a rank's tensor."""

    key: str
    dtype: torch.dtype
    numel: int


class _Pickler(pickle.Pickler):
    """``torch.save``'s pickle of the checkpoint, a stand-in pickled as the CPU tensor it stands for (its data in a
    record of its own, ``keys``), every other tensor's storage as ``torch.save`` writes it."""

    def __init__(self, buffer: io.BytesIO, save: StreamedSave, keys: dict[_Described, str], first_key: int) -> None:
        super().__init__(buffer, protocol=_PROTOCOL)
        self.save, self.keys, self.first_key = save, keys, first_key
        self.storages: dict[str, Any] = {}  # key -> an ordinary tensor's storage (keys from first_key on)
        self._storage_keys: dict[int, str] = {}
        self.stand_ins_met: list[_Described] = []

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, Tensor):
            return NotImplemented
        source = self.save.source_of(obj)
        if source is not None:
            if source not in self.keys:
                self.keys[source] = f"s{len(self.keys)}"  # a placeholder key on the first pass
                self.stand_ins_met.append(source)
            record = _Record(self.keys[source], source.dtype, _numel(source.shape))
            stride = _contiguous_stride(source.shape)
            return torch._utils._rebuild_tensor_v2, (record, 0, source.shape, stride, False, collections.OrderedDict())
        if obj.is_meta:
            raise ValueError(
                "The checkpoint holds a tensor on the meta device that is none of the model's or optimizer's own: "
                "under PipeDreamStrategy the single-file save's state_dict and optimizer_states hold stand-ins (meta "
                "tensors) that the save fills in from each stage's process; a hook (on_save_checkpoint) that makes new "
                "tensors from them cannot be written. Change the weights in on_load_checkpoint instead, or save "
                "with PipeDreamStrategy(checkpoint='sharded')."
            )
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Record):
            return "storage", _storage_type(obj.dtype), obj.key, "cpu", obj.numel
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            if isinstance(obj, torch.storage.TypedStorage):
                storage, storage_type, numel = obj._untyped_storage, getattr(torch, obj._pickle_storage_type()), \
                    obj._size()
            else:
                storage, storage_type, numel = obj, torch.UntypedStorage, obj.nbytes()
            key = self._storage_keys.setdefault(storage._cdata, str(self.first_key + len(self._storage_keys)))
            self.storages[key] = storage
            return "storage", storage_type, key, torch.serialization.location_tag(storage), numel
        return None


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for s in reversed(shape):
        stride.append(step)
        step *= max(s, 1)
    return tuple(reversed(stride))


def _storage_type(dtype: torch.dtype) -> Any:
    """The storage class ``torch.save`` names for a tensor of ``dtype`` (``torch.FloatStorage``, ...)."""
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


def _pickled(checkpoint: Any, save: StreamedSave, keys: dict[_Described, str], first_key: int = 0
             ) -> tuple[bytes, _Pickler]:
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, save, keys, first_key)
    pickler.dump(checkpoint)
    return buffer.getvalue(), pickler


def write_streamed(checkpoint: dict[str, Any], path: str, save: StreamedSave, device: torch.device, *,
                   put_in_place: Callable[[str, Callable[[str], None]], None] | None = None,
                   clear_leftovers: Callable[[str], Any] | None = None) -> None:
    """Every rank calls it: rank 0 writes ``checkpoint`` to ``path`` (a temporary file beside it, flushed, then
    renamed into place: ``put_in_place(path, write)``, which keeps a previous checkpoint there until the new one is
    whole), filling each stand-in with its rank's tensor, one group at a time; the others send theirs.
    ``clear_leftovers(directory)`` removes what a killed save left there first."""
    wanted: list[_Described] | None = None
    data, pickler = b"", None
    if save.rank == 0:
        # A first pass finds the stand-ins the checkpoint still holds (a hook may have dropped some); their records
        # are numbered in the order they are received, rank by rank, then the checkpoint's other tensors.
        _, first = _pickled(checkpoint, save, {})
        wanted = sorted(first.stand_ins_met, key=lambda d: (d.rank, d.index))
        keys = {d: str(i) for i, d in enumerate(wanted)}
        data, pickler = _pickled(checkpoint, save, keys, first_key=len(wanted))
    requests = save.ask(wanted)
    if save.rank != 0:
        save.send_own(requests.get(save.rank, []), device)
        return
    assert wanted is not None and pickler is not None
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if clear_leftovers is not None:
        clear_leftovers(os.path.dirname(path) or ".")
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with torch.serialization._open_zipfile_writer(temporary) as archive:  # torch.save's own zip writer
            archive.write_record("data.pkl", data, len(data))
            archive.write_record(".format_version", "1", len("1"))
            alignment = str(torch.serialization._get_storage_alignment()) \
                if hasattr(torch.serialization, "_get_storage_alignment") else None
            if alignment is not None:
                archive.write_record(".storage_alignment", alignment, len(alignment))
            archive.write_record("byteorder", sys.byteorder, len(sys.byteorder))
            for d, buffer in _received(save, wanted, device):
                storage = _exact_storage(buffer)
                archive.write_record(f"data/{pickler.keys[d]}", storage, storage.nbytes())
            for key, storage in pickler.storages.items():  # the checkpoint's other tensors (loops, schedulers)
                storage = storage.cpu() if storage.device.type != "cpu" else storage
                archive.write_record(f"data/{key}", storage, storage.nbytes())
        _fsync(temporary)
        if put_in_place is not None:
            put_in_place(path, lambda target: os.replace(temporary, target))
        else:
            os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _received(save: StreamedSave, wanted: list[_Described],
              device: torch.device) -> Iterator[tuple[_Described, Tensor]]:
    """Each wanted tensor with the buffer it arrived in on rank 0, rank after rank (each rank's in one stream)."""
    by_rank: dict[int, list[_Described]] = {}
    for d in wanted:
        by_rank.setdefault(d.rank, []).append(d)
    for rank in sorted(by_rank):
        described = by_rank[rank]
        for j, buffer in save.receive(rank, described, device):
            yield described[j], buffer


def _fsync(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fill_in(checkpoint: dict[str, Any], save: StreamedSave, device: torch.device) -> dict[str, Any]:
    """Every rank calls it: the checkpoint with its stand-ins replaced by the tensors themselves, on rank 0 (every
    stage's state at once, as a gather makes it: for a CheckpointIO that writes the dict itself)."""
    wanted: list[_Described] | None = None
    if save.rank == 0:
        found = [save.source_of(t) for t in tensors(checkpoint)]
        wanted = sorted({d for d in found if d is not None}, key=lambda d: (d.rank, d.index))
    requests = save.ask(wanted)
    if save.rank != 0:
        save.send_own(requests.get(save.rank, []), device)
        return checkpoint
    assert wanted is not None
    filled = {d: buffer.clone().view(d.dtype).reshape(d.shape) if d.nbytes else torch.empty(d.shape, dtype=d.dtype)
              for d, buffer in _received(save, wanted, device)}

    def fill(t: Tensor) -> Tensor:
        source = save.source_of(t)
        return filled[source] if source is not None else t

    return map_tensors(fill, checkpoint)


def message_device(device: torch.device | None) -> torch.device:
    """Where the tensors travel to rank 0: the device under NCCL (it sends device tensors only), else the CPU."""
    if device is not None and dist.is_initialized() and dist.get_backend() == "nccl":
        return device
    return torch.device("cpu")


@contextmanager
def streamed_save(holder: Any, rank: int, world_size: int) -> Iterator[StreamedSave]:
    """``holder.stream`` is a new :class:`StreamedSave` for the length of one ``trainer.save_checkpoint``."""
    holder.stream = StreamedSave(rank, world_size)
    try:
        yield holder.stream
    finally:
        holder.stream = None


_STREAMS = "_pipedream_streams"


def stream_saves(trainer: Any) -> None:
    """Make ``trainer.save_checkpoint`` (which ModelCheckpoint calls too) a streamed save under
    PipeDreamStrategy: while it runs, the state hooks give stand-ins and the strategy's ``save_checkpoint`` writes
    the file stage by stage. Once per Trainer; under another strategy the call is Lightning's own."""
    save = trainer.save_checkpoint
    if getattr(save, _STREAMS, False):
        return

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        strategy = trainer.strategy
        pipeline = getattr(strategy, "_pipeline", None)
        checkpoints = getattr(strategy, "checkpoints", None)
        if pipeline is None or checkpoints is None or checkpoints.sharded:
            return save(*args, **kwargs)
        with streamed_save(pipeline.checkpoint, strategy.global_rank, strategy.world_size):
            return save(*args, **kwargs)

    setattr(save_checkpoint, _STREAMS, True)
    save_checkpoint.__doc__ = save.__doc__
    trainer.save_checkpoint = save_checkpoint
