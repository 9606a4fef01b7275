"""Point-to-point transport of tensor trees between pipeline ranks over torch.distributed."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipedream.runtime.microbatch import flatten, unflatten


class PeerFailedError(RuntimeError):
    """Communication with another pipeline rank failed, usually because that rank raised and exited."""


_ERROR_KEY = "lightning_pipedream/error"


def post_error(message: str) -> None:
    """Leave a failing rank's error in the process group's store, so that its peers can report it."""
    store = _default_store()
    if store is not None:
        try:
            store.set(_ERROR_KEY, message)
        except Exception:  # the store may be gone already; the peers still see closed sockets
            pass


def posted_error() -> str | None:
    """The error another rank left with :func:`post_error`, if any (without blocking)."""
    store = _default_store()
    try:
        if store is not None and store.check([_ERROR_KEY]):
            return store.get(_ERROR_KEY).decode()
    except Exception:
        pass
    return None


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


@dataclass
class _Meta:
    spec: tuple
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    requires_grad: list[bool]


@dataclass
class _Channel:
    last_meta: _Meta | None = None


@dataclass
class Transport:
    """Sends and receives tensor trees to and from other ranks of ``group``.

    Every message starts with a one-number header: 0 when the tree's structure, shapes and
    dtypes are those of the previous message on the same channel, otherwise the length of a
    pickled description that follows. So static shapes cost one tiny message, and a sequence
    whose length changes every batch still works. Sends are asynchronous; every handle is
    waited on, at the latest in :meth:`wait_all` (gloo has hung on unwaited batched p2p).
    """

    group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _send_channels: dict[int, _Channel] = field(default_factory=dict)
    _recv_channels: dict[int, _Channel] = field(default_factory=dict)
    _pending: list[tuple[Any, list[Tensor]]] = field(default_factory=list)
    bytes_sent: int = 0

    def _global(self, peer: int) -> int:
        # Peers are ranks within ``group``; torch.distributed p2p takes global ranks.
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def send(self, tree: Any, peer: int, where: str = "stage output") -> None:
        """Send ``tree`` to ``peer`` without waiting for it to be received."""
        leaves, spec = flatten(tree, where)
        meta = _Meta(
            spec,
            [tuple(t.shape) for t in leaves],
            [str(t.dtype).removeprefix("torch.") for t in leaves],
            [bool(t.requires_grad) for t in leaves],
        )
        channel = self._send_channels.setdefault(peer, _Channel())
        tensors: list[Tensor] = []
        if meta == channel.last_meta:
            tensors.append(torch.zeros(1, dtype=torch.int64, device=self.device))
        else:
            blob = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8).to(self.device)
            tensors.append(torch.tensor([blob.numel()], dtype=torch.int64, device=self.device))
            tensors.append(blob)
            channel.last_meta = meta
        tensors += [t.detach().contiguous() for t in leaves if t.numel() > 0]
        dst = self._global(peer)
        for t in tensors:
            self._pending.append((self._call(dist.isend, t, dst), [t]))
            self.bytes_sent += t.numel() * t.element_size()
        self._reap()

    def recv(self, peer: int) -> Any:
        """Receive the next tree from ``peer`` (blocking); float tensors that required grad at the sender do here too."""
        src = self._global(peer)
        channel = self._recv_channels.setdefault(peer, _Channel())
        header = torch.empty(1, dtype=torch.int64, device=self.device)
        self._recv_into(header, src)
        if int(header.item()) > 0:
            blob = torch.empty(int(header.item()), dtype=torch.uint8, device=self.device)
            self._recv_into(blob, src)
            channel.last_meta = pickle.loads(blob.cpu().numpy().tobytes())
        meta = channel.last_meta
        if meta is None:
            raise PeerFailedError(f"The first message from rank {peer} carried no description; the peers disagree.")
        leaves = []
        for shape, dtype, needs_grad in zip(meta.shapes, meta.dtypes, meta.requires_grad):
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            if t.numel() > 0:
                self._recv_into(t, src)
            if needs_grad:
                t.requires_grad_()
            leaves.append(t)
        return unflatten(leaves, meta.spec)

    def wait_all(self) -> None:
        """Wait until every send has been received."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self._wait(work)

    def _reap(self) -> None:
        # Drop completed sends so the list (and the tensors it keeps alive) stays short.
        if len(self._pending) > 64:
            self._pending = [(w, ts) for w, ts in self._pending if not w.is_completed()]

    def _recv_into(self, tensor: Tensor, src: int) -> None:
        self._wait(self._call(dist.irecv, tensor, src))

    def _call(self, fn: Any, tensor: Tensor, peer: int) -> Any:
        try:
            return fn(tensor, peer, group=self.group)
        except RuntimeError as err:
            raise PeerFailedError(f"Pipeline communication with rank {peer} failed: {err}") from err

    @staticmethod
    def _wait(work: Any) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            raise PeerFailedError(
                f"Pipeline communication failed ({err}). Another rank has probably raised an error and "
                "exited; look for its traceback above."
            ) from err
