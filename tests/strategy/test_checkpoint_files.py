"""The checkpoint writer's files: a damaged checkpoint is named with what is wrong, a killed writer's leftovers go."""

from __future__ import annotations

import os
import time

import pytest
import torch
from fault_runs import unused_pid

from lightning_pipedream.strategy.checkpoints.checkpoint import STALE_AFTER, AtomicCheckpointIO, CheckpointReadError


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.randn(64, 64)}, "epoch": 3}, path)
    return path


def test_a_checkpoint_cut_short_is_named_with_what_is_wrong(saved, tmp_path):
    cut = tmp_path / "cut.ckpt"
    data = saved.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointReadError) as info:
        AtomicCheckpointIO().load_checkpoint(cut)
    assert str(info.value).startswith(
        f"The checkpoint {cut} cannot be read: it is cut short ({len(data) // 2} bytes, and the archive's directory "
        "that torch.save writes at its end is missing): a copy or a write that did not finish (a full disk, a killed "
        "process). (")
    assert str(info.value).endswith("Resume from another checkpoint (the previous one is kept whole by "
                                    "PipeDreamStrategy's writer), or copy this one again.")
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointReadError, match=r"empty.ckpt cannot be read: it is empty \(0 bytes\): its write never "
                                                  r"began, or the disk was full"):
        AtomicCheckpointIO().load_checkpoint(empty)
    text = tmp_path / "notes.ckpt"
    text.write_text("hello world")
    with pytest.raises(CheckpointReadError, match=r"notes.ckpt cannot be read: it was not written by torch.save \(it "
                                                  r"begins with b'hell', 11 bytes\)"):
        AtomicCheckpointIO().load_checkpoint(text)
    assert AtomicCheckpointIO().load_checkpoint(saved)["epoch"] == 3
    with pytest.raises(FileNotFoundError):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "missing.ckpt")


def test_a_killed_writers_temporary_file_goes_at_the_next_save(saved, tmp_path):
    dead_pid = unused_pid()  # a writer that has ended: its temporary file is a leftover
    old = time.time() - STALE_AFTER - 5
    stale = tmp_path / f"last.ckpt.tmp-{dead_pid}"
    fresh = tmp_path / f"other.ckpt.tmp-{dead_pid}"  # a writer on another machine may still be writing it
    alive = tmp_path / f"last.ckpt.tmp-{os.getppid()}"  # a live process's
    unrelated = tmp_path / "notes.tmp-old"
    for path in (stale, fresh, alive, unrelated):
        path.write_bytes(b"PK partial")
    for path in (stale, alive, unrelated):
        os.utime(path, (old, old))
    AtomicCheckpointIO().save_checkpoint({"epoch": 4}, saved)
    assert not stale.exists() and fresh.exists() and alive.exists() and unrelated.exists()
    assert AtomicCheckpointIO().load_checkpoint(saved)["epoch"] == 4


def test_a_checkpoint_moved_into_place_is_never_missing_and_an_unfinished_newer_save_is_named(tmp_path, caplog):
    import logging
    import time

    from lightning_pipedream.strategy.checkpoints.checkpoint import say_skipped_saves, unfinished_saves
    from lightning_pipedream.strategy.checkpoints.sharded_checkpoint import move_into_place

    last = tmp_path / "last.ckpt"
    last.mkdir()
    (last / "meta.pt").write_text("old")
    new = tmp_path / "last.ckpt.tmp-1"
    new.mkdir()
    (new / "meta.pt").write_text("new")
    move_into_place(str(new), str(last))  # a directory over a directory: swapped, the old one removed
    assert (last / "meta.pt").read_text() == "new" and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert unfinished_saves(str(last)) == []
    time.sleep(0.05)
    unfinished = tmp_path / "epoch=1-step=24.ckpt.tmp-7"  # a save a kill interrupted, after last.ckpt was written
    unfinished.mkdir()
    assert unfinished_saves(str(last)) == [str(unfinished)]
    with caplog.at_level(logging.INFO, logger="lightning_pipedream"):
        say_skipped_saves(str(last))
    assert (f"Resuming from {last}, the newest complete checkpoint; 1 newer save(s) did not finish and are skipped: "
            "epoch=1-step=24.ckpt.tmp-7") in caplog.text


def test_a_single_file_written_stage_by_stage_loads_as_torch_save_wrote_it(tmp_path):
    """The streamed writer's file (one process here: its own stage's tensors, received from itself a group at a time)
    holds what torch.save of the whole dict holds, loaded with weights_only and with mmap; a tensor of another dtype,
    a view into a larger storage, an empty one and the checkpoint's own tensors (loops, schedulers) included."""
    from lightning_pipedream.strategy.checkpoints.single_file import StreamedSave, write_streamed

    flat = torch.randn(300)
    model = {"a.weight": torch.randn(700, 500), "a.bias": torch.randn(500).bfloat16(), "view": flat[100:200],
             "mask": torch.rand(9) > 0.5, "empty": torch.empty(0, 4)}
    optimizer = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(700, 500)}}, "param_groups": [{}]}
    save = StreamedSave(0, 1)
    (model_in,) = save.gather(model)
    (optimizer_in,) = save.gather(optimizer)
    assert all(t.is_meta for t in model_in.values())
    checkpoint = {"state_dict": model_in, "optimizer_states": [optimizer_in], "loops": {"seen": torch.arange(5)},
                  "epoch": 2}
    write_streamed(checkpoint, str(tmp_path / "one.ckpt"), save, torch.device("cpu"))
    for options in ({"weights_only": True}, {"weights_only": True, "mmap": True}, {"weights_only": False}):
        loaded = torch.load(tmp_path / "one.ckpt", **options)
        assert list(loaded["state_dict"]) == list(model) and loaded["epoch"] == 2
        for name, tensor in model.items():
            assert loaded["state_dict"][name].dtype == tensor.dtype and torch.equal(loaded["state_dict"][name], tensor)
        for key, tensor in optimizer["state"][0].items():
            assert torch.equal(loaded["optimizer_states"][0]["state"][0][key], tensor), key
        assert torch.equal(loaded["loops"]["seen"], torch.arange(5))


def test_a_hook_that_computes_from_the_stand_ins_is_refused_in_words(tmp_path):
    from lightning_pipedream.strategy.checkpoints.single_file import StreamedSave, write_streamed

    save = StreamedSave(0, 1)
    (model_in,) = save.gather({"w": torch.randn(4, 4)})
    checkpoint = {"state_dict": {k: v.half() for k, v in model_in.items()}}  # an on_save_checkpoint that casts
    with pytest.raises(ValueError) as info:
        write_streamed(checkpoint, str(tmp_path / "one.ckpt"), save, torch.device("cpu"))
    assert str(info.value) == (
        "The checkpoint holds a tensor on the meta device that is none of the model's or optimizer's own: under "
        "PipeDreamStrategy the single-file save's state_dict and optimizer_states hold stand-ins (meta tensors) that "
        "the save fills in from each stage's process; a hook (on_save_checkpoint) that makes new tensors from them "
        "cannot be written. Change the weights in on_load_checkpoint instead, or save with "
        "PipeDreamStrategy(checkpoint='sharded').")
    assert not (tmp_path / "one.ckpt").exists()
