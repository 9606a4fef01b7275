"""An in-process model of NCCL's point-to-point semantics and collectives: ranks as threads, one FIFO stream per pair
of ranks, each group's collectives in call order. For the tests and ``benchmarks.memory.gpu_check``; training never
uses it.

No CPU backend shows how NCCL orders point-to-point messages, so the code that GPUs run is checked here against a
model of it, in one process, with each rank's code running in a thread of its own:

- Every ``isend``/``irecv`` between two ranks goes on one stream for that pair and process group, in call order
  (torch's ``ProcessGroupNCCL`` keys its point-to-point communicator and stream by the pair ``low:high``, and
  each process group has communicators of its own). A ``batch_isend_irecv`` is one entry on the stream of
  each peer it names.
- An entry starts only when it is at the head of every stream it is on; its operations then progress
  independently of each other (an NCCL group), and it ends when all of them have. A send and the peer's
  receive complete together, the n-th send from a to b with b's n-th receive from a, and both only while
  their entries are at the heads of their streams. (Real NCCL may finish a small send early from a buffer;
  the model never does, so an order it accepts works whatever the message sizes.)
- Waiting on a work blocks the calling thread until its entry has ended (a host reading a received tensor
  blocks there; waiting on sends as well is the conservative choice).
- Sizes must match: a receive of another size than its send is an error, as NCCL's truncation is.
- Collectives (``all_reduce``, ``broadcast``, ``all_gather``, ``barrier``, ``broadcast_object_list``) run per
  process group in call order: a group's n-th collective on every member meets the others' n-th (it must be the same
  kind: another is an error, as NCCL would hang or corrupt), on communicators of their own, apart from the
  point-to-point streams. It completes once every member has called it; until then a member that waits on it (at
  the call, or at its work's ``wait`` with ``async_op=True``) blocks. A rank waiting in a collective for a member
  that waits elsewhere for it is a circle: the deadlock check names both.

When every rank still running waits on an entry that cannot progress, the model raises :class:`DeadlockError`
in each of them, naming the entries at the heads of every stream. Use :meth:`PointToPointModel.run`::

    model = PointToPointModel(world_size=2)
    results = model.run(lambda rank: train_one_step(rank), timeout=60.0)
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import Tensor


class DeadlockError(RuntimeError):
    """Every running rank waits on communication that can never complete under NCCL's rules."""


@dataclass
class _Op:
    is_send: bool
    rank: int  # the rank that called it
    peer: int
    tensor: Tensor
    done: bool = False

    def __str__(self) -> str:
        nbytes = self.tensor.numel() * self.tensor.element_size()
        return f"{'send to' if self.is_send else 'recv from'} {self.peer} ({nbytes} B)"


@dataclass(eq=False)
class _Entry:
    """One call's operations on the streams of the peers it names."""

    rank: int
    ops: list[_Op]
    number: int  # the rank's n-th entry, for the words of a deadlock
    grouped: bool
    group: Any  # the process group: each has streams of its own
    peers: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(op.done for op in self.ops)

    def __str__(self) -> str:
        kind = "group" if self.grouped else "call"
        return f"{kind} #{self.number} [" + ", ".join(str(op) for op in self.ops if not op.done) + "]"


@dataclass
class P2POp:
    """torch.distributed's ``P2POp`` as the model takes it (the real one needs an initialized process group)."""

    op: Callable[..., Any]
    tensor: Tensor
    peer: int | None = None
    group: Any = None
    tag: int = 0
    group_peer: int | None = None


@dataclass(eq=False)
class _Call:
    """One collective of a group: its kind, what each member brought, and whether every member has."""

    kind: str
    parts: dict[int, Any] = field(default_factory=dict)
    done: bool = False


@dataclass(eq=False)
class _InCollective:
    """What a rank waits on inside a collective, for the deadlock check: done once every member has called it."""

    call: _Call
    number: int
    group: Any
    members: tuple[int, ...] = ()

    @property
    def done(self) -> bool:
        return self.call.done

    def __str__(self) -> str:
        missing = [r for r in self.members if r not in self.call.parts]
        return (f"{self.call.kind} #{self.number} on {self.group or 'the world'}"
                + (f" (waiting for rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))})"
                   if missing else ""))


