"""Each rank's mailbox: a small server of its own where peers leave a stop request with a failure's reason and read
what the rank is doing, so that no rank's death (rank 0's, whose store torch uses, included) silences the others."""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

_REGISTRY_KEY = "lightning_pipedream/mailbox/"  # + global rank, in the process group's store: where each mailbox is
_LINE_LIMIT = 1 << 20  # bytes a request or answer may take

ANSWERED, SILENT, GONE = "answered", "silent", "gone"  # what asking a peer's mailbox can give


@dataclass(frozen=True)
class Address:
    """Where a rank's mailbox listens, and which process on which machine the rank is."""

    rank: int
    stage: int | None
    host: str
    port: int
    machine: str
    pid: int
    started: int  # the process's start time (in clock ticks since boot): a reused pid is another process
    token: str  # what a request must carry: only the run's ranks (which read it from the run's store) are heard


def machine_id() -> str:
    """This machine: its host name and boot (two containers may share a host name, not a boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def process_state(pid: int, started: int | None = None) -> str | None:
    """The state letter of a local process (``"T"``: stopped, ``"Z"``: ended, not yet reaped), None if it is gone or
    is another process than the one started at ``started``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if started and int(fields[19]) != started:
        return None
    return fields[0]


def _advertised_host() -> str:
    """The address peers reach this machine at: the interface that leads to MASTER_ADDR (loopback on one machine)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))  # no packet is sent: this only picks the route
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class Mailbox:
    """This process's mailbox: JSON values under names, served on a TCP port by a daemon thread.

    Its own rank writes and reads the values in memory (:meth:`put_here`, :meth:`here`); peers put and get them over
    a connection each (:meth:`put`, :meth:`ask`), with short deadlines: a stopped process's mailbox does not answer
    (its thread is stopped too), a dead one's refuses the connection. The addresses are exchanged once through the
    process group's store (:meth:`open`, :meth:`learn_peers`), while every rank is still there.
    """

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.me: Address | None = None
        self.peers: dict[int, Address] = {}
        self.world = 1
        self._server: socket.socket | None = None
        self._store: Any = None

    # -- this rank ---------------------------------------------------------------------------------------
    def open(self, rank: int, world: int, store: Any, stage: int | None) -> None:
        """Listen, and put this mailbox's address in ``store`` for the peers; once per process group."""
        if self._store is store and self._server is not None:
            return
        self.close()
        self.values = {}
        self.peers = {}
        # An earlier group's store is kept, never destroyed here: in a forked child (run_local, multiprocessing)
        # destroying the parent's store waits for a thread that the child does not have.
        _EARLIER_STORES.append(self._store)
        self.world, self._store = world, store
        host = _advertised_host()
        server = socket.create_server((host, 0))  # on the interface the peers use, not on every one
        self._server = server
        self.me = Address(rank, stage, host, server.getsockname()[1], machine_id(), os.getpid(),
                          process_start_time(os.getpid()), secrets.token_hex(16))
        threading.Thread(target=self._serve, args=(server,), name="lightning_pipedream-mailbox", daemon=True).start()
        try:
            store.set(_REGISTRY_KEY + str(rank), json.dumps(asdict(self.me)))
        except Exception:  # the store is gone already: this rank only reads its own mailbox
            pass

    def close(self) -> None:
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept (close alone does not)
            except OSError:
                pass
            self._server.close()
            self._server = None

    @property
    def is_open(self) -> bool:
        return self._server is not None

    def learn_peers(self) -> bool:
        """Read the addresses of the ranks that registered so far (without waiting); True once all are known."""
        if self.me is None or len(self.peers) >= self.world - 1:
            return True
        missing = [r for r in range(self.world) if r != self.me.rank and r not in self.peers]
        for rank in missing:
            key = _REGISTRY_KEY + str(rank)
            try:
                if self._store.check([key]):
                    self.peers[rank] = Address(**json.loads(self._store.get(key).decode()))
            except Exception:
                return False
        return len(self.peers) >= self.world - 1

    def put_here(self, key: str, value: Any, first: bool = False) -> None:
        with self.lock:
            if not (first and key in self.values):
                self.values[key] = value

    def here(self, key: str) -> Any:
        with self.lock:
            return self.values.get(key)

    def _serve(self, server: socket.socket) -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed
                return
            with conn:
                try:
                    conn.settimeout(2.0)
                    request = json.loads(_read_line(conn))
                    if self.me is None or request.get("token") != self.me.token:
                        continue
                    key = request["key"]
                    if request["op"] == "put":
                        self.put_here(key, request["value"], first=bool(request.get("first")))
                        answer: Any = True
                    else:
                        answer = self.here(key)
                    conn.sendall(json.dumps(answer).encode() + b"\n")
                except (OSError, ValueError, KeyError):
                    continue

    # -- the peers ---------------------------------------------------------------------------------------
    def is_local(self, rank: int) -> bool:
        peer = self.peers.get(rank)
        return peer is not None and self.me is not None and peer.machine == self.me.machine

    def local_state(self, rank: int) -> str | None:
        """A local peer's process state (see :func:`process_state`); None if gone, or not on this machine."""
        peer = self.peers.get(rank)
        if peer is None or not self.is_local(rank):
            return None
        return process_state(peer.pid, peer.started)

    def _request(self, rank: int, request: dict, timeout: float) -> tuple[str, Any]:
        peer = self.peers.get(rank)
        if peer is None:
            return SILENT, None
        try:
            with socket.create_connection((peer.host, peer.port), timeout=timeout) as conn:
                conn.settimeout(timeout)
                conn.sendall(json.dumps({**request, "token": peer.token}).encode() + b"\n")
                return ANSWERED, json.loads(_read_line(conn))
        except ConnectionRefusedError:
            return GONE, None
        except (OSError, ValueError):
            return SILENT, None

    def ask(self, rank: int, key: str, timeout: float = 1.0) -> tuple[str, Any]:
        """``(ANSWERED, value)``, ``(SILENT, None)`` (no answer in time: stopped, frozen or unreachable) or
        ``(GONE, None)`` (nothing listens: the process ended)."""
        return self._request(rank, {"op": "get", "key": key}, timeout)

    def put(self, rank: int, key: str, value: Any, timeout: float = 1.0, first: bool = False) -> str:
        """Leave ``value`` in rank ``rank``'s mailbox; ``first``: unless one is there already. Returns the status."""
        return self._request(rank, {"op": "put", "key": key, "value": value, "first": first}, timeout)[0]

    def put_everywhere(self, key: str, value: Any, timeout: float = 1.0, first: bool = False) -> dict[int, str]:
        """:meth:`put` to every peer at once; returns each peer's status (SILENT for those that did not answer in
        time)."""
        statuses: dict[int, str] = {}

        def one(rank: int) -> None:
            statuses[rank] = self.put(rank, key, value, timeout, first)

        threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in list(self.peers)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout + 0.5
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return {r: statuses.get(r, SILENT) for r in self.peers}


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
        if len(data) > _LINE_LIMIT:
            raise ValueError("message too long")
    return data


def process_start_time(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since boot (0 if unknown): with the pid, it names one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


_MAILBOX = Mailbox()
_EARLIER_STORES: list[Any] = []


def _after_fork_in_child() -> None:
    # A forked child (a data loader's worker, run_local's ranks) has no mailbox of its own: the parent's socket is
    # left alone (shutting it down here would stop the parent's), and a lock a parent's thread held stays free.
    _EARLIER_STORES.append(_MAILBOX._store)
    _MAILBOX._server, _MAILBOX._store = None, None
    _MAILBOX.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def mailbox() -> Mailbox:
    """This process's mailbox."""
    return _MAILBOX
