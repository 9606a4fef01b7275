"""Saving without stalling (``PipeDreamStrategy(checkpoint="sharded-async")``), in this process with torch's real
writer: the caller waits only for the copy, one save is in flight at a time, the directory is in place only once
whole, a checkpoint to remove goes only after the save in flight is complete, and a failed save says which it was.

The multi-process cases (an asynchronous save resumes as the synchronous one does; a kill during one resumes from
the checkpoint before) run in the launches of test_sharded_checkpoint.py and test_restarts.py.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_pipedream.strategy.checkpoints import async_save
from lightning_pipedream.strategy.checkpoints.checkpoint import CheckpointGather
from lightning_pipedream.strategy.checkpoints.sharded_checkpoint import (
    PipelineCheckpoints,
    consolidate,
    is_sharded_checkpoint,
)

# Alone, torch's writer (in its thread, out of the save's reach) says it assumes a single process: so it is.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# torch before 2.9 has no DefaultStager: the asynchronous form is refused there, in words (the last test).
HAS_STAGER = hasattr(importlib.import_module("torch.distributed.checkpoint.staging"), "DefaultStager")
needs_stager = pytest.mark.skipif(not HAS_STAGER, reason="this torch has no DefaultStager: checkpoint='sharded-async' "
                                                         "is refused (see the last test)")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def save(checkpoints: PipelineCheckpoints, module: nn.Module, path: Path, step: int) -> None:
    """What the strategy's save does on one process (no process group), during a fit."""
    pipeline = SimpleNamespace(module=module, checkpoint=CheckpointGather(0, 1, list(module.state_dict())),
                               optimizer_layouts=[], shard=None)
    checkpoint = {"state_dict": module.state_dict(), "global_step": step}
    checkpoints.save(checkpoint, str(path), pipeline, True, lambda x: x, None)


