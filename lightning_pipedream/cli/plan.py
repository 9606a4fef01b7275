"""`python -m lightning_pipedream plan`: partition a saved profile or a PipeDream graph.txt for a topology."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lightning_pipedream.plan.partition import COST_MODELS, METHODS, partition
from lightning_pipedream.plan.profile import Profile, load_pipedream_graph
from lightning_pipedream.plan.topology import Topology


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", type=Path, help="a profile JSON saved by Profile.save (or a graph.txt)")
    source.add_argument("--pipedream-graph", type=Path, help="a PipeDream profile, graph.txt")
    parser.add_argument(
        "--workers", required=True, help="workers per level, innermost first, e.g. 4,4 (PipeDream's -n)"
    )
    parser.add_argument(
        "--bandwidth", required=True, help="bytes/s per level, innermost first, e.g. 1e10,1.25e9 (PipeDream's -b)"
    )
    parser.add_argument("--memory", type=float, help="memory limit per worker in bytes (default: none)")
    parser.add_argument("--straight", action="store_true", help="no stage replication: one worker per stage")
    parser.add_argument("--method", choices=METHODS, default="pipedream", help="partitioner (default: pipedream)")
    parser.add_argument(
        "--cost-model",
        choices=COST_MODELS,
        default="code",
        help="pipedream's cost model: 'code' as PipeDream's optimizer (default), 'paper' as its text",
    )
    parser.add_argument(
        "--free-side-sources",
        action="store_true",
        help="with --pipedream-graph: let layers fed only by other inputs (GNMT's decoder embedding) "
        "move to earlier stages, which PipeDream's optimizer does not",
    )
    parser.add_argument("--save", type=Path, help="also write the plan here, for PipeDreamStrategy(plan=...)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    try:
        topology = parse_topology(args.workers, args.bandwidth)
        if args.free_side_sources and args.pipedream_graph is None:
            raise ValueError("--free-side-sources applies to --pipedream-graph only.")
        if args.pipedream_graph is not None:
            profile = load_pipedream_graph(args.pipedream_graph, attach_side_sources=not args.free_side_sources)
        else:
            profile = Profile.load(args.profile)
        plan = partition(
            profile, topology, args.method, memory_limit=args.memory, straight=args.straight, cost_model=args.cost_model
        )
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.save is not None:
        plan.save(args.save)
    if args.json:
        print(json.dumps(plan.to_json()))
    else:
        print(f"{profile.source}: {len(profile.layers)} layers; {topology.describe()}")
        print(plan.describe(simulated=True))
    return 0


def parse_topology(workers: str, bandwidth: str) -> Topology:
    """From the CLI's comma-separated lists, e.g. ``"4,4"`` and ``"1e10,1.25e9"`` (innermost first)."""
    try:
        counts = [int(w) for w in workers.split(",")]
    except ValueError:
        raise ValueError(
            f"--workers must be whole numbers separated by commas, e.g. 4,4; got {workers!r}."
        ) from None
    try:
        speeds = [float(b) for b in bandwidth.split(",")]
    except ValueError:
        raise ValueError(
            f"--bandwidth must be bytes/s separated by commas, e.g. 1e10,1.25e9; got {bandwidth!r}."
        ) from None
    if len(counts) != len(speeds):
        raise ValueError(
            f"--workers lists {len(counts)} levels but --bandwidth lists {len(speeds)}; "
            "give one bandwidth per level, innermost first."
        )
    return Topology(list(zip(counts, speeds)))
