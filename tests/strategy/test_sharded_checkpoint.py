"""Sharded checkpoints (PipeDreamStrategy(checkpoint="sharded")): each rank writes its own stage by name; the
directory resumes on other layouts (4 stages -> 2 stages, 2 x 2 replicas, 2 x 2 shards) with the losses of an
uninterrupted run, consolidates into one file that one device resumes, and exports to Hugging Face's layout. Under
shard= (each stage's replicas sharded), each replica writes and reads its own shards, never the stage whole: a 2 x 2
sharded Adam run saved mid-training resumes sharded, whole (shard=None) and on 4 stages with its uninterrupted losses
and weights, and a meter of live tensor bytes shows what a save and a read add on each rank.

The multi-process trainings run in two launches of tiny.py (4 processes, then 2); the one-device resume runs here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_pipedream.strategy.checkpoints import sharded_checkpoint
from lightning_pipedream.strategy.checkpoints.checkpoint import CheckpointGather
from lightning_pipedream.strategy.checkpoints.checkpoint_commands import export_hf
from lightning_pipedream.strategy.checkpoints.checkpoint_commands import main as checkpoint_main
from lightning_pipedream.strategy.checkpoints.sharded_checkpoint import (
    SHARDED_FROM,
    PipelineCheckpoints,
    consolidate,
    is_sharded_checkpoint,
)

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from fault_runs import kill_at_marker  # noqa: E402
from script_runs import run_script, script_env  # noqa: E402

RESUME = {"batch_size": 60, "max_steps": 4, "checkpoint_every_epoch": True, "model": {"hidden": 2}}  # 1 batch/epoch
SHARDED = {"schedule": "1f1b", "chunks": 2, "checkpoint": "sharded"}
DATA_PARALLEL = {"batch_size": 30, "trainer": {"use_distributed_sampler": True}}  # 2 pipelines x 30 = the batch
FROM_4 = "{runs}/sharded-4/epoch=1-step=2.ckpt"
FROM_SHARDS = "{runs}/shard-2x2/epoch=1-step=2.ckpt"
ADAM = {"hidden": 2, "width": 15, "optimizer": "adam", "lr": 0.01}  # 15 rows: shards of 8 and 7
SHARD_2X2 = {**RESUME, **DATA_PARALLEL, "devices": 4, "model": ADAM,
             "strategy": {**SHARDED, "stages": 2, "balance": [4, 3], "shard": "full"}}
RUNS: dict[str, dict] = {
    # 4 stages, uninterrupted: its checkpoint after step 2 is what the others resume.
    "sharded-4": {**RESUME, "devices": 4, "strategy": {**SHARDED, "balance": [2, 2, 2, 1]}},
    "resumed-2x2": {**RESUME, **DATA_PARALLEL, "devices": 4, "resume": FROM_4,
                    "strategy": {**SHARDED, "stages": 2, "balance": [4, 3]}},
    "resumed-shard-2x2": {**RESUME, **DATA_PARALLEL, "devices": 4, "resume": FROM_4,
                          "strategy": {**SHARDED, "stages": 2, "balance": [4, 3], "shard": "full"}},
    # 25 MB of weights on 4 stages (the largest a third of them): what a save adds to each rank's resident peak.
    "memory": {"devices": 4, "max_steps": 1, "batch_size": 12, "measure_saves": True, "model": {"width": 1024,
               "hidden": 6}, "strategy": {**SHARDED, "balance": [4, 4, 4, 3], "keep_freed_memory": False}},
    # 2 stages x 2 replicas sharded (FSDP2), Adam: each replica saves its own shards; what resumes it (same layout,
    # whole replicas, 4 stages) must equal it, and a save or read must add nothing of the stage's size to a rank.
    "shard-2x2": SHARD_2X2,
    "shard-resumed-2x2": {**SHARD_2X2, "resume": FROM_SHARDS},
    "whole-resumed-2x2": {**SHARD_2X2, "resume": FROM_SHARDS, "strategy": {**SHARDED, "stages": 2, "balance": [4, 3]}},
    "shard-resumed-4": {**RESUME, "devices": 4, "model": ADAM, "resume": FROM_SHARDS,
                        "strategy": {**SHARDED, "balance": [2, 2, 2, 1]}},
    # 6 MB of weights and Adam state per stage (4 Linear(512, 512)), grad_op shards: the live tensor bytes of saves.
    "live-2x2": {"devices": 4, "max_steps": 1, "batch_size": 12, "measure_live": True,
                 "model": {"width": 512, "hidden": 4, "optimizer": "adam"},
                 "strategy": {**SHARDED, "stages": 2, "balance": [6, 5], "shard": "grad_op"}},
    "resumed-2": {**RESUME, "devices": 2, "resume": FROM_4, "strategy": {**SHARDED, "balance": [4, 3]}},
    # sharded-4 again, each epoch's save written in the background; resumed on 2 stages as resumed-2 resumes sharded-4
    "async-4": {**RESUME, "devices": 4, "strategy": {**SHARDED, "checkpoint": "sharded-async", "balance": [2, 2, 2, 1]}},
    "async-resumed-2": {**RESUME, "devices": 2, "resume": "{runs}/async-4/epoch=1-step=2.ckpt",
                        "strategy": {**SHARDED, "balance": [4, 3]}},
    # Asynchronous schedules (weight stashing, 2BW's two versions) drain before saving: sharded holds what full does.
    "pipedream-2": {"devices": 2, "max_steps": 3, "also_full": True, "strategy": {"schedule": "pipedream",
                    "checkpoint": "sharded"}},
    "2bw-2": {"devices": 2, "max_steps": 3, "also_full": True, "model": {"scheduler": False},
              "strategy": {"schedule": "2bw", "chunks": 2, "checkpoint": "sharded"}},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("sharded")
    for devices in (4, 2):  # the 2-process run resumes the 4-process one's checkpoint
        group = [[str(base / name), json.loads(json.dumps(options).replace("{runs}", str(base)))]
                 for name, options in RUNS.items() if options["devices"] == devices]

        (base / f"runs{devices}.json").write_text(json.dumps(group))
        run_script(SCRIPTS / "tiny.py", base, {"--runs": str(base / f"runs{devices}.json")}, 400)
    return {name: base / name for name in RUNS}


def losses(out: Path) -> list[float]:
    return json.loads((out / "rank0.json").read_text())["losses"]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return consolidate(str(out / "final.ckpt"))["state_dict"]


@pytest.mark.multiprocess
def test_each_rank_writes_its_own_stage_by_name(runs):
    from torch.distributed.checkpoint import FileSystemReader

    directory = runs["sharded-4"] / "epoch=1-step=2.ckpt"
    assert is_sharded_checkpoint(directory)
    storage = FileSystemReader(str(directory)).read_metadata().storage_data
    writer = {index.fqn: info.relative_path.split("_")[2] for index, info in storage.items()}
    # balance [2, 2, 2, 1]: Linear layers 0, 2, 4 on ranks 0, 1, 2 and 6 on rank 3, each with its momentum
    for layer, rank in ((0, "0"), (2, "1"), (4, "2"), (6, "3")):
        assert writer[f"model/layers.{layer}.weight"] == rank
        assert writer[f"optimizer0/layers.{layer}.weight/momentum_buffer"] == rank


@pytest.mark.multiprocess
@pytest.mark.parametrize("resumed", ["resumed-2", "resumed-2x2", "resumed-shard-2x2"])
def test_a_4_stage_checkpoint_resumes_on_other_layouts(runs, resumed):
    uninterrupted = runs["sharded-4"]
    if resumed == "resumed-2":  # one pipeline: the same logged losses as the run that was not stopped
        assert losses(runs[resumed]) == pytest.approx(losses(uninterrupted)[2:], rel=1e-5)
    want, got = final_weights(uninterrupted), final_weights(runs[resumed])
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def assert_same_checkpoint(got: dict, want: dict) -> None:
    """Weights, optimizer state and global step ``torch.equal``."""
    assert got["global_step"] == want["global_step"] and list(got["state_dict"]) == list(want["state_dict"])
    for name, tensor in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], tensor), name
    (mine,), (theirs,) = got["optimizer_states"], want["optimizer_states"]
    assert mine["param_groups"] == theirs["param_groups"] and sorted(mine["state"]) == sorted(theirs["state"])
    for index, state in theirs["state"].items():
        assert state.keys() == mine["state"][index].keys()
        assert all(torch.equal(mine["state"][index][k], v) for k, v in state.items()), index


@pytest.mark.multiprocess
def test_an_asynchronous_save_holds_and_resumes_what_the_synchronous_one_does(runs):
    """checkpoint="sharded-async" (4 stages, a save at each epoch's end, training going on while it is written): each
    checkpoint equals the synchronous run's, and the run resumed from its step-2 checkpoint on 2 stages ends where
    the one resumed from the synchronous checkpoint ends."""
    for step in range(1, 5):
        name = f"epoch={step - 1}-step={step}.ckpt"
        got, want = consolidate(str(runs["async-4"] / name)), consolidate(str(runs["sharded-4"] / name))
        assert got["global_step"] == step
        assert_same_checkpoint(got, want)
    assert not list(runs["async-4"].glob("*.tmp-*"))  # every save finished before the fit returned
    assert losses(runs["async-resumed-2"]) == losses(runs["resumed-2"])
    got, want = consolidate(str(runs["async-resumed-2"] / "final.ckpt")), consolidate(str(runs["resumed-2"] / "final.ckpt"))
    assert got["global_step"] == 4
    assert_same_checkpoint(got, want)


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_an_asynchronous_schedule_saves_sharded_what_it_saves_in_one_file(runs, schedule):
    sharded = consolidate(str(runs[f"{schedule}-2"] / "final.ckpt"))
    full = torch.load(runs[f"{schedule}-2"] / "final-full.ckpt", weights_only=False)
    assert list(sharded["state_dict"]) == list(full["state_dict"])
    for name, tensor in full["state_dict"].items():
        assert torch.equal(sharded["state_dict"][name], tensor), name
    (got,), (want,) = sharded["optimizer_states"], full["optimizer_states"]
    assert got["param_groups"] == want["param_groups"] and sorted(got["state"]) == sorted(want["state"])
    for index, state in want["state"].items():
        assert state.keys() == got["state"][index].keys()
        assert all(torch.equal(got["state"][index][k], v) for k, v in state.items())
    assert sharded["global_step"] == full["global_step"] == 3 and sharded["loops"] == full["loops"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("run", "model"), [("sharded-4", {"hidden": 2}), ("shard-2x2", ADAM)])
def test_consolidated_checkpoint_loads_and_resumes_on_one_device(runs, tmp_path, run, model):
    import lightning as L
    from tiny import LossRecorder, TinyClassifier, data
    from torch.utils.data import DataLoader

    source = runs[run] / "epoch=1-step=2.ckpt"
    one = tmp_path / "one.ckpt"
    if run == "sharded-4":  # the command, as a user runs it
        done = subprocess.run([sys.executable, "-m", "lightning_pipedream", "checkpoint", "consolidate", str(source),
                               str(one)], capture_output=True, text=True, env=script_env(), timeout=120)
        assert done.returncode == 0, done.stderr
    else:  # its entry point, in this process (no second interpreter to start)
        assert checkpoint_main(["consolidate", str(source), str(one)]) == 0
    loaded = TinyClassifier.load_from_checkpoint(one)  # no strategy
    assert loaded.hparams.hidden == 2
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[LossRecorder(str(tmp_path))])
    trainer.fit(TinyClassifier(**model), DataLoader(data(), batch_size=60), ckpt_path=one)
    assert losses(tmp_path) == pytest.approx(losses(runs[run])[2:], rel=1e-5)
    want = final_weights(runs[run])
    for name, tensor in trainer.lightning_module.state_dict().items():
        if name in want:
            torch.testing.assert_close(tensor, want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("resumed", ["shard-resumed-2x2", "whole-resumed-2x2", "shard-resumed-4"])
def test_a_checkpoint_of_sharded_stages_resumes_on_any_layout_as_if_never_stopped(runs, resumed):
    """2 stages x 2 replicas with shard='full' and Adam, saved after step 2 (each replica its own shards), resumed
    sharded, with whole replicas (shard=None) and on 4 stages: the next losses, the final weights and Adam's state
    are those of the run that was not stopped."""
    uninterrupted = runs["shard-2x2"]
    assert losses(runs[resumed]) == pytest.approx(losses(uninterrupted)[2:], rel=1e-5)
    want, got = consolidate(str(uninterrupted / "final.ckpt")), consolidate(str(runs[resumed] / "final.ckpt"))
    assert list(got["state_dict"]) == list(want["state_dict"]) and got["global_step"] == want["global_step"] == 4
    for name, tensor in want["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    (mine,), (theirs,) = got["optimizer_states"], want["optimizer_states"]
    assert sorted(mine["state"]) == sorted(theirs["state"]) and len(theirs["state"]) == 8
    for index, state in theirs["state"].items():
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"] and float(state["step"]) == 4
        for key, value in state.items():
            torch.testing.assert_close(mine["state"][index][key], value, rtol=1e-5, atol=1e-8, msg=(index, key))


@pytest.mark.multiprocess
def test_each_replica_of_a_sharded_stage_writes_its_own_shard_under_the_unsharded_names(runs):
    from tiny import TinyClassifier
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_pipedream.runtime.stages.named_tensors import saved_entries

    directory = runs["shard-2x2"] / "epoch=1-step=2.ckpt"
    # The names and global shapes an unsharded save writes: the module's own
    entries = saved_entries(str(directory))
    whole = {f"model/{k}": (tuple(v.shape), v.dtype) for k, v in TinyClassifier(**ADAM).state_dict().items()}
    assert {k: v for k, v in entries.items() if k.startswith("model/")} == whole
    assert entries["optimizer0/layers.0.weight/exp_avg"] == whole["model/layers.0.weight"]
    # layers.0.weight (15 x 8) is on stage 0, whose replicas hold rows 0-7 and 8-14: each wrote its own rows
    replicas = json.loads((runs["shard-2x2"] / "rank0.json").read_text())["groups"]["replica"]
    storage = FileSystemReader(str(directory)).read_metadata().storage_data
    for name in ("model/layers.0.weight", "optimizer0/layers.0.weight/exp_avg"):
        pieces = sorted((tuple(index.offset), info.relative_path.split("_")[2])
                        for index, info in storage.items() if index.fqn == name)
        assert pieces == [((0, 0), str(replicas[0])), ((8, 0), str(replicas[1]))], name


@pytest.mark.multiprocess
def test_a_save_and_a_read_under_shards_add_nothing_of_the_stages_size_to_any_rank(runs):
    """What the meter of live tensor bytes counts on each rank of 2 x 2 grad_op shards (a stage: 2.1 MB of weights
    and 4.2 MB of Adam state, each replica holding half), above what the rank held before: a sharded save adds
    almost nothing (it writes the shards where they are); reading the checkpoint back adds this rank's own optimizer
    shard (the state the optimizer keeps), and brings back every piece of it exactly (zeroed before the read); a full
    save gathers, and the meter sees it."""
    for rank in range(4):
        live = json.loads((runs["live-2x2"] / f"rank{rank}_live.json").read_text())
        own, stage = live["own_bytes"], live["stage_bytes"]
        assert live["sharded"] and 0.49 * stage <= own <= 0.51 * stage, live
        assert live["sharded_save"] < own / 10, (rank, live)  # gathering the stage's shards added 2 x own
        assert live["sharded_load"] <= own, (rank, live)  # reading whole and cutting added 2 x own
        assert live["read_back_exact"] and live["read_back_nonzero"], (rank, live)
        assert live["full_save"] >= stage / 3, (rank, live)  # at least the stage's weights whole
    files = {p.name: p.stat().st_size for p in (runs["live-2x2"] / "live-sharded.ckpt").glob("*.distcp")}
    for rank in range(4):  # each rank's file holds its own shards (and the 4 bytes of one replicated step count)
        own = json.loads((runs["live-2x2"] / f"rank{rank}_live.json").read_text())["own_bytes"]
        assert own <= files[f"__{rank}_0.distcp"] <= 1.05 * own, files


@pytest.mark.multiprocess
def test_a_checkpoint_of_sharded_stages_exports_whole_tensors(runs, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    source = runs["shard-2x2"] / "epoch=1-step=2.ckpt"
    assert checkpoint_main(["export-hf", str(source), str(tmp_path / "hf"), "--prefix", "layers."]) == 0
    exported = safetensors.load_file(tmp_path / "hf" / "model.safetensors")
    want = consolidate(str(source))["state_dict"]
    assert sorted(exported) == sorted(k[len("layers."):] for k in want) and exported["0.weight"].shape == (15, 8)
    for name, tensor in exported.items():
        assert torch.equal(tensor, want["layers." + name]), name


@pytest.mark.multiprocess
def test_no_save_raises_a_ranks_peak_by_more_than_the_largest_stage(runs):
    """A sharded save (each rank writes its own stage) raises no rank's peak by half the model; a single-file save
    raises rank 0's (which writes the file, receiving one stage's tensors after another) by at most the largest
    stage's weights and optimizer state, not the whole model that a gather held (2.96x it before)."""
    saves = [json.loads((runs["memory"] / f"rank{r}_saves.json").read_text()) for r in range(4)]
    model = saves[0]["model_bytes"]
    largest = max(save["stage_bytes"] for save in saves)  # weights and momentum of the largest stage: 2/3 of the model
    assert model > 24e6 and largest < 0.7 * model, saves
    for rank, save in enumerate(saves):
        assert save["sharded"] <= 0.5 * model, (rank, save)
        assert save["full"] <= largest, (rank, save)
    assert saves[0]["full"] <= 0.5 * model, saves[0]


