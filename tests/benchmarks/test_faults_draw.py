"""benchmarks.faults.kills without a launch (its runs are the benchmark's, too long for the suite): the seeded kills
cover every rank, moment, schedule, checkpoint form and rendezvous, and the way back is read from the ranks' events
as the slowest rank reached each."""

from __future__ import annotations

import json

from benchmarks.faults import kills


def test_twenty_seeded_kills_cover_every_rank_moment_and_form():
    cases = kills.draw(0, 20)
    assert cases == kills.draw(0, 20) and cases != kills.draw(1, 20)  # the seed decides, and only it
    assert {c["kill"]["rank"] for c in cases} == set(range(kills.PROCESSES))
    assert {c["kill"]["during"] for c in cases} == {"step", "transfer", "save"}
    assert {c["schedule"] for c in cases} == set(kills.SCHEDULES)
    assert {c["checkpoint"] for c in cases} == {"full", "sharded"} and {c["rendezvous"] for c in cases} == {
        "static", "c10d"}
    for c in cases:
        if c["kill"]["during"] == "save":  # at a save's step; one file: rank 0, its only writer
            assert c["kill"]["step"] % kills.EVERY == 0 and (c["checkpoint"] == "sharded" or c["kill"]["rank"] == 0)
        assert 0 < c["kill"]["step"] < kills.STEPS


def test_the_way_back_is_split_at_the_slowest_ranks_moments(tmp_path):
    for rank in range(kills.PROCESSES):
        events = {"started": 105.0 + rank * 0.1, "rendezvous_begin": 130.0 + rank, "rendezvous_end": 134.5,
                  "train_start": 136.0 + rank * 0.5, "first_step_end": 138.0}
        (tmp_path / f"timeline_rank{rank}_attempt1.json").write_text(json.dumps(events))
    back = kills.timeline(tmp_path, 100.0)
    assert back == {"detection_s": 5.0, "start_up_s": 28.0, "rendezvous_s": 1.5, "loading_s": 3.0,
                    "first_step_s": 0.5, "total_s": 38.0}
    (tmp_path / "timeline_rank3_attempt1.json").unlink()  # a rank that never came back: no way back to tell
    assert kills.timeline(tmp_path, 100.0) is None
