"""A warm start for the tests' training scripts: one process per pytest worker imports torch, Lightning and the
package once, then forks a child for every script run, and Lightning's launcher in that child starts the other ranks
through it too.

Why: a process that imports torch and Lightning spends about 5 s of CPU doing so, and a tiny training run about
1 s; the suite starts hundreds of such processes on two cores. A forked child of a process that has imported
everything but has run no torch operation starts in milliseconds and behaves as a fresh ``python script.py``: its
``sys.argv``, ``sys.path[0]``, environment, working directory and standard streams are the script's, and it exits
through the atexit handlers (the garbage collector's last passes skipped, as ``script_runs`` does for every script).

What still runs as in a user's run: the script, Lightning's launcher (it decides which ranks to start and with which
environment; only its ``subprocess.Popen`` is replaced by a fork of this process), torchrun's agent (``python -m
torch.distributed.run``: its rendezvous, restarts and monitoring; only the ``Popen`` of its worker processes is
replaced the same way, so a restart starts warm too), the rendezvous, every rank's process, exit codes and signals. ``LIGHTNING_PIPEDREAM_TEST_COLD=1`` starts every script as a process of its own
instead (the old way; for comparison and to rule the zygote out).

Protocol (a Unix socket, one JSON line per request, file descriptors passed with SCM_RIGHTS):
``{"op": "start", "argv", "env", "cwd", "group"}`` with the child's stdin, stdout and stderr -> ``{"pid"}``;
``{"op": "poll", "pid"}`` -> ``{"code"}`` (None while it runs; -N for a signal); ``{"op": "live", "group"}`` ->
``{"pids"}`` of the children started under ``group`` that have not ended; ``{"op": "kill", "group"}`` kills them.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

SOCKET_ENV = "LIGHTNING_PIPEDREAM_TEST_ZYGOTE"  # the zygote's socket, in the environment of the children
GROUP_ENV = "LIGHTNING_PIPEDREAM_TEST_ZYGOTE_GROUP"  # the run a child belongs to (its siblings join it)
COLD_ENV = "LIGHTNING_PIPEDREAM_TEST_COLD"
ROOT = Path(__file__).resolve().parents[2]
PRELOAD = ["torch", "torch.distributed", "lightning", "lightning.pytorch", "torchvision", "lightning_pipedream",
           "lightning_pipedream.strategy.pipedream", "hydra", "omegaconf",
           # the tests' tiny Hugging Face models: their modeling code takes seconds to import, in every rank
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2"]


# -- the client (a pytest worker, or a child whose Lightning launcher starts its siblings) ------------------------
def _request(path: str, message: dict, fds: list[int] | None = None) -> Any:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(120)
        conn.connect(path)
        data = json.dumps(message).encode() + b"\n"
        socket.send_fds(conn, [data], fds) if fds else conn.sendall(data)
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                raise ConnectionError("the test zygote closed the connection")
            answer += chunk
    return json.loads(answer)


class ZygoteProcess:
    """A child of the zygote, as much of ``subprocess.Popen`` as the tests and Lightning's launcher use."""

    def __init__(self, path: str, argv: list[str], env: dict[str, str], cwd: str | None, group: str,
                 stdio: tuple[int, int, int]) -> None:
        self.path, self.args, self.group = path, argv, group
        self.pid: int = _request(path, {"op": "start", "argv": argv, "env": env, "cwd": cwd, "group": group},
                                 list(stdio))["pid"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _request(self.path, {"op": "poll", "pid": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill_group(self) -> None:
        """Kill this run's every process: this one and the ranks its launcher started."""
        _request(self.path, {"op": "kill", "group": self.group})

    def live(self) -> list[int]:
        """This run's processes that have not ended: this one and the ranks its launcher started."""
        return list(_request(self.path, {"op": "live", "group": self.group})["pids"])


_ZYGOTE: list[Any] = []  # this worker's zygote: [Popen, socket path]


def zygote_path() -> str | None:
    """This pytest worker's zygote's socket, started on first use; None when scripts are to start cold."""
    if os.environ.get(COLD_ENV):
        return None
    if _ZYGOTE and _ZYGOTE[0].poll() is None:
        return _ZYGOTE[1]
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"lp_zygote_{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    path = str(folder / "socket")
    if os.path.exists(path):
        os.unlink(path)
    ready = folder / "ready"
    ready.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]).rstrip(
               os.pathsep)}
    proc = subprocess.Popen([sys.executable, __file__, path, str(ready)], cwd=ROOT, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the test zygote did not start (exit code {proc.poll()})")
        time.sleep(0.05)
    _ZYGOTE[:] = [proc, path]
    atexit.register(proc.kill)
    return path


def start(argv: list[str], cwd: str | Path | None, env: dict[str, str], stdio: tuple[int, int, int],
          group: str | None = None) -> ZygoteProcess | None:
    """``argv`` (``[python, script, ...]`` or ``[python, "-m", module, ...]``) as a child of the zygote, or None
    when it cannot be (no zygote, or another program)."""
    path = env.get(SOCKET_ENV) or zygote_path()
    if path is None or len(argv) < 2 or argv[0] != sys.executable:
        return None
    group = group or f"{os.getpid()}-{time.monotonic_ns()}"
    env = {**env, SOCKET_ENV: path, GROUP_ENV: group}
    return ZygoteProcess(path, [str(a) for a in argv], env, None if cwd is None else str(cwd), group, stdio)


class _LauncherSubprocess:
    """What Lightning's launcher sees as the ``subprocess`` module in a zygote's child: its Popen forks the zygote,
    with the launching rank's own standard streams (as a real Popen's child inherits them)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(command: list[str], env: dict[str, str] | None = None, cwd: str | None = None, **kwargs: Any) -> Any:
        env = dict(os.environ if env is None else env)
        child = start(list(command), cwd, env, (0, 1, 2), group=env.get(GROUP_ENV))
        return child if child is not None else subprocess.Popen(command, env=env, cwd=cwd, **kwargs)


def _torchrun_popen(args: Any, env: dict[str, str] | None = None, stdout: Any = None, stderr: Any = None,
                    **kwargs: Any) -> Any:
    """What torchrun's agent (in a zygote's child) calls as ``Popen`` for each worker: a fork of the zygote with the
    worker's command, environment, working directory and streams (its redirect files, or the agent's own)."""
    command = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    stdio = (0, stdout.fileno() if stdout is not None else 1, stderr.fileno() if stderr is not None else 2)
    child = start(command, os.getcwd(), env, stdio, group=env.get(GROUP_ENV))
    return child if child is not None else subprocess.Popen(args=args, env=env, stdout=stdout, stderr=stderr, **kwargs)


# -- the zygote ---------------------------------------------------------------------------------------------------
def _unbuffered() -> None:
    """``python -u``: standard output and error written through at once (torchrun starts its workers so)."""
    import io

    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True)


def _run_child(message: dict, fds: list[int]) -> None:
    """In the forked child: become ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) and exit with its code."""
    code = 0
    try:
        os.setsid()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(message["env"])
        if message["cwd"]:
            os.chdir(message["cwd"])
        argv = message["argv"][1:]
        # Lightning's launcher (the only user of subprocess in its module) starts the other ranks through us.
        import lightning.fabric.strategies.launchers.subprocess_script as fabric_launcher
        import lightning.pytorch.strategies.launchers.subprocess_script as launcher

        launcher.subprocess = fabric_launcher.subprocess = _LauncherSubprocess()  # type: ignore[assignment]
        if argv[:2] == ["-m", "torch.distributed.run"]:  # torchrun's agent: its workers start through us too
            from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

            subprocess_handler.Popen = _torchrun_popen  # type: ignore[assignment,misc]
        if argv[0] == "-u":
            argv = argv[1:]
            _unbuffered()
        atexit.register(gc.freeze)
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
        if not isinstance(end.code, int) and end.code is not None:
            print(end.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _answer(message: dict, fds: list[int], server: socket.socket, conn: socket.socket, children: dict[int, str],
            codes: dict[int, int]) -> dict:
    """One request's answer; a ``start`` forks the child (which never returns from here)."""
    if message["op"] == "start":
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            server.close()
            conn.close()
            _run_child(message, fds)
        for fd in fds:
            os.close(fd)
        children[pid] = message["group"]
        return {"pid": pid}
    if message["op"] == "poll":
        pid = message["pid"]
        if pid not in codes and pid not in children:
            return {"code": -signal.SIGKILL}  # not ours, or reaped long ago: treat as ended
        return {"code": codes.get(pid)}
    if message["op"] == "live":
        return {"pids": [pid for pid, group in children.items() if group == message["group"]]}
    for pid, group in list(children.items()):  # "kill"
        if group == message["group"]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return {}


