"""`python -m lightning_pipedream plan`: partition a saved profile or a PipeDream graph.txt for a topology."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lightning_pipedream.cli.show import comma_separated
from lightning_pipedream.plan.auto import auto_plan
from lightning_pipedream.plan.memory import OPTIMIZER_STATE
from lightning_pipedream.plan.partition import COST_MODELS, METHODS, partition
from lightning_pipedream.plan.profile import Profile, load_pipedream_graph
from lightning_pipedream.plan.shards import SHARD_CHOICES
from lightning_pipedream.plan.topology import Topology
from lightning_pipedream.schedule.specs import SCHEDULES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", type=Path, help="a profile JSON saved by Profile.save (or a graph.txt)")
    source.add_argument("--pipedream-graph", type=Path, help="a PipeDream profile, graph.txt")
    source.add_argument(
        "--from-trace", type=Path, metavar="TRACE",
        help="plan again from a run: the merged trace of PipeDreamStrategy(trace=...) of a run the strategy planned; "
        "each layer takes its forward as the traced steps timed it, and its stage's measured compute (CUDA: each layer "
        "scaled by its stage's measured compute over the plan's; same stages, links, schedule); --save the result "
        "for PipeDreamStrategy(plan=...)",
    )
    parser.add_argument(
        "--workers",
        help="workers per level, innermost first, e.g. 4,4 (PipeDream's -n); required but with --from-trace",
    )
    parser.add_argument(
        "--bandwidth", help="bytes/s per level, innermost first, e.g. 1e10,1.25e9 (PipeDream's -b); required but with "
        "--from-trace"
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
    parser.add_argument(
        "--schedule",
        choices=("auto", *SCHEDULES),
        help="plan the whole configuration: 'auto' chooses the schedule too, a name keeps that schedule; the "
        "planner picks split, replicas, micro-batches and recompute within --memory (default: partition only)",
    )
    parser.add_argument("--exact", action="store_true", help="with --schedule auto: only schedules equal to one device")
    parser.add_argument(
        "--optimizer", choices=tuple(OPTIMIZER_STATE), default="adam",
        help="with --schedule: the optimizer's state per parameter (sgd none, momentum 1x, adam 2x; default adam)",
    )
    parser.add_argument("--max-chunks", type=int, default=16, help="with --schedule: most micro-batches per step")
    parser.add_argument(
        "--accumulate-grad-batches", type=int, default=1, metavar="N",
        help="with --schedule: the Trainer's accumulate_grad_batches; above 1 a step starts with the last one's "
             "gradients, which the memory model then counts at every moment (default 1: from the first backward on)",
    )
    parser.add_argument(
        "--shard", choices=SHARD_CHOICES, default="none",
        help="with --schedule: whether equal replicas of a flushed schedule (gpipe, 1f1b, zb-h1, interleaved) shard "
             "weights, gradients and optimizer state "
             "(FSDP2): none (whole copies, default), grad_op, full, or auto (shard only where whole replicas do "
             "not fit, or where it is faster; the plan says why)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="with --schedule: the memory model's device; cuda adds foreach optimizer temporaries, the "
                             "caching allocator's rounding and cuBLAS workspaces (default: cpu)")
    parser.add_argument("--cuda-capability", default="9.0",
                        help="with --device cuda: the GPU's compute capability, e.g. 8.0 (default: 9.0, Hopper)")
    parser.add_argument(
        "--overhead", type=float, default=0.0,
        help="with --schedule: seconds each micro-batch's forward and backward cost on top of the profile's share",
    )
    parser.add_argument("--save", type=Path, help="also write the plan here, for PipeDreamStrategy(plan=...)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    if args.from_trace is not None:
        return _run_from_trace(args)
    try:
        if args.workers is None or args.bandwidth is None:
            raise ValueError("--workers and --bandwidth are required with --profile and --pipedream-graph (e.g. "
                             "--workers 4 --bandwidth 1e9).")
        topology = parse_topology(args.workers, args.bandwidth)
        if args.free_side_sources and args.pipedream_graph is None:
            raise ValueError("--free-side-sources applies to --pipedream-graph only.")
        if args.pipedream_graph is not None:
            profile = load_pipedream_graph(args.pipedream_graph, attach_side_sources=not args.free_side_sources)
        else:
            profile = Profile.load(args.profile)
        if args.schedule is not None:
            return _run_auto(args, profile, topology)
        given = [flag for flag, used in (("--exact", args.exact), ("--optimizer", args.optimizer != "adam"),
                                         ("--max-chunks", args.max_chunks != 16), ("--overhead", args.overhead != 0.0),
                                         ("--device", args.device != "cpu"), ("--shard", args.shard != "none"),
                                         ("--accumulate-grad-batches", args.accumulate_grad_batches != 1))
                 if used]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(f"{', '.join(given)} {verb} to --schedule (auto or a name) only: add --schedule auto.")
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


def _run_from_trace(args: argparse.Namespace) -> int:
    """``--from-trace``: the run's plan, its profile scaled by the measured stage compute, partitioned again."""
    from lightning_pipedream.plan.explain import explain, from_trace, replan

    defaults = {"workers": None, "bandwidth": None, "memory": None, "straight": False, "method": "pipedream",
                "cost_model": "code", "free_side_sources": False, "schedule": None, "exact": False,
                "optimizer": "adam", "max_chunks": 16, "accumulate_grad_batches": 1, "shard": "none",
                "device": "cpu", "cuda_capability": "9.0", "overhead": 0.0}
    given = [f"--{name.replace('_', '-')}" for name, default in defaults.items() if getattr(args, name) != default]
    if given:
        print(f"error: --from-trace plans again for the run's own stages, links and schedule; {', '.join(given)} "
              "apply to --profile and --pipedream-graph. Drop them.", file=sys.stderr)
        return 2
    try:
        trace = json.loads(Path(args.from_trace).read_text())
    except json.JSONDecodeError as err:
        print(f"error: {args.from_trace} is not JSON ({err}); give the pipeline_trace.json that "
              "PipeDreamStrategy(trace=DIR) writes.", file=sys.stderr)
        return 2
    old, measured = from_trace(trace, str(args.from_trace))
    new = replan(old, measured)
    if args.save is not None:
        new.save(args.save)
    if args.json:
        print(json.dumps({"before": old.balance, "after": new.balance, "plan": new.to_json()}))
        return 0
    print(explain(old, measured).table())
    print()
    print(f"planned again from {args.from_trace}: layers per stage {old.balance} -> {new.balance}")
    print(new.describe(simulated=True))
    return 0


