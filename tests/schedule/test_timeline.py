"""Timed actions: Chrome trace round trip, bubble fraction, and the PNG Gantt chart."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lightning_pipedream.schedule.actions import Action, Op
from lightning_pipedream.schedule.builders import build_schedule
from lightning_pipedream.schedule.simulate import simulate
from lightning_pipedream.schedule.timeline import (
    TimedAction,
    bubble_fraction,
    from_chrome_trace,
    plot_timeline,
    to_chrome_trace,
)


def _recorded() -> list[TimedAction]:
    """A small hand-made trace like the executor records: compute, a receive wait, a send, an update."""
    return [
        TimedAction(0, Action(Op.FORWARD, 0, 0), 0.0, 1.0),
        TimedAction(0, Action(Op.SEND_ACT, 0, 0, peer=1), 1.0, 1.0),
        TimedAction(0, Action(Op.FORWARD, 0, 1), 1.0, 2.0),
        TimedAction(1, Action(Op.RECV_ACT, 1, 0, peer=0), 0.0, 1.0),  # waiting for rank 0
        TimedAction(1, Action(Op.FORWARD, 1, 0), 1.0, 2.0),
        TimedAction(1, Action(Op.OPTIMIZER_STEP, 1, step=3), 2.0, 2.5),
    ]


def test_timed_action_is_frozen():
    event = _recorded()[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.start = 5.0  # type: ignore[misc]
    assert event.duration == 1.0


def test_chrome_trace_layout():
    trace = to_chrome_trace(_recorded())
    json.dumps(trace)  # plain JSON
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1"}
    assert {e["tid"] for e in spans} == {0, 1}
    first = spans[0]
    assert first["name"] == "F0 s0" and first["ts"] == 0.0 and first["dur"] == pytest.approx(1e6)
    assert first["args"] == {"op": "F", "stage": 0, "microbatch": 0, "peer": None, "step": 0}
    assert spans[1]["name"] == "SA0@1 s0" and spans[1]["cat"] == "communication"


def test_chrome_trace_round_trip_through_json():
    events = simulate(build_schedule("pipedream", 3, minibatches=5), [0.1, 0.2, 0.3], [0.2, 0.3, 0.4], latency=0.01).events
    back = from_chrome_trace(json.loads(json.dumps(to_chrome_trace(events))))
    assert [(e.rank, e.action) for e in back] == [(e.rank, e.action) for e in events]
    assert [e.start for e in back] == pytest.approx([e.start for e in events], abs=1e-9)
    assert [e.end for e in back] == pytest.approx([e.end for e in events], abs=1e-9)
    assert from_chrome_trace(to_chrome_trace(_recorded())) == _recorded()


def test_from_chrome_trace_skips_foreign_events_and_rejects_unknown_ops():
    trace = to_chrome_trace(_recorded())
    trace["traceEvents"].append({"name": "gc", "ph": "X", "ts": 0, "dur": 1, "pid": 0, "tid": 0})
    assert len(from_chrome_trace(trace)) == len(_recorded())
    assert len(from_chrome_trace(trace["traceEvents"])) == len(_recorded())  # a bare event list works too
    bad = {"traceEvents": [{"name": "Z", "ph": "X", "ts": 0, "dur": 1, "tid": 0, "args": {"op": "Z", "stage": 0}}]}
    with pytest.raises(ValueError, match="unknown op 'Z'; expected one of F, B, W, O"):
        from_chrome_trace(bad)


def test_bubble_fraction():
    # Makespan 2.5 on 2 ranks; busy: rank 0 2 s, rank 1 1 s forward + 0.5 s update. Waits are bubble.
    assert bubble_fraction(_recorded()) == pytest.approx(1 - 3.5 / (2 * 2.5))
    assert bubble_fraction([]) == 0.0
    one = [TimedAction(0, Action(Op.FORWARD, 0, 0), 3.0, 4.0)]
    assert bubble_fraction(one) == 0.0  # the makespan counts from the first start, not from 0


def _colour_share(path, rgb: tuple[int, int, int]) -> float:
    from matplotlib.image import imread

    pixels = imread(path)[..., :3]
    target = [c / 255 for c in rgb]
    near = (abs(pixels[..., 0] - target[0]) < 0.02) & (abs(pixels[..., 1] - target[1]) < 0.02) & (
        abs(pixels[..., 2] - target[2]) < 0.02
    )
    return float(near.mean())


def test_plot_timeline_draws_forward_and_backward(tmp_path):
    events = simulate(build_schedule("1f1b", 4, 8), 1.0, 2.0).events
    path = plot_timeline(events, tmp_path / "sub" / "t.png", title="1f1b")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    forward, backward = _colour_share(path, (0x4C, 0x72, 0xB0)), _colour_share(path, (0xDD, 0x84, 0x52))
    assert forward > 0.01 and backward > 0.01
    assert 1.5 < backward / forward < 2.5  # backward boxes are twice as long


def test_plot_timeline_accepts_recorded_waits(tmp_path):
    path = plot_timeline(_recorded(), tmp_path / "rec.png")
    assert _colour_share(path, (0xAA, 0xAA, 0xAA)) > 0  # the receive wait, thin and grey
    assert _colour_share(path, (0x55, 0xA8, 0x68)) > 0  # the optimizer step