def _warm_up_capture() -> None:
    """One tiny graph capture here, so that every child starts past torch.export's first-call costs (its modules'
    imports and one-time setup: about 1 s of CPU per process measured, against 1.3 to 2.5 s for a tiny Hugging Face
    model's whole capture), which every rank of a graph-path run pays otherwise. Only forward tracing runs here, never
    a backward: a process that ran both is one whose forks autograd refuses (see tests/graph/test_split.py)."""
    try:
        import torch
        from torch import nn

        from lightning_pipedream.graph import capture

        capture(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), (torch.randn(2, 4),), cache=False)
    except Exception:  # an environment without torch.export's needs: the children pay as before
        pass


def serve(path: str, ready: str) -> None:
    """Import everything the scripts import, then fork a child per ``start`` request until the parent is gone."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # not installed (the oldest environment has no transformers): the child imports what it needs
            pass
    _warm_up_capture()
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    Path(ready).touch()
    children: dict[int, str] = {}  # live child -> group
    codes: dict[int, int] = {}
    while os.getppid() == parent:
        while True:  # reap
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            codes[pid] = os.waitstatus_to_exitcode(status)
            children.pop(pid, None)
        if not select.select([server], [], [], 0.1)[0]:
            continue
        conn, _ = server.accept()
        with conn:
            fds: list[int] = []
            try:
                data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 8)
                while not data.endswith(b"\n"):
                    more = conn.recv(1 << 20)
                    if not more:
                        break
                    data += more
                message = json.loads(data)
                answer = _answer(message, fds, server, conn, children, codes)
                fds = []
                conn.sendall(json.dumps(answer).encode() + b"\n")
            except (OSError, ValueError, KeyError, TypeError):
                # A client that went away mid-request (a rank its test killed while it polled a sibling): nothing
                # to answer, and no reason for the other runs to lose their zygote.
                for fd in fds:
                    os.close(fd)
    for pid in children:  # the pytest worker is gone: so are its runs
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    try:
        serve(sys.argv[1], sys.argv[2])
    except BaseException:
        traceback.print_exc()
        raise
