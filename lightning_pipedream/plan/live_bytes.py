"""Bytes of tensor storages alive while code runs, and their peak: the memory model's yardstick on any device."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# The meters on now, each told of every in-place resize, and torch's own ``UntypedStorage.resize_`` while a wrapper
# stands in for it. One wrapper for them all, put back when the last meter leaves, whatever order meters leave in (a
# wrapper per meter, each putting back what it found, would leave one in place when they left out of order).
_following: list[LiveTensorBytes] = []
_torch_resize: Callable[..., Any] | None = None


def _follow_resizes(meter: LiveTensorBytes) -> None:
    global _torch_resize
    if not _following:
        plain = _torch_resize = torch.UntypedStorage.resize_

        def followed(storage: torch.UntypedStorage, size: int) -> Any:
            out = plain(storage, size)
            for each in list(_following):
                each._storage_resized(storage)
            return out

        torch.UntypedStorage.resize_ = followed  # type: ignore[method-assign, assignment]
    _following.append(meter)


def _unfollow_resizes(meter: LiveTensorBytes) -> None:
    global _torch_resize
    if meter in _following:
        _following.remove(meter)
    if not _following and _torch_resize is not None:
        torch.UntypedStorage.resize_ = _torch_resize  # type: ignore[method-assign]
        _torch_resize = None


class LiveTensorBytes(TorchDispatchMode):
    """Every tensor an operator returns while the mode is on, counted once per storage until the last tensor seen on
    it dies: what an allocator would hand out, without its caching, fragmentation or the process's baseline.

    Tensors made before the mode started are not seen; :meth:`add` them (the parameters, say) to count them. Memory
    the allocator did not hand out (a storage that cannot be resized: a mapped file such as the shared-memory
    transport's rings, a NumPy buffer) is not counted. A tensor subclass that wraps others (a DTensor, whose
    operators the mode sees only from outside) counts as the tensors it wraps. A storage resized in place while the
    mode is on (``UntypedStorage.resize_``, which no operator shows: FSDP2 frees its gathered parameters with
    ``resize_(0)`` and allocates them again the same way; the replicas' all-reduce frees its flat copy so) is counted
    at its new size. With
    :meth:`labelled`, :attr:`peak_phase` says what ran at the peak and :attr:`transient` how far each phase rose above
    the live bytes it began with.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self.live = self.peak = 0
        self.phase, self.phase_base = "other", 0
        self.peak_phase, self.peak_phase_base = "other", 0
        self.transient: dict[str, int] = {}  # per phase, its most bytes above the live bytes it began with
        # storage (its identity, which outlives a resize) -> [tensors seen on it, bytes]
        self._storages: dict[int, list[int]] = {}
        self._seen: set[int] = set()

    def add(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage from now until the last tensor seen on it dies (once per tensor and storage)."""
        if id(t) in self._seen or t.device.type != self.device_type:
            return
        flatten = getattr(type(t), "__tensor_flatten__", None)
        if flatten is not None:  # a wrapper (DTensor): what it holds is its inner tensors
            names, _ = flatten(t)
            for name in names:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self.add(inner)
            return
        storage = t.untyped_storage()
        if not storage.resizable():
            return
        key, nbytes = storage._cdata, storage.nbytes()
        self._seen.add(id(t))
        entry = self._storages.setdefault(key, [0, nbytes])
        if entry[0] == 0:
            self._grow(nbytes)
        entry[0] += 1
        weakref.finalize(t, self._drop, id(t), key)

    def _storage_resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._storages.get(storage._cdata)
        if entry is None:  # not counted: made before the meter, and not added
            return
        change, entry[1] = storage.nbytes() - entry[1], storage.nbytes()
        if change > 0:
            self._grow(change)
        else:
            self.live += change

    def _grow(self, nbytes: int) -> None:
        self.live += nbytes
        if self.live > self.peak:
            self.peak, self.peak_phase, self.peak_phase_base = self.live, self.phase, self.phase_base
        rise = self.live - self.phase_base
        if rise > self.transient.get(self.phase, 0):
            self.transient[self.phase] = rise

    def add_all(self, tensors: Iterable[Any]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.add(t)

    def _drop(self, ident: int, key: int) -> None:
        self._seen.discard(ident)
        entry = self._storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._storages[key]

    def reset_peak(self) -> None:
        """Forget the peak so far: from now, the peak is measured from the live bytes."""
        self.peak, self.peak_phase, self.peak_phase_base = self.live, self.phase, self.live
        self.transient.clear()

    def labelled(self, phase: str, fn: Callable) -> Callable:
        """``fn``, with ``phase`` recorded as what runs while it does."""

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            outer = self.phase, self.phase_base
            self.phase, self.phase_base = phase, self.live
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase, self.phase_base = outer

        return wrapped

    def __enter__(self) -> LiveTensorBytes:
        _follow_resizes(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _unfollow_resizes(self)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out
