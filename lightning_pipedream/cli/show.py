"""`python -m lightning_pipedream show`: print a schedule as a time slot x rank grid, validated, or a recorded trace."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from lightning_pipedream.schedule.actions import Schedule
from lightning_pipedream.schedule.builders import SCHEDULES, build_schedule
from lightning_pipedream.schedule.check import ScheduleError, render_grid, validate
from lightning_pipedream.schedule.timeline import TimedAction, from_chrome_trace, render_events


class UsageError(Exception):
    """Bad command-line input; the message says what to change."""


T = TypeVar("T")


def comma_separated(text: str, convert: Callable[[str], T], flag: str, expected: str,
                    error: type[Exception] = UsageError) -> list[T]:
    """A flag's comma-separated values (``"4,4"``, ``"1e10,1.25e9"``, ``"3,2,2,3"``), each through ``convert``; where
    one does not convert, ``error`` saying "``flag`` must be ``expected``" and what was given."""
    try:
        return [convert(v) for v in text.split(",")]
    except ValueError:
        raise error(f"{flag} must be {expected}; got {text!r}.") from None


def at_least_one(what: str):
    """An argparse type: an integer >= 1, with an error that says what the number means."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1 or str(value) != text.strip():
            raise argparse.ArgumentTypeError(f"must be a whole number >= 1 ({what}), got {text!r}")
        return value

    return parse


def replica_counts(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated whole numbers >= 1, one per stage."""
    try:
        counts = tuple(int(v) for v in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"must be whole numbers >= 1 separated by commas, one per stage, got {text!r}")
    return counts


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """--schedule, --stages, --chunks and --minibatches, shared by `show` and `simulate`."""
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="which schedule (default: 1f1b)")
    parser.add_argument(
        "--stages", type=at_least_one("the number of pipeline stages"), help="pipeline stages (default: 4)"
    )
    parser.add_argument(
        "--replicas",
        type=replica_counts,
        help="replicas per stage, e.g. 2,1 (3 ranks: stage 0 on ranks 0-1, stage 1 on rank 2) or 2,2 (two "
        "data-parallel copies of a 2-stage pipeline); replicas take micro-batches round robin (1F1B-RR)",
    )
    parser.add_argument(
        "--chunks",
        type=at_least_one("micro-batches per training step"),
        help="micro-batches per training step (default: 8); pipedream runs whole batches (1)",
    )
    parser.add_argument(
        "--minibatches",
        type=at_least_one("minibatches before the drain"),
        help="pipedream and 2bw: minibatches (training steps) run before the drain (default: 8 and 4)",
    )
    parser.add_argument(
        "--virtual-stages",
        type=at_least_one("model chunks per rank"),
        help="interleaved: model chunks per rank, v (default: 2); --stages counts ranks, the model has stages x v",
    )


def schedule_of(args: argparse.Namespace) -> Schedule:
    """The schedule that --schedule, --stages, --replicas, --chunks and --minibatches ask for; UsageError if they
    disagree. Sets ``args.stages`` when only --replicas gives it."""
    replicas = getattr(args, "replicas", None)
    if replicas is not None:
        if args.stages not in (None, len(replicas)):
            raise UsageError(
                f"--replicas {','.join(map(str, replicas))} lists {len(replicas)} stages but --stages is "
                f"{args.stages}; give one replica count per stage (or drop --stages)."
            )
        args.stages = len(replicas)
    elif args.stages is None:
        args.stages = 4
    if args.schedule == "pipedream":
        if args.chunks not in (None, 1):
            raise UsageError(
                f"--chunks {args.chunks}: pipedream runs each batch whole (chunks=1); to run more minibatches "
                f"before the drain use --minibatches {args.chunks}."
            )
        return _build(
            lambda: build_schedule("pipedream", args.stages, minibatches=args.minibatches or 8, replicas=replicas)
        )
    virtual = getattr(args, "virtual_stages", None)
    if virtual is not None and args.schedule != "interleaved":
        raise UsageError(
            f"--virtual-stages applies to --schedule interleaved only (model chunks per rank); {args.schedule} "
            "holds one stage per rank."
        )
    if args.schedule == "2bw":
        return _build(
            lambda: build_schedule("2bw", args.stages, args.chunks or 8, minibatches=args.minibatches or 4,
                                   replicas=replicas)
        )
    if args.minibatches is not None:
        raise UsageError(
            f"--minibatches applies to --schedule pipedream and 2bw only; {args.schedule} runs one batch of "
            "--chunks micro-batches per step."
        )
    if args.schedule == "interleaved":
        v = virtual or 2
        return _build(lambda: build_schedule("interleaved", args.stages, args.chunks or 8, virtual_stages=v,
                                             replicas=replicas))
    return _build(lambda: build_schedule(args.schedule, args.stages, args.chunks or 8, replicas=replicas))


def _build(make) -> Schedule:
    """``make()``, with the builders' complaints about the arguments as a :class:`UsageError`."""
    try:
        return make()
    except ValueError as err:
        raise UsageError(str(err)) from None


def size_text(schedule: Schedule) -> str:
    """``"4 stages x 8 micro-batches"`` or ``"4 stages x 8 minibatches"`` for the report's first line."""
    stages = f"{schedule.num_stages} stages"
    if schedule.replicas is not None:
        stages += f" (replicas {','.join(map(str, schedule.replicas))} on {schedule.num_ranks} ranks)"
    if schedule.name == "pipedream":
        per = " per input replica" if schedule.replicas is not None and schedule.replicas[0] > 1 else ""
        return f"{stages} x {schedule.minibatches} minibatches{per}"
    if schedule.name == "2bw":
        return f"{stages} x {schedule.minibatches} minibatches of {schedule.chunks} micro-batches"
    if schedule.virtual_stages > 1:
        stages = f"{schedule.num_ranks} ranks x {schedule.virtual_stages} model chunks ({schedule.num_stages} stages)"
    per = " per input replica" if schedule.replicas is not None and schedule.replicas[0] > 1 else ""
    return f"{stages} x {schedule.chunks} micro-batches{per}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument(
        "--actions", action="store_true", help="also list every rank's actions, sends and receives included"
    )
    parser.add_argument(
        "--trace",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="instead of a schedule, show recorded traces (a flight-recorder file of a failed run, "
        "pipedream_flight_recorder/rank0.json, or the strategy's trace_dir files); several files: one column per rank",
    )
    parser.add_argument(
        "--last", type=int, default=60, help="with --trace: show only the last this many actions (0: all; default 60)"
    )