# -- one process: the writer, its failures and the offline commands ----------------------------------------------
@pytest.mark.parametrize("form", ["full", "sharded"])
def test_a_model_built_on_meta_resumes_the_checkpoints_weights(tmp_path, form):
    # Lightning restores a checkpoint before setup, which materializes (initializes) a model built in configure_model:
    # its weights are loaded after the stage exists. Resumed at the step it was saved, nothing trains.
    import lightning as L
    from tiny import TinyClassifier, data
    from torch.utils.data import DataLoader

    from lightning_pipedream import PipeDreamStrategy

    def fit(seed: int, **kwargs) -> L.Trainer:
        L.seed_everything(seed, verbose=False)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False,
                            strategy=PipeDreamStrategy(schedule="1f1b", chunks=2, checkpoint=form))
        trainer.fit(TinyClassifier(build_in_configure_model=True), DataLoader(data(), batch_size=12), **kwargs)
        return trainer

    first = fit(0)
    first.save_checkpoint(tmp_path / "a.ckpt")
    resumed = fit(1, ckpt_path=tmp_path / "a.ckpt")
    want = first.lightning_module.state_dict()
    for name, tensor in resumed.lightning_module.state_dict().items():
        assert torch.equal(tensor, want[name]), name


class Net(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 2))


def save_alone(module: nn.Module, path: Path, storage_options: dict | None = None) -> None:
    """What the strategy's save does, on one process (no process group): the real writer."""
    keys = list(module.state_dict())
    pipeline = SimpleNamespace(module=module, checkpoint=CheckpointGather(0, 1, keys), optimizer_layouts=[],
                               shard=None)
    checkpoint = {"state_dict": module.state_dict(), "epoch": 3}
    PipelineCheckpoints("sharded").save(checkpoint, str(path), pipeline, True, lambda x: x, None, storage_options)


