"""Point-to-point transport of tensor trees between pipeline ranks over torch.distributed."""

from __future__ import annotations

import json
import math
import os
import pickle
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipedream.runtime.communication import shared_memory
from lightning_pipedream.runtime.communication.microbatch import flatten, unflatten
from lightning_pipedream.runtime.faults.errors import PeerFailedError, default_store
from lightning_pipedream.runtime.faults.mailbox import machine_id, process_start_time, process_state
from lightning_pipedream.runtime.faults.timeouts import world_timeout

_ALIGN = 64  # every leaf starts at a multiple of this many bytes in a message (any dtype can view it)
_HEADER = 8  # one int64 at the start of every message
# A message with tensors has padding before its first one (at _ALIGN): the send's start time goes there, as a float64,
# so that the receiver can tell waiting for the peer from the transfer (runtime/execution/accounts.py).
_STAMP = slice(_HEADER, 2 * _HEADER)


@dataclass
class _Meta:
    spec: tuple
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    requires_grad: list[bool]

    def layout(self) -> tuple[list[int], list[int], int]:
        """Byte offset and size of each leaf in a message, and the message's size."""
        offsets, sizes, end = [], [], _HEADER
        for shape, dtype in zip(self.shapes, self.dtypes):
            nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
            end = -(-end // _ALIGN) * _ALIGN
            offsets.append(end)
            sizes.append(nbytes)
            end += nbytes
        return offsets, sizes, end


@dataclass
class _Channel:
    last_meta: _Meta | None = None
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    size: int = _HEADER  # the size both ends expect for the next message: that of the last tree's layout

    def set_meta(self, meta: _Meta) -> None:
        self.last_meta = meta
        self.offsets, self.sizes, self.size = meta.layout()
        self.dtypes = [getattr(torch, d) for d in meta.dtypes]


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name

TRANSPORT_ENV = "LIGHTNING_PIPEDREAM_TRANSPORT"  # auto (default), gloo, shm or directional: how ranks talk
RING_BYTES_ENV = "LIGHTNING_PIPEDREAM_SHM_RING_BYTES"  # each direction's ring (default 2 MiB)
_TRANSPORTS = ("auto", "gloo", "shm", "directional")
_HOST_KEY = "lightning_pipedream/transport/"  # + global rank, in the store: where and how each rank talks


def transport_kind(kind: str | None = None) -> str:
    """``kind``, else the environment's choice (``LIGHTNING_PIPEDREAM_TRANSPORT``), else ``"auto"``; checked."""
    chosen = kind if kind is not None else os.environ.get(TRANSPORT_ENV, "auto")
    if chosen not in _TRANSPORTS:
        where = "transport=" if kind is not None else f"{TRANSPORT_ENV}="
        raise ValueError(f"{where}{chosen!r} is not a transport: use 'auto' (shared memory between ranks on one "
                         "machine, torch.distributed otherwise), 'gloo' (always torch.distributed), 'shm' or "
                         "'directional' (torch.distributed, each direction of a link on a group of its own: the "
                         "path NCCL takes).")
    return chosen


def _host_card(kind: str) -> dict:
    """What a peer needs to decide whether it shares memory with this rank, and to see whether it is alive."""
    shm = list(shared_memory.shm_identity()) if shared_memory.supported() else None
    return {"machine": machine_id(), "shm": shm, "pid": os.getpid(), "started": process_start_time(os.getpid()),
            "kind": kind}


class _SharedMemoryLink:
    """Messages to and from one peer on this machine through two rings (see :mod:`.shared_memory`).

    The writer of each direction makes its ring on its first message and sends the ring's file name through
    torch.distributed as that link's first message; the reader maps the file and removes its name.
    """

    def __init__(self, transport: Transport, peer: int, card: dict) -> None:
        self.transport, self.peer, self.card = transport, peer, card
        self.sender: shared_memory.Sender | None = None
        self.reader: shared_memory.Ring | None = None

    def isend(self, tensor: Tensor) -> Any:
        if self.sender is None:
            ring = shared_memory.Ring.create(int(os.environ.get(RING_BYTES_ENV, 2 << 20)))
            name = torch.zeros(shared_memory.NAME_BYTES, dtype=torch.uint8)
            name[: len(ring.path)].copy_(torch.frombuffer(bytearray(ring.path.encode()), dtype=torch.uint8))
            self.transport._pending.append((self.transport._call(dist.isend, name, self.peer, True), [name]))
            self.sender = shared_memory.Sender(ring, self.check, self._timeout_s())
        return _SentThroughRing(self.sender, self.sender.send(tensor))

    def irecv(self, tensor: Tensor) -> Any:
        return _ReceivedThroughRing(self, tensor)

    def receive_into(self, tensor: Tensor) -> None:
        if self.reader is None:
            name = torch.empty(shared_memory.NAME_BYTES, dtype=torch.uint8)
            self.transport._wait(self.transport._call(dist.irecv, name, self.peer, False))
            path = bytes(name.numpy()).rstrip(b"\0").decode()
            self.reader = shared_memory.Ring.open(path)
            self.reader.unlink()
        self.reader.read_into(tensor, self.check, self._timeout_s())

    def check(self) -> None:
        """Between sleeps of a wait: give up once the peer's process has ended, as a closed socket would tell gloo.

        Only then: a stop request or a posted error may come while this rank's own watchdog is still ending a frozen
        peer, and leaving the wait earlier would end this process before it has done so.
        """
        if process_state(self.card["pid"], self.card["started"]) in (None, "Z"):
            raise PeerFailedError(
                f"Pipeline communication with rank {self.peer} failed: its process ({self.card['pid']}) has ended "
                "(Connection closed by peer). Another rank has probably raised an error and exited; look for its "
                "traceback above.")

    def _timeout_s(self) -> float | None:
        timeout = self.transport._wait_timeout()
        return timeout.total_seconds() if timeout > timedelta(0) else None


@dataclass
class _SentThroughRing:
    sender: shared_memory.Sender
    work: shared_memory.SendWork

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.sender.wait(self.work, None)  # the sender's thread keeps the deadline and watches the peer
        return True


@dataclass
class _ReceivedThroughRing:
    link: _SharedMemoryLink
    tensor: Tensor
    done: bool = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.done:
            self.link.receive_into(self.tensor)
            self.done = True
        return True


@dataclass
class Transport:
    """Sends and receives tensor trees to and from other ranks of ``group``.

    Each tree travels as one message (a byte buffer: an int64 header, then every tensor at an
    aligned offset), and the receiver gets its tensors as views of that buffer. Both ends of a
    channel remember the last tree's structure, shapes and dtypes, so both know the size of the
    next message: a header of 0 means "same structure, the data follows in this message". When
    the structure changes (or on a channel's first message), the message of the expected size
    carries instead the length of a pickled description, and the description itself if it fits;
    otherwise the description follows in its own message; then the data comes in a message of
    the new size. So static shapes cost one message per tree, and a sequence whose length
    changes every batch still works. A peer's messages may travel on several named channels (the
    executor names each edge of the model: activations into stage s, gradients into stage s), each
    with its own remembered layout, so a link that alternates trees of different shapes (two model
    chunks per rank, interleaved) still sends one message per tree; the two ends must use the
    channels in the same order. (Two dependent messages per tree, header then data, cost
    gloo a few milliseconds each on a busy machine: a send queued before its receive is posted
    waits for the receiver's notification.) Sends are asynchronous; every handle is waited on,
    at the latest in :meth:`wait_all` (gloo has hung on unwaited batched p2p).

    Under NCCL every send and receive between two ranks of one process group goes on one CUDA stream, in call
    order, and a send ends only together with the peer's receive, both at the heads of their streams: two ranks
    that each send to the other before receiving (1F1B's steady state), or a receive posted ahead of a send the
    peer waits for, block each other for good. So messages to higher ranks travel on ``group`` and messages to
    lower ranks on ``reverse_group`` (the same ranks, communicators and streams of its own): each stream then
    carries one direction of one link, where the n-th send always meets the n-th receive, and receives may be
    posted ahead as on gloo. This is :attr:`directional`: always under NCCL (which refuses a transport without
    ``reverse_group``), and with ``kind="directional"`` on gloo too, so that CPU processes run the same code.
    (:mod:`lightning_pipedream.testing.nccl_model` checks every schedule against a model of these rules.)
    """

    group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # "auto": peers on this machine through shared memory when the tensors are on the CPU and the group is gloo's
    # (see :mod:`.shared_memory`); "gloo": always torch.distributed; "shm": shared memory or an error. None: the
    # environment's LIGHTNING_PIPEDREAM_TRANSPORT, else "auto". Every rank of a pipeline must choose alike.
    kind: str | None = None
    _send_channels: dict[tuple[int, Hashable], _Channel] = field(default_factory=dict)
    _recv_channels: dict[tuple[int, Hashable], _Channel] = field(default_factory=dict)
    _pending: list[tuple[Any, list[Tensor]]] = field(default_factory=list)
    # peer -> (channel, receive posted ahead, its buffer): at most one per peer, so the order of
    # messages between two ranks is the order of the calls (NCCL matches p2p by order alone)
    _posted: dict[int, tuple[Hashable, Any, Tensor]] = field(default_factory=dict)
    _timeout: timedelta | None = None  # what a wait may last: the world's timeout (see world_timeout)
    _links: dict[int, _SharedMemoryLink | None] = field(default_factory=dict)  # global peer -> its link (None: gloo)
    _card: dict | None = None  # this rank's host card, published in the store (None: torch.distributed only)
    # Messages to lower ranks (None: on ``group`` too); see the class's text. Its members are ``group``'s.
    reverse_group: Any = None
    directional: bool = False  # set from kind, backend and reverse_group: see the class's text
    # Seconds to add to this process's perf_counter to read the clock every rank shares (rank 0's), estimated at setup;
    # 0 between processes of one machine. Each message with tensors carries its send's start on that clock.
    clock_offset: float = 0.0
    # The last received message's send start, on this process's perf_counter (None: it carried no tensors).
    last_sent_at: float | None = None

    def __post_init__(self) -> None:
        self.kind = transport_kind(self.kind)
        backend = dist.get_backend(self.group) if dist.is_initialized() else None
        nccl = backend == "nccl" or self.device.type == "cuda"
        self.directional = self.reverse_group is not None and (self.kind == "directional" or nccl)
        if nccl and backend is not None and not self.directional:
            raise ValueError(
                "Transport over NCCL needs reverse_group= (a second process group of the same ranks): on one group "
                "NCCL's point-to-point streams deadlock the pipeline. Make it with dist.new_group(same ranks).")
        if self.kind == "directional" and self.reverse_group is None:
            raise ValueError("transport='directional' needs reverse_group= (a second process group of the same "
                             "ranks, for the messages to lower ranks).")
        if self.kind == "gloo" or self.directional or self.device.type != "cpu" or backend != "gloo":
            return
        store = default_store()
        if store is None:
            return
        # Published as soon as the transport exists, so that a peer's first message never waits for this rank.
        self._card = _host_card(self.kind)
        store.set(_HOST_KEY + str(dist.get_rank()), json.dumps(self._card))

    @property
    def uses_shared_memory(self) -> bool:
        """Whether any peer talked to so far goes through shared memory."""
        return any(link is not None for link in self._links.values())

    def _link(self, peer: int) -> _SharedMemoryLink | None:
        """The shared-memory link to global rank ``peer``, or None for torch.distributed; decided alike at both ends."""
        if peer in self._links:
            return self._links[peer]
        link = None
        if self._card is not None:
            theirs = json.loads(default_store().get(_HOST_KEY + str(peer)).decode())
            same = (theirs["machine"] == self._card["machine"] and theirs["shm"] is not None
                    and theirs["shm"] == self._card["shm"])
            if "gloo" not in (theirs["kind"], self._card["kind"]) and same:
                link = _SharedMemoryLink(self, peer, theirs)
            elif "shm" in (theirs["kind"], self._card["kind"]) and not same:
                raise PeerFailedError(
                    f"transport='shm' needs every pipeline peer on this machine, with the same /dev/shm, but rank "
                    f"{peer} is on {theirs['machine']} (this rank: {self._card['machine']}) or sees another "
                    f"/dev/shm. Use transport='auto' ({TRANSPORT_ENV}=auto).")
        self._links[peer] = link
        return link

    def _global(self, peer: int) -> int:
        # Peers are ranks within ``group``; torch.distributed p2p takes global ranks.
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def global_rank(self, peer: int | None) -> int | None:
        """``peer`` (a rank of ``group``) as a global rank; None stays None."""
        return None if peer is None else self._global(peer)

    def send(self, tree: Any, peer: int, where: str = "stage output", channel: Hashable = None) -> None:
        """Send ``tree`` to ``peer`` on ``channel`` without waiting for it to be received."""
        sent_at = time.perf_counter() + self.clock_offset
        leaves, spec = flatten(tree, where)
        meta = _Meta(
            spec,
            [tuple(t.shape) for t in leaves],
            [_dtype_name(t.dtype) for t in leaves],
            [t.requires_grad for t in leaves],
        )
        layout = self._send_channels.setdefault((peer, channel), _Channel())
        dst = self._global(peer)
        if meta != layout.last_meta:
            # The receiver expects a message of the old layout's size: it says what changed.
            blob = pickle.dumps(meta)
            notice = torch.zeros(layout.size, dtype=torch.uint8, device=self.device)
            notice[:_HEADER].view(torch.int64).fill_(len(blob))
            fits = _HEADER + len(blob) <= notice.numel()
            blob_tensor = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device)
            if fits:
                notice[_HEADER : _HEADER + len(blob)].copy_(blob_tensor)
            self._isend(notice, dst)
            if not fits:
                self._isend(blob_tensor, dst)
            layout.set_meta(meta)
        message = torch.empty(layout.size, dtype=torch.uint8, device=self.device)
        message[:_HEADER].zero_()
        if layout.size >= _ALIGN:
            message[_STAMP].view(torch.float64).fill_(sent_at)
        for t, offset, nbytes in zip(leaves, layout.offsets, layout.sizes):
            if nbytes:
                message[offset : offset + nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
        self._isend(message, dst)
        self._reap()

    def recv(self, peer: int, channel: Hashable = None) -> Any:
        """Receive the next tree from ``peer`` on ``channel`` (blocking); float tensors that required
        grad at the sender do here too.

        The tensors are views of the received message's buffer.
        """
        src = self._global(peer)
        layout = self._recv_channels.setdefault((peer, channel), _Channel())
        posted = self._posted.pop(peer, None)
        if posted is not None:
            posted_name, work, message = posted
            if posted_name != channel:
                raise RuntimeError(
                    f"A receive from rank {peer} on channel {posted_name!r} was posted but one on {channel!r} "
                    "was asked for; post receives in the order they are made."
                )
            self._wait(work)
        else:
            message = torch.empty(layout.size, dtype=torch.uint8, device=self.device)
            self._recv_into(message, src)
        head = message[: 2 * _HEADER].cpu() if message.numel() >= _ALIGN else message[:_HEADER].cpu()
        blob_size = int(head[:_HEADER].view(torch.int64).item())
        if blob_size > 0:
            if _HEADER + blob_size <= message.numel():
                blob = message[_HEADER : _HEADER + blob_size]
            else:
                blob = torch.empty(blob_size, dtype=torch.uint8, device=self.device)
                self._recv_into(blob, src)
            layout.set_meta(pickle.loads(blob.cpu().numpy().tobytes()))
            message = torch.empty(layout.size, dtype=torch.uint8, device=self.device)
            self._recv_into(message, src)
            head = message[: 2 * _HEADER].cpu() if message.numel() >= _ALIGN else message[:_HEADER].cpu()
            if int(head[:_HEADER].view(torch.int64).item()) != 0:
                raise PeerFailedError(f"Rank {peer} sent a second description in a row; the peers disagree.")
        self.last_sent_at = (float(head[_STAMP].view(torch.float64).item()) - self.clock_offset
                             if head.numel() >= 2 * _HEADER else None)
        meta = layout.last_meta
        if meta is None:
            raise PeerFailedError(f"The first message from rank {peer} carried no description; the peers disagree.")
        leaves = []
        for shape, dtype, needs_grad, offset, nbytes in zip(
            meta.shapes, layout.dtypes, meta.requires_grad, layout.offsets, layout.sizes
        ):
            t = message[offset : offset + nbytes].view(dtype).view(shape).detach()
            if needs_grad:
                t.requires_grad_()
            leaves.append(t)
        return unflatten(leaves, meta.spec)

    def post_recv(self, peer: int, channel: Hashable = None) -> None:
        """Post the receive of the next message from ``peer`` on ``channel`` now, for a later
        :meth:`recv` to wait on.

        Call it only when a :meth:`recv` from ``peer`` is certain to follow (the executor does, for
        the receives of the actions it is running). A receive posted before the peer sends lets the
        peer's send go out at once (gloo otherwise holds a send until the receiver asks for it, and
        on a busy rank that costs a thread wake-up or more), and the data lands while this rank
        computes. Both ends know the next message's size, so the buffer is right even when the
        tree's shapes change.
        """
        if peer in self._posted:
            return
        size = self._recv_channels.setdefault((peer, channel), _Channel()).size
        message = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._posted[peer] = (channel, self._irecv(message, self._global(peer)), message)

    def _isend(self, tensor: Tensor, dst: int) -> None:
        link = self._link(dst)
        work = link.isend(tensor) if link is not None else self._call(dist.isend, tensor, dst, True)
        self._pending.append((work, [tensor]))

    def wait_all(self) -> None:
        """Wait until every send has been received."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self._wait(work)

    def _reap(self) -> None:
        # Drop completed sends at every send: each keeps its message (a copy of what it carried) alive, and keeping
        # up to 64 of them, as this once did, held 64 activations' worth of memory nobody needed.
        self._pending = [(w, ts) for w, ts in self._pending if not w.is_completed()]

    def _recv_into(self, tensor: Tensor, src: int) -> None:
        self._wait(self._irecv(tensor, src))

    def _irecv(self, tensor: Tensor, src: int) -> Any:
        """The receive of the next message from global rank ``src`` into ``tensor``, through its link."""
        link = self._link(src)
        return link.irecv(tensor) if link is not None else self._call(dist.irecv, tensor, src, False)

    def _call(self, fn: Any, tensor: Tensor, peer: int, sending: bool) -> Any:
        try:
            return fn(tensor, peer, group=self._group_to(peer, sending))
        except RuntimeError as err:
            raise PeerFailedError(f"Pipeline communication with rank {peer} failed: {err}") from err

    def _group_to(self, peer: int, sending: bool) -> Any:
        """The group a message to (``sending``) or from global rank ``peer`` travels on: see the class's text."""
        if not self.directional:
            return self.group
        me = dist.get_rank()
        upwards = me < peer if sending else peer < me
        return self.group if upwards else self.reverse_group

    def _wait_timeout(self) -> timedelta:
        if self._timeout is None:
            # gloo only: NCCL's wait(timeout) would block the host until the transfer ends.
            self._timeout = world_timeout() if self.device.type == "cpu" else timedelta(0)
        return self._timeout

    def _wait(self, work: Any) -> None:
        try:
            work.wait(self._wait_timeout())
        except PeerFailedError:
            raise
        except RuntimeError as err:
            if "timed out" in str(err).lower():  # pipeline_failures names the peer and what it last did
                raise PeerFailedError(f"Pipeline communication timed out ({err}).") from err
            raise PeerFailedError(
                f"Pipeline communication failed ({err}). Another rank has probably raised an error and "
                "exited; look for its traceback above."
            ) from err