def read_traces(paths: list[Path]) -> tuple[list[TimedAction], set[int], list[str]]:
    """The events of Chrome-trace files, the ranks whose last action had not ended, and the errors the files carry."""
    events: list[TimedAction] = []
    unfinished: set[int] = set()
    notes: list[str] = []
    for path in paths:
        try:
            obj = json.loads(path.read_text())
            found = from_chrome_trace(obj)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise UsageError(f"{path} is not a trace JSON written by lightning_pipedream ({err}).") from err
        events += found
        raw = obj.get("traceEvents", []) if isinstance(obj, dict) else obj
        unfinished |= {int(ev["tid"]) for ev in raw if (ev.get("args") or {}).get("unfinished")}
        other = obj.get("otherData") if isinstance(obj, dict) else None
        if isinstance(other, dict) and other.get("error"):
            notes.append(f"rank {other.get('rank')}: {other['error']}")
    return events, unfinished, notes


def run_trace(args: argparse.Namespace) -> int:
    events, unfinished, notes = read_traces(args.trace)
    ranks = sorted({e.rank for e in events})
    print(
        f"recorded trace: {len(events)} actions of rank {', '.join(map(str, ranks)) or '-'} "
        f"from {', '.join(map(str, args.trace))}"
    )
    for note in notes:
        print(f"error on {note}")
    print(
        "F3 = forward of micro-batch 3, B3 = its backward, O = optimizer step, RA3@1 / RG3@1 = receive of its "
        "activation / gradient from rank 1 (with the wait), SA/SG = sends; unfinished = the rank was still in it"
    )
    print()
    print(render_events(events, unfinished, max(0, args.last)))
    for path in args.trace:  # a merged trace of a planned run: the plan's prediction against the measured steps
        explanation = explained(path)
        if explanation:
            print()
            print(explanation)
    return 0


def explained(path: Path) -> str | None:
    """The explanation table of a merged trace whose run had a plan (``plan/explain.py``), or None."""
    from lightning_pipedream.plan.explain import ExplainError, explain, from_trace

    try:
        obj = json.loads(path.read_text())
        if not isinstance(obj, dict) or "measured" not in (obj.get("metadata") or {}):
            return None  # a flight-recorder file, or a trace of a run without figures
        return explain(*from_trace(obj, str(path))).table()
    except ExplainError as err:
        return f"no explanation of the run against its plan: {err}"


def run(args: argparse.Namespace) -> int:
    if args.trace:
        return run_trace(args)
    try:
        schedule = schedule_of(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.schedule} schedule, {size_text(schedule)}")
    print(
        "F3 = forward of micro-batch 3, B3 = its backward, O = optimizer step, . = idle; "
        "one slot = one forward or backward"
    )
    if schedule.replicas is not None:
        print(
            "AR = gradient all-reduce among a stage's replicas (waits for all of them); micro-batch m runs on "
            "replica m % r of a stage with r replicas"
        )
    if schedule.splits_backward:
        print("B3 = the input-gradient half of the backward, W3 = its weight-gradient half (deferred into bubbles)")
    if schedule.virtual_stages > 1:
        held = (f"r and {schedule.num_stages - 1}-r (a V: the loss on rank 0)" if schedule.v_shape
                else f"r, r+{schedule.num_ranks}, ...")
        print(f"F3s5 = forward of micro-batch 3 on stage 5; rank r holds stages {held} "
              "(one O per stage, one optimizer step)")
    if schedule.name == "2bw":
        print(
            "2bw: no flush; each stage updates after a minibatch's backwards, and minibatch t runs on the weights "
            "before its stage's newest (version t-1): two versions per stage"
        )
    print()
    print(render_grid(schedule))
    if args.actions:
        print()
        for rank, actions in enumerate(schedule.actions):
            print(f"rank {rank}: {' '.join(map(str, actions))}")
    print()
    try:
        validate(schedule)
    except ScheduleError as err:
        print(f"error: the schedule is not valid: {err}", file=sys.stderr)
        return 1
    print("valid: every receive has its send, forwards precede backwards, no rank waits forever")
    if schedule.replicas is not None:
        print("       every all-reduce has all its stage's replicas and comes before a replicated stage's update")
    return 0