def test_a_kill_while_saving_leaves_the_previous_checkpoint_readable(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    first = Net()
    save_alone(first, path)

    def killed(tensors, directory):  # the data files begin, then the process dies before meta.pt and the rename
        os.makedirs(directory, exist_ok=True)
        (Path(directory) / "__0_0.distcp").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(sharded_checkpoint, "write_named", killed)
    with pytest.raises(KeyboardInterrupt):
        save_alone(Net(), path)
    monkeypatch.undo()
    for name, tensor in consolidate(str(path))["state_dict"].items():
        assert torch.equal(tensor, first.state_dict()[name])
    left = tmp_path / f"last.ckpt.tmp-{os.getpid()}"
    assert left.is_dir()  # what the kill left; the next save clears it
    second = Net()
    save_alone(second, path)
    assert not left.exists()
    assert torch.equal(consolidate(str(path))["state_dict"]["layers.0.weight"], second.layers[0].weight)
    # A dead writer's temporary directory goes at the next save in that folder, once a minute old.
    dead = tmp_path / "other.ckpt.tmp-999999999"
    dead.mkdir()
    os.utime(dead, (time.time() - 120, time.time() - 120))
    save_alone(second, path)
    assert not dead.exists()


@pytest.mark.multiprocess
def test_a_real_kill_during_a_sharded_save_leaves_the_previous_checkpoint_and_the_next_save_clears_it(tmp_path):
    """2 processes train and save last.ckpt (sharded) after epoch 0; in the save after epoch 1, rank 1 writes its data
    files and stops there (rank 0 waits for it inside torch.distributed.checkpoint's save), and the test kills every
    process with SIGKILL. last.ckpt still reads back, tensor for tensor, as the epoch-0 save that first.ckpt holds
    too; the half-written save is a temporary directory beside it, which a new run resuming from last.ckpt clears at
    its next save in that folder (a dead writer's, once a minute old)."""
    out, marker = tmp_path / "run", tmp_path / "rank1-wrote-its-files"
    out.mkdir()
    run = {"devices": 2, "batch_size": 60, "max_steps": 4, "model": {"hidden": 2},  # 1 batch per epoch
           "strategy": {**SHARDED, "balance": [4, 3]}}
    (tmp_path / "killed.json").write_text(json.dumps([[str(out), {**run, "killed_in_second_save": {
        "rank": 1, "marker": str(marker)}}]]))
    kill_at_marker(SCRIPTS / "tiny.py", tmp_path, tmp_path / "killed.json", marker)
    [left] = list(out.glob("last.ckpt.tmp-*"))  # the save the kill interrupted
    assert sorted(p.name for p in left.iterdir()) == ["__0_0.distcp", "__1_0.distcp"]  # no .metadata, no meta.pt
    previous, first = consolidate(str(out / "last.ckpt")), consolidate(str(out / "first.ckpt"))
    assert previous["epoch"] == first["epoch"] == 0 and previous["global_step"] == first["global_step"] == 1
    assert previous["state_dict"].keys() == first["state_dict"].keys() and previous["state_dict"]
    for name, tensor in first["state_dict"].items():
        assert torch.equal(previous["state_dict"][name], tensor), name
    for mine, theirs in zip(previous["optimizer_states"], first["optimizer_states"], strict=True):
        assert mine["state"].keys() == theirs["state"].keys()
        for index, state in theirs["state"].items():
            for key, value in state.items():
                assert torch.equal(mine["state"][index][key], value), (index, key)
    # A new run resumes from it (each rank reading its share), trains on, and its save in that folder clears what the
    # killed one left, once that is a minute old (a dead writer's: its process id is gone).
    os.utime(left, (time.time() - 120, time.time() - 120))
    (tmp_path / "resumed.json").write_text(json.dumps([[str(out), {**run, "resume": str(out / "last.ckpt")}]]))
    run_script(SCRIPTS / "tiny.py", out, {"--runs": str(tmp_path / "resumed.json")}, 300)
    assert not left.exists() and not list(out.glob("*.tmp-*"))
    assert consolidate(str(out / "final.ckpt"))["global_step"] == 4  # resumed at step 1, trained to 4


def test_a_kill_between_the_renames_reads_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    first = Net()
    save_alone(first, path)
    os.replace(path, tmp_path / "last.ckpt.old-4242")  # the previous one set aside, the new one not yet in place
    with pytest.warns(UserWarning, match="a save was interrupted while replacing it; reading the previous"):
        loaded = PipelineCheckpoints("sharded").load(str(path), None, torch.load)
    assert loaded["epoch"] == 3 and loaded["state_dict"] == {}


def test_a_checkpoint_of_another_model_is_refused_with_its_names(tmp_path):
    save_alone(Net(), tmp_path / "a")
    shards = PipelineCheckpoints("sharded").load(str(tmp_path / "a"), None, torch.load)[sharded_checkpoint.LOADED]
    other = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(ValueError, match=r"written by Net and does not fit this model: 2 of this model's names are "
                                         r"not in it \['0.weight', '0.bias'\], and it holds 4 this model lacks"):
        shards.check_model(list(other.state_dict()), other.state_dict(), strict=True)
    wider = Net(width=5)
    with pytest.raises(ValueError, match=r"holds layers.0.weight of shape \(4, 3\), but this model's is \(5, 3\)"):
        shards.check_model(list(wider.state_dict()), wider.state_dict(), strict=True)
    with pytest.raises(FileNotFoundError, match="is a directory without meta.pt: not a sharded checkpoint"):
        PipelineCheckpoints("sharded").load(str(tmp_path), None, torch.load)
    torch.save({"epoch": 1}, tmp_path / "meta.pt")  # Lightning's ModelParallelStrategy writes meta.pt too
    with pytest.raises(ValueError, match="was not written by PipeDreamStrategy"):
        PipelineCheckpoints("sharded").load(str(tmp_path), None, torch.load)


def test_a_checkpoint_missing_a_ranks_file_is_refused_with_the_reason(tmp_path, capsys):
    save_alone(Net(), tmp_path / "a")
    (tmp_path / "a" / "__0_0.distcp").unlink()  # as if rank 0 had written it to another machine's local disk
    with pytest.raises(FileNotFoundError, match=r"is incomplete: 1 of its 1 data files are missing \(__0_0.distcp; "
                                                r"__<rank>_<n>.distcp is the file rank <rank> wrote\). Each rank "):
        consolidate(str(tmp_path / "a"))
    assert checkpoint_main(["consolidate", str(tmp_path / "a"), str(tmp_path / "one.ckpt")]) == 2
    assert "all ranks must save to one filesystem they share" in " ".join(capsys.readouterr().err.split())


def test_consolidate_refuses_a_checkpoint_bigger_than_the_memory_left(tmp_path, monkeypatch, capsys):
    save_alone(Net(), tmp_path / "a")  # 26 floats: 104 bytes
    monkeypatch.setattr(sharded_checkpoint, "available_memory", lambda: 100)
    with pytest.raises(MemoryError, match=r"holds all of its tensors in this process at once, 0.00 GiB \(the whole "
                                          r"model and its optimizer state\), and this machine has 0.00 GiB available"):
        consolidate(str(tmp_path / "a"))
    assert checkpoint_main(["consolidate", str(tmp_path / "a"), str(tmp_path / "one.ckpt")]) == 2
    assert "or resume from the directory itself" in " ".join(capsys.readouterr().err.split())
    monkeypatch.setattr(sharded_checkpoint, "available_memory", lambda: 104)
    assert consolidate(str(tmp_path / "a"))["state_dict"]["layers.0.weight"].shape == (4, 3)


def test_a_sharded_save_refuses_storage_options(tmp_path):
    with pytest.raises(TypeError, match="takes no storage_options. Use checkpoint='full' to save through the"):
        save_alone(Net(), tmp_path / "a", storage_options={"compression": "gzip"})


def test_the_checkpoint_form_follows_checkpoint_and_the_model_size():
    with pytest.raises(ValueError, match=r"checkpoint='sharding'\) is not a checkpoint form; use 'sharded'"):
        PipelineCheckpoints("sharding")
    auto = PipelineCheckpoints("auto")
    auto.measure(Net())
    assert not auto.sharded and PipelineCheckpoints("sharded").sharded and not PipelineCheckpoints("full").sharded
    with torch.device("meta"):  # a model built on meta counts by its shapes
        big = nn.Linear(SHARDED_FROM // 4 // 1024, 1024, bias=False)
    auto = PipelineCheckpoints("auto")
    auto.measure(big)
    assert auto.sharded


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_export_hf_is_read_by_from_pretrained_with_the_same_logits(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
        hf = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
        hf = transformers.LlamaForCausalLM(config)
    holder = nn.Module()
    holder.model = hf  # the LightningModule's attribute: names begin with "model."
    with torch.no_grad():  # "fine-tuned": not the initial weights
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    save_alone(holder, tmp_path / "ckpt")
    config.save_pretrained(tmp_path / "pretrained")
    out = tmp_path / "hf"
    if family == "gpt2":  # through the command
        assert checkpoint_main(["export-hf", str(tmp_path / "ckpt"), str(out), "--prefix", "model.", "--config",
                                str(tmp_path / "pretrained")]) == 0
        assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    else:  # files of at most 40 kB: several, with the index from_pretrained follows
        files = export_hf(str(tmp_path / "ckpt"), str(out), "model.", str(tmp_path / "pretrained"), 40_000)
        assert "model.safetensors.index.json" in files and len(files) > 3
    loaded = type(hf).from_pretrained(out)
    ids = torch.randint(0, 64, (2, 7))
    hf.eval()
    torch.testing.assert_close(loaded(ids).logits, hf(ids).logits, rtol=0, atol=0)


def test_export_hf_names_the_prefixes_it_found(tmp_path, capsys):
    save_alone(Net(), tmp_path / "ckpt")
    assert checkpoint_main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--prefix", "model."]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "No weights in" in err and "begin with 'model.'; its names begin with ['layers.']" in err
