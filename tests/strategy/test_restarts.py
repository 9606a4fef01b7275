"""Kill anywhere, lose nothing: a rank SIGKILLed under torchrun with restarts comes back by itself, resumes from the
newest complete checkpoint, and ends with the weights, optimizer state and global step of a run nobody killed.

Each case is one torchrun job of 2 processes (tests/scripts/restart_trainer.py, 15 batches an epoch, a checkpoint
every 8 steps, ``fit(ckpt_path="last")``, a StatefulDataLoader); the uninterrupted runs are one job of their own.
"""

from __future__ import annotations

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


# Time-based saves, rank 1's clock (as ModelCheckpoint reads it) 7 times as fast and 1000 s ahead of rank 0's.
CLOCK = {"schedule": "pipedream", "max_steps": 24, "time_interval": 0.3,
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
    ended = finish_torchrun([job for _, job in started.values()], limit=TORCHRUN_LIMIT * 2)
    return {name: (out, codes, text) for (name, (out, _)), (codes, text) in zip(started.items(), ended)}


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
    saves = [(root / "clock" / f"saves_rank{rank}.txt").read_text().split() for rank in (0, 1)]
    # Every stage saves at the same steps (rank 1 alone would save 7 times as often); how many saves fall in the run
    # depends on the machine's speed, so only that there is one.
    assert saves[0] == saves[1] and len(saves[0]) >= 1, saves
    written = sorted(int(p.name.split("step=")[1].split(".")[0]) for p in (root / "clock" / "checkpoints").iterdir())
    assert written == sorted(int(step) for step in saves[0])