@dataclass(frozen=True)
class ModelGroup:
    """A process group of the model: its members (global ranks, sorted) and its place among the groups made."""

    ranks: tuple[int, ...]
    number: int

    def __str__(self) -> str:
        return f"group{self.number}{list(self.ranks)}"


class _Done:
    """The work of a collective that has ended."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


class _CollectiveWork:
    """The handle of a collective called with ``async_op=True``: its ``wait`` blocks until every member joined."""

    def __init__(self, model: PointToPointModel, rank: int, waiting: _InCollective) -> None:
        self.model, self.rank, self.waiting = model, rank, waiting

    def is_completed(self) -> bool:
        with self.model._cond:
            return self.waiting.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        with self.model._cond:
            self.model._wait_locked(self.rank, self.waiting)
        return True


class _Work:
    """The handle an ``isend``/``irecv``/``batch_isend_irecv`` returns: waits on its entry."""

    def __init__(self, model: PointToPointModel, entry: _Entry) -> None:
        self.model, self.entry = model, entry

    def is_completed(self) -> bool:
        with self.model._cond:
            return self.entry.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.model._wait(self.entry)
        return True


class PointToPointModel:
    """``world_size`` ranks exchanging messages under NCCL's point-to-point rules (see the module's text)."""

    def __init__(self, world_size: int, watchdog_s: float = 60.0) -> None:
        self.world_size = world_size
        self.watchdog_s = watchdog_s  # a last resort: the deadlock check should always answer first
        self._cond = threading.Condition()
        self._streams: dict[tuple[Any, int, int], deque[_Entry]] = {}  # (group, rank, peer) -> rank's entries
        self._entries = [0] * world_size
        self._waiting: dict[int, _Entry | _InCollective] = {}  # rank -> what its thread waits on
        self._finished: set[int] = set()
        self._deadlock: str | None = None
        self._error: str | None = None
        self._local = threading.local()
        self.messages = 0  # sends matched so far
        self._groups_made = [0] * world_size  # new_group calls per rank: the n-th of each rank is the same group
        self._collectives: dict[tuple[Any, int], _Call] = {}  # (group, n-th call) -> what its members brought
        self.collectives = 0  # collectives completed so far
        self._calls: dict[tuple[Any, int], int] = {}  # (group, rank) -> collectives it has called

    # ---------------------------------------------------------------- torch.distributed's calls, replaced
    def isend(self, tensor: Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
              group_dst: int | None = None) -> _Work:
        return self._post([(True, self._peer(dst, group_dst), tensor)], grouped=False, group=group)

    def irecv(self, tensor: Tensor, src: int | None = None, group: Any = None, tag: int = 0,
              group_src: int | None = None) -> _Work:
        return self._post([(False, self._peer(src, group_src), tensor)], grouped=False, group=group)

    def send(self, tensor: Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
             group_dst: int | None = None) -> None:
        self.isend(tensor, dst, group, tag, group_dst).wait()

    def recv(self, tensor: Tensor, src: int | None = None, group: Any = None, tag: int = 0,
             group_src: int | None = None) -> None:
        self.irecv(tensor, src, group, tag, group_src).wait()

    def batch_isend_irecv(self, p2p_op_list: Sequence[Any]) -> list[_Work]:
        ops = []
        groups = {p2p.group for p2p in p2p_op_list}
        if len(groups) != 1:
            raise ValueError(f"batch_isend_irecv's operations must all be on one process group, got {len(groups)}")
        for p2p in p2p_op_list:
            name = getattr(p2p.op, "__name__", "")
            if name not in ("isend", "irecv"):
                raise ValueError(f"batch_isend_irecv takes isend and irecv operations, got {p2p.op!r}")
            ops.append((name == "isend", self._peer(p2p.peer, p2p.group_peer), p2p.tensor))
        work = self._post(ops, grouped=True, group=groups.pop())
        return [work]  # NCCL's coalesced group: one work for all of its operations

    def new_group(self, ranks: Sequence[int] | None = None, *args: Any, **kwargs: Any) -> ModelGroup:
        rank = self.rank
        with self._cond:
            number = self._groups_made[rank]
            self._groups_made[rank] += 1
        return ModelGroup(tuple(sorted(ranks)) if ranks is not None else tuple(range(self.world_size)), number)

    def _members(self, group: Any) -> tuple[int, ...]:
        return group.ranks if isinstance(group, ModelGroup) else tuple(range(self.world_size))

    def get_rank(self, group: Any = None) -> int:
        return self._members(group).index(self.rank)

    def get_world_size(self, group: Any = None) -> int:
        return len(self._members(group))

    def get_global_rank(self, group: Any, group_rank: int) -> int:
        return self._members(group)[group_rank]

    def get_process_group_ranks(self, group: Any) -> list[int]:
        return list(self._members(group))

    def all_reduce(self, tensor: Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        """The sum (or maximum, minimum, product) over ``group``'s members."""
        ops = {None: torch.stack, dist.ReduceOp.SUM: lambda t: t.sum(0), dist.ReduceOp.MAX: lambda t: t.amax(0),
               dist.ReduceOp.MIN: lambda t: t.amin(0), dist.ReduceOp.PRODUCT: lambda t: t.prod(0)}
        if op not in ops:
            raise NotImplementedError(f"the model's all_reduce takes SUM, MAX, MIN or PRODUCT; got {op}")
        reduce = ops[op] if op is not None else (lambda t: t.sum(0))

        def finish(parts: dict[int, Any]) -> None:
            total = reduce(torch.stack([t.detach().clone() for t in parts.values()]))
            for t in parts.values():
                t.copy_(total)

        return self._collective("all_reduce", group, tensor, finish, async_op)

    def broadcast(self, tensor: Tensor, src: int | None = None, group: Any = None, async_op: bool = False,
                  group_src: int | None = None) -> Any:
        source = self._source(src, group_src, group)

        def finish(parts: dict[int, Any]) -> None:
            for t in parts.values():
                if t is not parts[source]:
                    t.copy_(parts[source])

        return self._collective(f"broadcast from rank {source}", group, tensor, finish, async_op)

    def broadcast_object_list(self, object_list: list[Any], src: int | None = None, group: Any = None,
                              device: Any = None, group_src: int | None = None) -> None:
        source = self._source(src, group_src, group)

        def finish(parts: dict[int, Any]) -> None:
            for objects in parts.values():
                objects[:] = list(parts[source])

        self._collective(f"broadcast_object_list from rank {source}", group, object_list, finish, False)

    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor, group: Any = None, async_op: bool = False) -> Any:
        members = self._members(group)

        def finish(parts: dict[int, Any]) -> None:
            for outputs, _ in parts.values():
                for i, member in enumerate(members):
                    outputs[i].copy_(parts[member][1])

        return self._collective("all_gather", group, (tensor_list, tensor), finish, async_op)

    def barrier(self, group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
        return self._collective("barrier", group, None, lambda parts: None, async_op)

    def _source(self, src: int | None, group_src: int | None, group: Any) -> int:
        """The global rank a broadcast comes from (``group_src``: its rank in ``group``)."""
        if group_src is not None:
            return self._members(group)[group_src]
        if src is None:
            raise ValueError("a broadcast names no source")
        return int(src)

    def _collective(self, kind: str, group: Any, part: Any, finish: Callable[[dict[int, Any]], None],
                    async_op: bool) -> Any:
        """Join ``group``'s next collective (the n-th call of this rank meets the other members' n-th); ``finish``
        gets every member's part once all have joined. Blocks until then, or returns a work to wait on."""
        rank, members = self.rank, self._members(group)
        if rank not in members:
            raise ValueError(f"rank {rank} called {kind} on {group}, which it is not a member of")
        with self._cond:
            key = (group, rank)
            n = self._calls.get(key, 0)
            self._calls[key] = n + 1
            call = self._collectives.setdefault((group, n), _Call(kind))
            if call.kind != kind:
                others = ", ".join(map(str, sorted(call.parts)))
                self._error = (f"rank {rank}'s collective #{n} on {group or 'the world'} is {kind}, but rank(s) "
                               f"{others} called {call.kind} there: a group's collectives meet by order alone")
                self._cond.notify_all()
                raise RuntimeError(self._error)
            call.parts[rank] = part
            if len(call.parts) == len(members):
                finish(call.parts)
                call.done = True
                self.collectives += 1
                self._cond.notify_all()
            waiting = _InCollective(call, n, group, members)
            if async_op:
                return _CollectiveWork(self, rank, waiting)
            self._wait_locked(rank, waiting)
        return None

    @staticmethod
    def _peer(peer: int | None, group_peer: int | None) -> int:
        chosen = peer if peer is not None else group_peer
        if chosen is None:
            raise ValueError("a point-to-point call names no peer")
        return int(chosen)

    # ---------------------------------------------------------------- running ranks
    @property
    def rank(self) -> int:
        rank = getattr(self._local, "rank", None)
        if rank is None:
            raise RuntimeError("PointToPointModel's calls are made from the threads that PointToPointModel.run starts")
        return rank

    @contextmanager
    def patched(self) -> Iterator[PointToPointModel]:
        """torch.distributed's point-to-point calls replaced by this model's (for threads of :meth:`run`)."""
        c10d = dist.distributed_c10d
        names = ("isend", "irecv", "send", "recv", "batch_isend_irecv", "new_group", "get_rank", "get_world_size",
                 "get_global_rank", "get_process_group_ranks", "all_reduce", "broadcast", "broadcast_object_list",
                 "all_gather", "barrier")
        calls: dict[str, Any] = {n: getattr(self, n) for n in names}
        calls["P2POp"] = P2POp
        with mock.patch.multiple(dist, **calls), mock.patch.multiple(c10d, **calls):
            yield self

    def run(self, fn: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
        """Run ``fn(rank)`` for every rank, each in a thread of its own, under :meth:`patched`; returns their results.

        The first error of any rank is raised here (a :class:`DeadlockError` if the ranks deadlocked); a rank still
        running after ``timeout`` seconds is an error too.
        """
        results: list[Any] = [None] * self.world_size
        errors: dict[int, BaseException] = {}
        first: list[int | None] = [None]  # the rank whose own error stopped the others

        def main(rank: int) -> None:
            self._local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as err:  # noqa: BLE001  (reported by the calling thread)
                errors[rank] = err
                with self._cond:
                    if self._error is None and not isinstance(err, DeadlockError):
                        self._error = f"rank {rank} raised {type(err).__name__}: {err}"
                        first[0] = rank
                    self._cond.notify_all()
            finally:
                with self._cond:
                    self._finished.add(rank)
                    self._check_deadlock()
                    self._cond.notify_all()

        with self.patched():
            threads = [threading.Thread(target=main, args=(r,), name=f"rank{r}", daemon=True)
                       for r in range(self.world_size)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout)
        alive = [r for r, t in enumerate(threads) if t.is_alive()]
        if alive:
            with self._cond:
                self._error = self._error or f"ranks {alive} still running after {timeout} s"
                self._cond.notify_all()
            raise TimeoutError(f"ranks {alive} still running after {timeout} s; stream heads: {self.heads()}")
        if self._deadlock is not None:  # whatever the ranks made of it (their own words wrap the model's)
            raise DeadlockError(self._deadlock) from next(iter(errors.values()), None)
        if errors:  # the error that came first, with its own traceback (the others only say they stopped for it)
            raise errors[first[0] if first[0] is not None else min(errors)]
        return results

    # ---------------------------------------------------------------- the streams
    def _post(self, ops: list[tuple[bool, int, Tensor]], grouped: bool, group: Any) -> _Work:
        rank = self.rank
        with self._cond:
            for _, peer, _ in ops:
                if not 0 <= peer < self.world_size or peer == rank:
                    raise ValueError(f"rank {rank} named peer {peer} in a world of {self.world_size}")
            entry = _Entry(rank, [_Op(is_send, rank, peer, t) for is_send, peer, t in ops], self._entries[rank],
                           grouped, group)
            self._entries[rank] += 1
            entry.peers = sorted({op.peer for op in entry.ops})
            for peer in entry.peers:
                self._streams.setdefault((group, rank, peer), deque()).append(entry)
            self._progress()
            self._cond.notify_all()
        return _Work(self, entry)

    def _started(self, entry: _Entry) -> bool:
        return all(self._streams[(entry.group, entry.rank, peer)][0] is entry for peer in entry.peers)

    def _progress(self) -> None:
        """Match whatever can be matched now (called with the lock held)."""
        moved = True
        while moved:
            moved = False
            for (group, rank, peer), stream in list(self._streams.items()):
                if not stream or not self._started(stream[0]):
                    continue
                theirs = self._streams.get((group, peer, rank))
                if not theirs or not self._started(theirs[0]):
                    continue
                send = next((op for op in stream[0].ops if op.is_send and op.peer == peer and not op.done), None)
                recv = next((op for op in theirs[0].ops if not op.is_send and op.peer == rank and not op.done), None)
                if send is None or recv is None:
                    continue
                self._match(send, recv)
                moved = True
                for entry in (stream[0], theirs[0]):
                    if entry.done:
                        for p in entry.peers:
                            self._streams[(entry.group, entry.rank, p)].popleft()

    def _match(self, send: _Op, recv: _Op) -> None:
        sent = send.tensor.numel() * send.tensor.element_size()
        room = recv.tensor.numel() * recv.tensor.element_size()
        if sent != room or send.tensor.dtype != recv.tensor.dtype:
            self._error = (f"rank {send.rank}'s send of {sent} B ({send.tensor.dtype}) met rank {recv.rank}'s "
                           f"receive of {room} B ({recv.tensor.dtype}): NCCL matches messages by order alone, "
                           "and these two disagree")
            self._cond.notify_all()
            raise RuntimeError(self._error)
        recv.tensor.copy_(send.tensor.detach())
        send.done = recv.done = True
        self.messages += 1

    def _wait(self, entry: _Entry) -> None:
        with self._cond:
            self._wait_locked(entry.rank, entry)

    def _wait_locked(self, rank: int, what: _Entry | _InCollective) -> None:
        """Block ``rank``'s thread until ``what`` is done (the lock held), or raise on a deadlock or another rank's
        error."""
        self._waiting[rank] = what
        try:
            self._check_deadlock()
            while not what.done:
                if self._deadlock is not None:
                    raise DeadlockError(self._deadlock)
                if self._error is not None:
                    raise RuntimeError(f"rank {rank} stopped waiting: {self._error}")
                if not self._cond.wait(self.watchdog_s):
                    raise DeadlockError(f"no progress in {self.watchdog_s} s waiting on {what}; stream heads: "
                                        f"{self.heads()}")
        finally:
            del self._waiting[rank]

    def _check_deadlock(self) -> None:
        """Every rank still running waits on an entry that cannot progress: nothing will ever change."""
        if self._deadlock is not None or self._error is not None:  # a rank's own error came first: that is the news
            return
        running = [r for r in range(self.world_size) if r not in self._finished]
        if running and all(r in self._waiting and not self._waiting[r].done for r in running):
            waits = "; ".join(f"rank {r} waits on {self._waiting[r]}" for r in running)
            self._deadlock = f"deadlock under NCCL's point-to-point rules: {waits}. Stream heads: {self.heads()}"
            self._cond.notify_all()

    def heads(self) -> str:
        """The entry at the head of each rank's stream with each peer, for the words of a deadlock."""
        parts = [f"rank {rank} with {peer}{'' if group is None else f' on {group}'}: {stream[0]}"
                 for (group, rank, peer), stream in sorted(self._streams.items(), key=lambda kv: str(kv[0])) if stream]
        return "; ".join(parts) if parts else "all empty"


__all__ = ["DeadlockError", "P2POp", "PointToPointModel"]
