"""Kill anywhere, lose nothing: a rank SIGKILLed under torchrun with restarts comes back by itself, resumes from the
newest complete checkpoint, and ends with the weights, optimizer state and global step of a run nobody killed.

Each case is one torchrun job of 2 processes (tests/scripts/restart_trainer.py, 15 batches an epoch, a checkpoint
every 8 steps, ``fit(ckpt_path="last")``, a StatefulDataLoader); the uninterrupted runs are one job of their own.
One launch starts the run again on fewer processes after each kill: 4, then 2, then 1.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fault_runs import TORCHRUN_LIMIT, finish_torchrun, start_torchrun

MAX_STEPS = 30
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]  # the module's jobs count against its first test

# name: (schedule, checkpoint, kill, rendezvous, nodes, the step the restarted run resumes at)
CASES = {
    # the scenario: one rank killed after step 21 resumes from step 16 (mid-epoch 1)
    "1f1b_full_kill_after_step": ("1f1b", "full", {"rank": 1, "step": 21, "during": "step"}, "static", 1, 16),
    # a kill inside the save at step 24: the restart resumes from the previous complete checkpoint (16)
    "pipedream_sharded_kill_in_save": ("pipedream", "sharded", {"rank": 1, "step": 24, "during": "save"},
                                       "static", 1, 16),
    # the same in an asynchronous save: rank 1 dies in the background once its data is written, training going on
    "pipedream_async_kill_in_save": ("pipedream", "sharded-async", {"rank": 1, "step": 24, "during": "save"},
                                     "static", 1, 16),
    "1f1b_full_kill_in_save": ("1f1b", "full", {"rank": 0, "step": 24, "during": "save"}, "static", 1, 16),
    # two "nodes" of one process each on loopback, the c10d rendezvous, a kill in the middle of a transfer
    "pipedream_sharded_two_nodes_kill_in_transfer": ("pipedream", "sharded", {"rank": 0, "step": 21,
                                                                              "during": "transfer"}, "c10d", 2, 16),
}


# Back on fewer processes: the same script started again by torchrun on fewer of them each time (as a restart with
# `--nnodes MIN:MAX` after nodes were lost does): 4 processes, rank 1 killed after step 21 (no restart left); 2
# processes, which resume from step 16 and lose rank 1 after step 27; 1 process, which resumes from step 24. Each
# start plans the 7 layers anew on its processes; 1f1b is flushed, so every layout ends with the uninterrupted
# 2-process run's weights. One launch of three torchrun jobs in a row, beside the others.
FEWER = {"schedule": "1f1b", "checkpoint": "sharded", "max_steps": MAX_STEPS, "elastic": True,
         "kill": [{"rank": 1, "step": 21, "world": 4}, {"rank": 1, "step": 27, "world": 2}]}


def fewer_and_fewer(out: Path) -> tuple[list[int], str]:
    """FEWER's three jobs, one after the other (4, 2, 1 processes): their exit codes and stderr, together."""
    codes, texts = [], []
    for nproc in (4, 2, 1):
        (code,), text = finish_torchrun([start_torchrun(out, FEWER, nproc=nproc, max_restarts=0)])[0]
        codes.append(code)
        texts.append(text)
    return codes, "\n".join(texts)


# Time-based saves, rank 1's clock (as ModelCheckpoint reads it) 7 times as fast and 1000 s ahead of rank 0's. Each
# step waits 40 ms first, so the run lasts at least 0.96 s, three intervals, on any machine (CI once ran all 24 steps
# in less than one interval: no save at all).
CLOCK = {"schedule": "pipedream", "max_steps": 24, "time_interval": 0.3, "step_sleep": 0.04,
         "clock_skew": {"rank": 1, "rate": 7.0, "offset": 1000.0}}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, tuple[Path, list[int], str]]:
    """Every job of this module side by side (their waits overlap): each case's, and the runs nobody killed, one
    per schedule, in the same processes of one job, followed in them by a run with a plain DataLoader and a resume of
    its step-24 checkpoint (mid-epoch 1), and a run saving by time with skewed clocks (CLOCK)."""
    started = {}
    root = tmp_path_factory.mktemp("uninterrupted")
    plain = {"schedule": "1f1b", "max_steps": 24, "plain_loader": True}
    resumed = {"schedule": "1f1b", "max_steps": 26, "plain_loader": True,
               "ckpt_path": str(root / "plain" / "checkpoints" / "epoch=1-step=24.ckpt")}
    started["references"] = (root, start_torchrun(
        root, runs=[*[(root / s, {"schedule": s, "max_steps": MAX_STEPS}) for s in ("1f1b", "pipedream")],
                    (root / "plain", plain), (root / "plain_resumed", resumed),
                    (root / "clock", CLOCK)], max_restarts=0))
    for case, (schedule, checkpoint, kill, rendezvous, nodes, _) in CASES.items():
        out = tmp_path_factory.mktemp(case)
        started[case] = (out, start_torchrun(out, {"schedule": schedule, "checkpoint": checkpoint, "kill": kill,
                                                   "max_steps": MAX_STEPS}, nproc=2 // nodes, nodes=nodes,
                                             rendezvous=rendezvous))
    fewer = tmp_path_factory.mktemp("fewer")
    with ThreadPoolExecutor(1) as chain:  # its jobs in a row, while the others run
        fewer_ended = chain.submit(fewer_and_fewer, fewer)
        ended = finish_torchrun([job for _, job in started.values()], limit=TORCHRUN_LIMIT * 2)
        jobs = {name: (out, codes, text) for (name, (out, _)), (codes, text) in zip(started.items(), ended)}
        jobs["fewer"] = (fewer, *fewer_ended.result())
    return jobs


