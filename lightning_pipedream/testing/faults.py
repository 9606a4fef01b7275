"""Faults planted on purpose in a training run (for the restart tests and ``python -m benchmarks.faults``): a rank
SIGKILLed (no handler of it runs, as the out-of-memory killer does) at a chosen step, in the middle of a
point-to-point transfer or in the middle of a checkpoint save.

Each kill of a run leaves a file in the run's folder (``killed``, ``killed-1``, ...) holding the time of the kill
(``time.time()``) and the last training step that ended before it: a kill happens once a job, whichever attempt
counts, and the kills of a job happen in their order.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

KILLED = "killed"
DURING = ("step", "transfer", "save")


def killed(out: str, index: int = 0) -> str:
    """The file the run's kill number ``index`` leaves (``killed``, ``killed-1``, ...)."""
    return os.path.join(out, KILLED + (f"-{index}" if index else ""))


def _mark(out: str, index: int, step: int) -> None:
    with open(killed(out, index), "w") as f:
        f.write(f"{time.time()} {step}\n")
        f.flush()
        os.fsync(f.fileno())


def die(out: str, index: int = 0, step: int = -1) -> None:
    """SIGKILL this process: no handler, no flush, no goodbye to the peers."""
    _mark(out, index, step)
    os.kill(os.getpid(), signal.SIGKILL)


class Kill:
    """Kills rank ``rank`` at global step ``step``, ``during``:

    - "step": right after training step ``step`` ended (``on_train_batch_end``);
    - "transfer": in the middle of step ``step + 1``, just after it posted a point-to-point send or receive;
    - "save": in the middle of the checkpoint save at step ``step`` (sharded: once its own share is written, the
      directory not yet complete; one file: rank 0 only writes, halfway through, or once the streamed file is whole
      in its temporary, before it is put in place).

    ``index`` orders the kills of a run; ``world``: only in an attempt of that many processes (a job started again
    on another number of them).

    The hooks of a Lightning callback, without Lightning (this package's layers keep it under strategy/): a script
    makes it one with ``class Kill(faults.Kill, L.Callback): pass``."""

    def __init__(self, out: str, rank: int, step: int, during: str = "step", index: int = 0,
                 world: int | None = None) -> None:
        if during not in DURING:
            raise ValueError(f"during={during!r}: one of {DURING}")
        self.out, self.rank, self.step, self.during = out, rank, step, during
        self.index, self.world = index, world

    def _armed(self, trainer: Any) -> bool:
        done = (lambda i: os.path.exists(killed(self.out, i)))
        return (not done(self.index) and (self.index == 0 or done(self.index - 1))
                and trainer.global_rank == self.rank and self.world in (None, trainer.world_size))

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if not self._armed(trainer) or trainer.global_step != self.step:
            return
        if self.during == "step":
            die(self.out, self.index, self.step)
        elif self.during == "transfer":
            arm_transfer_kill(lambda: die(self.out, self.index, self.step))

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.during == "save" and self._armed(trainer):
            arm_save_kill(lambda: trainer.global_step == self.step, self.step,
                          lambda: die(self.out, self.index, self.step))


def arm_transfer_kill(kill: Any) -> None:
    """The next point-to-point operation this process posts is its last: ``kill()`` once it is under way."""
    import torch.distributed as dist

    def posted_then_killed(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            work = original(*args, **kwargs)
            kill()
            return work
        return call

    for name in ("isend", "irecv", "batch_isend_irecv"):
        setattr(dist, name, posted_then_killed(getattr(dist, name)))
        if hasattr(dist.distributed_c10d, name):
            setattr(dist.distributed_c10d, name, posted_then_killed(getattr(dist.distributed_c10d, name)))


def arm_save_kill(now: Any, step: int, kill: Any) -> None:
    """``kill()`` inside the save of global step ``step`` (``now()``: the training is at it): sharded, once this
    rank's own share is on disk (the directory not yet complete); asynchronous, the same in the background thread
    while training goes on; one file, halfway through writing it or once the streamed file is whole in its
    temporary (not yet in place)."""
    from lightning_pipedream.strategy.checkpoints import async_save, sharded_checkpoint, single_file
    from lightning_pipedream.strategy.checkpoints.checkpoint import AtomicCheckpointIO

    write_named = sharded_checkpoint.write_named

    def write_then_die(named: Any, path: str) -> None:
        write_named(named, path)
        if now():
            kill()

    sharded_checkpoint.write_named = write_then_die  # type: ignore[assignment]
    write_file = AtomicCheckpointIO._write

    def half_then_die(self: AtomicCheckpointIO, path: str, data: bytes) -> None:
        if now():
            write_file(self, path, data[: len(data) // 2])
            kill()
        write_file(self, path, data)

    AtomicCheckpointIO._write = half_then_die  # type: ignore[method-assign]
    fsync = single_file._fsync

    def written_then_die(path: str) -> None:
        if now():
            kill()
        fsync(path)

    single_file._fsync = written_then_die  # type: ignore[assignment]
    write_data = async_save._CompletingWriter.write_data

    def written_in_background_then_die(writer: Any, plan: Any, planner: Any) -> Any:
        done = write_data(writer, plan, planner)  # in the background: the step the save holds is in its name
        if f"step={step}.ckpt.tmp-" in os.path.basename(str(writer.path)):
            done.wait()
            kill()
        return done

    async_save._CompletingWriter.write_data = written_in_background_then_die  # type: ignore[method-assign]