def _run_auto(args: argparse.Namespace, profile: Profile, topology: Topology) -> int:
    """``--schedule auto`` (or a name): the whole configuration within ``--memory``, and why."""
    if args.method != "pipedream" or args.straight or args.cost_model != "code":
        raise ValueError(
            "--method, --straight and --cost-model choose PipeDream's partition; with --schedule the planner "
            "chooses the split itself. Drop them, or drop --schedule."
        )
    schedules = None if args.schedule == "auto" else [args.schedule]
    result = auto_plan(
        profile, topology, args.memory, exact=args.exact, optimizer=args.optimizer, schedules=schedules,
        max_chunks=args.max_chunks, microbatch_overhead_s=args.overhead, device=args.device,
        cuda_capability=_capability(args.cuda_capability), shard=args.shard,
        gradients_carried=_accumulates(args.accumulate_grad_batches),
    )
    if args.save is not None:
        result.plan.save(args.save)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(f"{profile.source}: {len(profile.layers)} layers; {topology.describe()}")
        print(result.describe())
    return 0


def _accumulates(batches: int) -> bool:
    if batches < 1:
        raise ValueError(f"--accumulate-grad-batches must be a whole number >= 1 (the Trainer's "
                         f"accumulate_grad_batches), got {batches}.")
    return batches > 1


def parse_topology(workers: str, bandwidth: str) -> Topology:
    """From the CLI's comma-separated lists, e.g. ``"4,4"`` and ``"1e10,1.25e9"`` (innermost first)."""
    counts = comma_separated(workers, int, "--workers", "whole numbers separated by commas, e.g. 4,4", ValueError)
    speeds = comma_separated(bandwidth, float, "--bandwidth", "bytes/s separated by commas, e.g. 1e10,1.25e9",
                             ValueError)
    if len(counts) != len(speeds):
        raise ValueError(
            f"--workers lists {len(counts)} levels but --bandwidth lists {len(speeds)}; "
            "give one bandwidth per level, innermost first."
        )
    return Topology(list(zip(counts, speeds)))


def _capability(text: str) -> tuple[int, int]:
    """``"9.0"`` -> (9, 0): a compute capability as the memory model takes it."""
    try:
        major, minor = (int(part) for part in text.split("."))
    except ValueError:
        raise SystemExit(f"--cuda-capability {text!r} is not a compute capability such as 9.0 or 8.6.") from None
    return major, minor