def assert_equal_ends(run: Path, reference: Path) -> None:
    for rank in (0, 1):
        got = torch.load(run / f"final_rank{rank}.pt")
        want = torch.load(reference / f"final_rank{rank}.pt")
        assert got["global_step"] == want["global_step"] == MAX_STEPS
        assert got["weights"].keys() == want["weights"].keys()
        for name, tensor in want["weights"].items():
            assert torch.equal(got["weights"][name], tensor), f"rank {rank}: {name} differs"
        assert got["optimizer"].keys() == want["optimizer"].keys()
        for index, state in want["optimizer"].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(got["optimizer"][index][key]), torch.as_tensor(value)), \
                    f"rank {rank}: optimizer state {key} of parameter {index} differs"


@pytest.mark.parametrize("case", list(CASES))
def test_a_killed_rank_comes_back_and_the_run_ends_as_if_never_killed(jobs, case):
    schedule, _, _, _, nodes, resumed_at = CASES[case]
    out, codes, text = jobs[case]
    assert codes == [0] * nodes, text[-6000:]
    # Two attempts on every rank: the first from scratch, the restart from the newest complete checkpoint.
    for rank in (0, 1):
        attempts = (out / f"attempts_rank{rank}.txt").read_text().split("\n")[:-1]
        assert [line.split()[1] for line in attempts] == ["0", str(resumed_at)], (attempts, text[-6000:])
    if "in_save" in case:  # the newest save was cut short: skipped, and said
        assert "did not finish and are skipped: epoch=1-step=24.ckpt.tmp-" in text, text[-6000:]
    references, ref_codes, ref_text = jobs["references"]
    assert ref_codes == [0], ref_text[-6000:]
    assert_equal_ends(out, references / schedule)


def test_a_mid_epoch_resume_that_cannot_be_exact_is_warned_once(jobs):
    _, codes, text = jobs["references"]
    assert codes == [0], text[-6000:]
    warning = ("Resuming in the middle of epoch 1 (after 9 batches), but the training DataLoader (DataLoader) cannot "
               "resume mid-epoch: the rest of epoch 1 starts again from its first batch instead of batch 9: the "
               "resumed run will not equal an uninterrupted one. For an exact resume, use torchdata's "
               "StatefulDataLoader with Lightning's sampler")
    assert text.count(warning) == 2, text[-6000:]  # once on each of the 2 ranks


def test_time_based_saves_happen_at_the_same_step_on_every_stage_whatever_their_clocks(jobs):
    root, codes, text = jobs["references"]
    assert codes == [0], text[-6000:]
    files = [root / "clock" / f"saves_rank{rank}.txt" for rank in (0, 1)]
    saves = [f.read_text().split() if f.exists() else [] for f in files]
    # Every stage saves at the same steps (rank 1 alone would save 7 times as often); the steps' waits make the run
    # last three intervals at least, so there are saves; how many more depends on the machine's speed.
    assert saves[0] == saves[1] and len(saves[0]) >= 2, saves
    written = sorted(int(p.name.split("step=")[1].split(".")[0]) for p in (root / "clock" / "checkpoints").iterdir())
    assert written == sorted(int(step) for step in saves[0])


def test_a_run_restarted_on_fewer_processes_resumes_on_the_new_layout_as_if_never_stopped(jobs):
    """4 processes -> 2 -> 1 (FEWER): each start resumes the newest checkpoint on its own layout, and the run ends
    with the weights, optimizer state and global step of a run nobody stopped."""
    out, codes, text = jobs["fewer"]
    assert codes == [1, 1, 0], text[-6000:]  # the two killed jobs fail (no restart left); the last one ends the run
    attempts = (out / "attempts_rank0.txt").read_text().split("\n")[:-1]
    # (restart count, the step it resumed at, world size): the checkpoints at 16 and 24, on 2 then 1 process
    assert [line.split() for line in attempts] == [["0", "0", "4"], ["0", "16", "2"], ["0", "24", "1"]], \
        (attempts, text[-6000:])
    got = torch.load(out / "final_rank0.pt")  # one process: the whole model
    references, ref_codes, ref_text = jobs["references"]
    assert ref_codes == [0], ref_text[-6000:]
    want = [torch.load(references / "1f1b" / f"final_rank{rank}.pt") for rank in (0, 1)]
    assert got["global_step"] == MAX_STEPS and got["world_size"] == 1
    weights = {**want[0]["weights"], **want[1]["weights"]}
    optimizer = {**want[0]["named_optimizer"], **want[1]["named_optimizer"]}
    assert got["weights"].keys() == weights.keys() and got["named_optimizer"].keys() == optimizer.keys()
    for name, tensor in weights.items():
        assert torch.equal(got["weights"][name], tensor), name
    for name, state in optimizer.items():
        for key, value in state.items():
            assert torch.equal(got["named_optimizer"][name][key], value), (name, key)
