"""Sharded checkpoints written in the background (``PipeDreamStrategy(checkpoint="sharded-async")``).

The pipeline waits only for a copy of its stage's tensors into memory kept for the next save (torch's
``DefaultStager``, which reuses its buffers while the tensors it copies live; pinned where CUDA is), then trains on
while a thread writes that copy with torch.distributed.checkpoint's ``async_save``. The writes' collectives run on a
gloo process group of their own, made once by every rank at its first save, so they never interleave with the
pipeline's (docs/strategy.md, "Collectives": a group of its own). At most one save is in flight: a new
save, and the end of the fit, wait for the one before. Completeness is the synchronous save's: rank 0 (torch's
coordinator) writes ``meta.pt`` once every rank's data and torch's ``.metadata`` are in the temporary directory, then
swaps it into place (:func:`~.sharded_checkpoint.move_into_place`); a checkpoint the strategy was told to remove
meanwhile (``ModelCheckpoint``'s older ones) goes only after the save that replaces it is complete. A save that
fails raises, at the next save or at the end of the fit, an error naming it; a rank lost during a save fails the
others' writes (the pipeline's own failure reporting names it first) and the previous checkpoint stays the newest
complete one.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from lightning_pipedream.runtime.faults.failures import pipeline_failures
from lightning_pipedream.runtime.faults.timeouts import group_timeout

ASYNC_MODE = "sharded-async"


def check_async_saves() -> None:
    """Refuse, with the way out, a torch whose torch.distributed.checkpoint has no ``DefaultStager`` (before 2.9)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager  # noqa: F401
    except ImportError:
        raise ValueError(f"checkpoint={ASYNC_MODE!r} needs torch.distributed.checkpoint's DefaultStager, which torch "
                         f"{torch.__version__} lacks: install the torch that lightning_pipedream pins, or use "
                         "checkpoint='sharded' (the same files, saved in the foreground).") from None


def _reused_staging() -> Any:
    """torch's stager, copying in the caller's thread into the buffers of the save before (its storage cache);
    async_save does not wait for it again (and does not call its deprecated ``synchronize_staging``). Made on first
    use: torch before 2.9 has no ``DefaultStager`` (:func:`check_async_saves` refuses the mode there)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    class ReusedStaging(DefaultStager):
        _synchronize_after_execute = False

    cuda = torch.cuda.is_available()
    return ReusedStaging(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=cuda))


class _CompletingWriter(FileSystemWriter):
    """torch's file writer whose coordinator, once every rank's data and the ``.metadata`` are written, runs
    ``complete`` (``meta.pt``, then the swap into place)."""

    def __init__(self, path: str, complete: Callable[[], None]) -> None:
        super().__init__(path)
        self.complete = complete

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        self.complete()


@dataclass
class _Save:
    """The save in flight: where it goes, the step it holds, and the future of its writing."""

    path: str
    step: int
    future: Future
    removals: list[Callable[[], None]] = field(default_factory=list)  # put off until the save is complete


class BackgroundSaves:
    """The asynchronous saves of one strategy: its process group, its staging memory, the save in flight."""

    def __init__(self) -> None:
        self.group: Any = None
        self.stager: Any = None
        self.in_flight: _Save | None = None
        self.open = False  # saves go to the background only during a fit (the strategy opens and closes it)
        self._lock = threading.Lock()

    def start(self, named: dict[str, Any], temporary: str, path: str, step: int,
              complete: Callable[[], None] | None) -> None:
        """Every rank: wait for the save before (one in flight), copy ``named`` into the staging memory (the only
        wait), and write it into ``temporary`` in the background; rank 0 (``complete`` given) then, once every rank's
        data and torch's metadata are written, runs ``complete`` (``meta.pt``, and ``temporary`` put in place at
        ``path``)."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        if self.stager is None:
            self.stager = _reused_staging()
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and self.group is None:  # every rank at its first save: a collective, at the same point
            self.group = dist.new_group(backend="gloo", timeout=group_timeout())  # the world's, not 30 min

        with warnings.catch_warnings():  # alone, torch says it assumes a single process: so it is
            warnings.filterwarnings("ignore", message=".*assuming the intent")
            future = dcp.async_save(named, storage_writer=_CompletingWriter(temporary, complete or _nothing),
                                    process_group=self.group, async_stager=self.stager, no_dist=not distributed)
        assert isinstance(future, Future)  # a stager that copies at once: the writing's future alone
        self.in_flight = _Save(path, step, future)

    def remove_after(self, remove: Callable[[], None]) -> None:
        """Remove a checkpoint now, or, while a save is in flight, once it is complete (the newest complete
        checkpoint is never removed before the one that replaces it is whole); not at all if that save fails.
        A save that has failed already keeps the removal too: its error comes at the next save or at the fit's end
        (:meth:`wait`), whether it failed before this call or after."""
        with self._lock:
            save = self.in_flight
            if save is not None and (not save.future.done() or save.future.exception() is not None):
                save.removals.append(remove)
                return
        self._settle()
        remove()

    def wait(self, raise_errors: bool = True) -> None:
        """Wait for the save in flight; a failure raises (``raise_errors``) an error naming the save."""
        save = self.in_flight
        if save is None:
            return
        error = None
        try:  # distributed: a peer lost meanwhile is named, and a failure here stops every peer with its reason
            with pipeline_failures(None, waiting=f"the asynchronous save of {save.path}") if (
                    raise_errors and self.group is not None) else nullcontext():
                save.future.result()
        except BaseException as err:  # noqa: BLE001  (raised again below, in words that name the save)
            error = err
        self.in_flight = None
        if error is None:
            for remove in save.removals:
                remove()
            return
        if raise_errors:
            raise RuntimeError(
                f"The asynchronous save of the checkpoint {save.path} (step {save.step}, "
                f"PipeDreamStrategy(checkpoint={ASYNC_MODE!r})) failed: {type(error).__name__}: {error}. The "
                "checkpoint before it is kept as the newest complete one. If a rank was lost, resume from that "
                "checkpoint; if the disk is full or not writable, free space or save elsewhere (ModelCheckpoint's "
                "dirpath); checkpoint='sharded' saves in the foreground and fails at the save itself."
            ) from error

    def _settle(self) -> None:
        """A finished save's put-off removals (and its failure, raised)."""
        if self.in_flight is not None and self.in_flight.future.done():
            self.wait()

    def close(self, raise_errors: bool = True) -> None:
        """The fit's end: wait for the last save; saves from here on are written before they return, and the staging
        memory goes back (a next fit makes it again)."""
        self.open = False
        try:
            self.wait(raise_errors)
        finally:
            if self.stager is not None and self.in_flight is None:
                self.stager.close()
                self.stager = None


def _nothing() -> None:
    pass


def write_bytes(data: bytes, path: str) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
