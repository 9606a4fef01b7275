"""`python -m lightning_pipedream show`: print a schedule as a time slot x rank grid, validated."""

from __future__ import annotations

import argparse
import sys

from lightning_pipedream.schedule.builders import SCHEDULES, build_schedule
from lightning_pipedream.schedule.check import ScheduleError, render_grid, validate


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


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """--schedule, --stages and --chunks, shared by `show` and `simulate`."""
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="which schedule (default: 1f1b)")
    parser.add_argument(
        "--stages", type=at_least_one("the number of pipeline stages"), default=4, help="pipeline stages (default: 4)"
    )
    parser.add_argument(
        "--chunks",
        type=at_least_one("micro-batches per step; for pipedream, minibatches before the drain"),
        default=8,
        help="micro-batches per training step; for pipedream the number of minibatches run before the drain "
        "(default: 8)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument("--actions", action="store_true", help="also list every rank's actions, sends and receives included")


def run(args: argparse.Namespace) -> int:
    schedule = build_schedule(args.schedule, args.stages, args.chunks)
    unit = "minibatches" if args.schedule == "pipedream" else "micro-batches"
    print(f"{args.schedule} schedule, {args.stages} stages x {args.chunks} {unit}")
    print("F3 = forward of micro-batch 3, B3 = its backward, O = optimizer step, . = idle; one slot = one forward or backward")
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
    return 0