class HeldWrites:
    """torch's writer, each rank's data write held until the test lets it go; says which directories it began."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.began: list[str] = []
        self.go, self.writing = threading.Event(), threading.Event()
        write_data = async_save._CompletingWriter.write_data

        def held(writer, plan, planner):  # type: ignore[no-untyped-def]
            self.began.append(os.path.basename(str(writer.path)))
            self.writing.set()
            assert self.go.wait(60), "the test never let the write go"
            return write_data(writer, plan, planner)

        monkeypatch.setattr(async_save._CompletingWriter, "write_data", held)

    def first_began(self) -> list[str]:
        assert self.writing.wait(60), "no write began"
        return self.began


@pytest.fixture
def background() -> PipelineCheckpoints:
    checkpoints = PipelineCheckpoints("sharded-async")
    checkpoints.open_background(fitting=True)
    yield checkpoints
    checkpoints.end_background(failed=True)


@needs_stager
def test_the_caller_waits_for_the_copy_alone_and_the_checkpoint_is_in_place_only_when_whole(background, tmp_path,
                                                                                           monkeypatch):
    writes = HeldWrites(monkeypatch)
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    save(background, net, tmp_path / "a.ckpt", step=8)  # returns while its write is held
    assert writes.first_began() == [f"a.ckpt.tmp-{os.getpid()}"] and not (tmp_path / "a.ckpt").exists()
    with torch.no_grad():  # training goes on: the save holds the weights as they were when it began
        for p in net.parameters():
            p.add_(1.0)
    writes.go.set()
    background.end_background()  # the end of the fit waits for it
    assert is_sharded_checkpoint(tmp_path / "a.ckpt") and not (tmp_path / f"a.ckpt.tmp-{os.getpid()}").exists()
    saved = consolidate(str(tmp_path / "a.ckpt"))
    assert saved["global_step"] == 8
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in before.items())
    # The fit is over: a save now is written before it returns.
    save(background, net, tmp_path / "b.ckpt", step=9)
    assert background.background.in_flight is None and is_sharded_checkpoint(tmp_path / "b.ckpt")


@needs_stager
def test_one_save_in_flight_a_new_one_waits_for_it_and_reuses_its_memory(background, tmp_path, monkeypatch):
    writes = HeldWrites(monkeypatch)
    net = Net()
    save(background, net, tmp_path / "a.ckpt", step=8)
    stager = background.background.stager
    second = threading.Thread(target=save, args=(background, net, tmp_path / "b.ckpt", 16))
    second.start()
    second.join(1.0)
    assert second.is_alive() and writes.first_began() == [f"a.ckpt.tmp-{os.getpid()}"]  # b waits for a, not yet begun
    writes.go.set()
    second.join(60)
    assert not second.is_alive() and is_sharded_checkpoint(tmp_path / "a.ckpt")  # whole before b began
    assert background.background.stager is stager  # the same staging memory (torch's stager keeps its buffers)
    background.end_background()
    assert writes.began == [f"a.ckpt.tmp-{os.getpid()}", f"b.ckpt.tmp-{os.getpid()}"]
    assert consolidate(str(tmp_path / "b.ckpt"))["global_step"] == 16


@needs_stager
def test_a_checkpoint_to_remove_goes_only_once_the_save_in_flight_is_complete(background, tmp_path, monkeypatch):
    writes = HeldWrites(monkeypatch)
    old = tmp_path / "old.ckpt"
    old.write_bytes(b"the previous checkpoint")
    save(background, Net(), tmp_path / "new.ckpt", step=16)
    background.remove(str(old), lambda: os.remove(old))  # ModelCheckpoint's save_top_k: the older one goes
    assert old.exists()  # the newest complete checkpoint until new.ckpt is whole
    writes.go.set()
    background.end_background()
    assert not old.exists() and is_sharded_checkpoint(tmp_path / "new.ckpt")
    gone = tmp_path / "gone.ckpt"
    gone.write_bytes(b"")
    background.remove(str(gone), lambda: os.remove(gone))  # nothing in flight: at once
    assert not gone.exists()


@needs_stager
@pytest.mark.parametrize("failed_before_the_removal", [False, True])
def test_a_failed_background_save_names_itself_and_keeps_the_checkpoint_before(background, tmp_path, monkeypatch,
                                                                               failed_before_the_removal):
    save(background, Net(), tmp_path / "last.ckpt", step=8)
    background.background.wait()
    first = consolidate(str(tmp_path / "last.ckpt"))

    def full(writer, plan, planner):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(async_save._CompletingWriter, "write_data", full)
    old = tmp_path / "epoch=0-step=8.ckpt"
    old.write_bytes(b"")
    save(background, Net(), tmp_path / "last.ckpt", step=16)  # returns: the failure comes in the background
    if failed_before_the_removal:  # ModelCheckpoint's removal of the older one comes after the failure
        concurrent.futures.wait([background.background.in_flight.future])
    background.remove(str(old), lambda: os.remove(old))  # either way, said at the next save, not here
    with pytest.raises(RuntimeError) as raised:
        save(background, Net(), tmp_path / "other.ckpt", step=24)  # the next save waits for it, and says it failed
    message = " ".join(str(raised.value).split())
    assert message.startswith(
        f"The asynchronous save of the checkpoint {tmp_path / 'last.ckpt'} (step 16, "
        "PipeDreamStrategy(checkpoint='sharded-async')) failed: "), message
    assert "No space left on device" in message
    assert "The checkpoint before it is kept as the newest complete one." in message
    assert old.exists()  # not removed: the save that was to replace it failed
    kept = consolidate(str(tmp_path / "last.ckpt"))
    assert kept["global_step"] == 8
    assert all(torch.equal(kept["state_dict"][k], v) for k, v in first["state_dict"].items())
    assert not (tmp_path / "other.ckpt").exists()


@needs_stager
def test_the_checkpoint_forms_name_the_asynchronous_one():
    with pytest.raises(ValueError, match=r"'sharded-async' \(the same, written in the background while training"):
        PipelineCheckpoints("async")
    assert PipelineCheckpoints("sharded-async").sharded


def test_a_torch_without_dcp_s_stager_refuses_the_asynchronous_form_in_words(monkeypatch):
    import torch.distributed.checkpoint.staging as staging

    if HAS_STAGER:  # as torch before 2.9 is (the oldest the package accepts is 2.8)
        monkeypatch.delattr(staging, "DefaultStager")
    with pytest.raises(ValueError, match=r"checkpoint='sharded-async' needs torch.distributed.checkpoint's "
                                         r"DefaultStager, which torch .* lacks: install the torch that "
                                         r"lightning_pipedream pins, or use checkpoint='sharded'"):
        PipelineCheckpoints("sharded-async")
    assert PipelineCheckpoints("sharded").sharded
