"""`python -m lightning_pipedream reproduce-table`: PipeDream's Table 1 (SOSP'19) predicted from published profiles."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_pipedream.cli.show import UsageError


@dataclass(frozen=True)
class Cluster:
    """One of the paper's clusters: GPUs per server, and bytes/s (one direction) within and between servers."""

    name: str
    gpus_per_server: int
    within: float
    between: float
    hardware: str


# The paper's section 5.1; link speeds are nominal one-direction figures (see docs/reproduction.md).
CLUSTERS = {
    "A": Cluster("A", 4, 16e9, 10e9 / 8, "4 V100 per server, PCIe 3.0 x16 within (16 GB/s), 10 Gbit/s Ethernet"),
    "B": Cluster("B", 8, 25e9, 25e9 / 8, "8 V100 per server, NVLink within (25 GB/s per link), 25 Gbit/s Ethernet"),
    "C": Cluster("C", 1, 40e9 / 8, 40e9 / 8, "1 Titan X per server, 40 Gbit/s Ethernet"),
}


@dataclass(frozen=True)
class PaperRow:
    """A row of the paper's Table 1: the model's profile folder, cluster and servers, and what the paper reports."""

    model: str
    cluster: str
    servers: int
    configuration: str  # as the paper writes it: "15-1", "straight", "16" (data parallelism)
    speedup_epoch_time: float  # PipeDream over data parallelism, per epoch (throughput)
    speedup_time_to_accuracy: float | None  # None: the paper trained AlexNet on synthetic data, no accuracy target


# Table 1 of the paper, the rows whose model has a published profile (AWD LM and S2VT, the only row on cluster C,
# have none).
PAPER_ROWS = [
    PaperRow("vgg16", "A", 4, "15-1", 5.28, 5.28),
    PaperRow("vgg16", "B", 2, "15-1", 2.98, 2.46),
    PaperRow("resnet50", "A", 4, "16", 1.0, 1.0),
    PaperRow("resnet50", "B", 2, "16", 1.0, 1.0),
    PaperRow("alexnet", "A", 4, "15-1", 4.92, None),
    PaperRow("alexnet", "B", 2, "15-1", 2.04, None),
    PaperRow("gnmt16", "A", 1, "straight", 1.46, 2.2),
    PaperRow("gnmt16", "A", 4, "straight", 2.34, 2.92),
    PaperRow("gnmt16", "B", 2, "straight", 3.14, 3.14),
    PaperRow("gnmt8", "A", 1, "straight", 1.5, 1.5),
    PaperRow("gnmt8", "A", 3, "straight", 2.95, 2.95),
    PaperRow("gnmt8", "B", 2, "16", 1.0, 1.0),
]

TOPOLOGIES = ("flat", "levels")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profiles", type=Path, required=True, help="folder of PipeDream profiles: <model>/graph.txt per model"
    )
    parser.add_argument("--json", type=Path, help='also write the rows here as {"rows": [...]}')
    parser.add_argument(
        "--cost-model",
        default="paper",
        help="'paper' (default: max of compute and all-reduce, as the paper's text), 'code' (PipeDream's "
        "optimizer), or both: paper,code",
    )
    parser.add_argument(
        "--topology",
        default="flat",
        help="'flat' (default: all workers on one level at the slowest link they use), 'levels' (servers of "
        "GPUs, PipeDream's hierarchical programme), or both: flat,levels",
    )


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    wrong = [v for v in values if v not in allowed]
    if not values or wrong:
        raise UsageError(
            f"{flag} {text!r}: choose {' or '.join(allowed)}, or several separated by commas "
            f"(e.g. {','.join(allowed)})."
        )
    return values


def paper_configuration(replicas: list[int]) -> str:
    """A configuration as the paper writes it: "16" for one replicated stage, "straight" for one worker per stage
    (and more than one stage), otherwise the replicas per stage joined by dashes, "15-1"."""
    if len(replicas) == 1:
        return str(replicas[0])
    if all(r == 1 for r in replicas):
        return "straight"
    return "-".join(str(r) for r in replicas)


def cluster_topology(cluster: Cluster, servers: int, topology: str) -> Any:
    """The planner's Topology for ``servers`` servers of ``cluster``: one level at the slowest link the workers use
    ("flat"), or a level per server and one between servers ("levels")."""
    from lightning_pipedream.plan.topology import Topology

    if topology == "flat":
        return Topology.flat(servers * cluster.gpus_per_server, cluster.between if servers > 1 else cluster.within)
    levels = [(cluster.gpus_per_server, cluster.within)] + ([(servers, cluster.between)] if servers > 1 else [])
    return Topology(levels)


def simulate_stages(stages: list[dict[str, float]], bandwidth: float) -> tuple[float, bool]:
    """Seconds per minibatch of PipeDream's 1F1B(-RR) schedule on these stages in the schedule simulator, and
    whether it reached a steady state. Each stage: forward_s and backward_s of one whole minibatch on one
    worker, output_bytes, parameter_bytes, replicas.

    Activations cross links at ``bandwidth``; the all-reduce among a stage's replicas at ``bandwidth / 2``,
    so that its time, 4 (r-1)/r x parameter bytes / bandwidth, is the planner's (PipeDream's) figure."""
    from lightning_pipedream.schedule.builders import build_schedule
    from lightning_pipedream.schedule.simulate import simulate

    replicas = [int(s["replicas"]) for s in stages]
    steps = 4 * len(stages) + 8
    for _ in range(3):  # deep pipelines need more minibatches before two full steps are seen
        schedule = build_schedule(
            "pipedream", len(stages), minibatches=steps, replicas=replicas if max(replicas) > 1 else None
        )
        result = simulate(
            schedule,
            [s["forward_s"] for s in stages],
            [s["backward_s"] for s in stages],
            activation_bytes=[s["output_bytes"] for s in stages],
            bandwidth=bandwidth,
            parameter_bytes=[s["parameter_bytes"] for s in stages],
            allreduce_bandwidth=bandwidth / 2,
        )
        if result.steady_state:
            break
        steps *= 2
    return result.step_time / replicas[0], result.steady_state  # a step admits one minibatch per input replica


def _plan_stages(plan: Any) -> list[dict[str, float]]:
    # StagePlan's times are per replica (a replica sees 1/r of the minibatches); the simulator wants one minibatch.
    return [
        {
            "forward_s": s.forward_s * s.replicas,
            "backward_s": (s.compute_s - s.forward_s) * s.replicas,
            "output_bytes": s.output_bytes,
            "parameter_bytes": s.parameter_bytes,
            "replicas": s.replicas,
        }
        for s in plan.stages
    ]


def _paper_configuration_time(
    profile: Any, topology: Any, row: PaperRow, workers: int, cost_model: str
) -> float | None:
    """Our cost model's time for the paper's configuration, with the best stage boundaries for it (None where the
    topology's programme cannot express it, e.g. 15-1 across servers of 4)."""
    from lightning_pipedream.plan.partition import configuration_time, data_parallel_time, partition

    if row.configuration == str(workers):
        return data_parallel_time(profile, topology, cost_model)
    if row.configuration == "straight":
        if len(profile.layers) - len(profile.no_cut_after) < workers:
            return None
        return partition(profile, topology, straight=True, cost_model=cost_model).time_per_minibatch
    if len(topology.levels) != 1:
        return None
    return configuration_time(profile, topology, [int(r) for r in row.configuration.split("-")], cost_model)


def table_row(profile: Any, row: PaperRow, cost_model: str, topology_kind: str) -> dict[str, Any]:
    """Plan, price and simulate one row of the paper's table."""
    from lightning_pipedream.plan.partition import partition

    cluster = CLUSTERS[row.cluster]
    topology = cluster_topology(cluster, row.servers, topology_kind)
    workers = topology.num_workers
    plan = partition(profile, topology, cost_model=cost_model)
    replicas = [s.replicas for s in plan.stages]
    simulated = simulated_dp = steady = None
    if len(topology.levels) == 1:  # the simulator has one link speed: plans over two levels are not simulated
        bandwidth = topology.levels[0][1]
        simulated, steady = simulate_stages(_plan_stages(plan), bandwidth)
        layers = profile.layers
        whole = {
            "forward_s": sum(l.forward_s for l in layers),
            "backward_s": sum(l.backward_s for l in layers),
            "output_bytes": 0,
            "parameter_bytes": sum(l.parameter_bytes for l in layers),
            "replicas": workers,
        }
        simulated_dp, _ = simulate_stages([whole], bandwidth)
    paper_s = _paper_configuration_time(profile, topology, row, workers, cost_model)
    return {
        "model": row.model,
        "cluster": row.cluster,
        "workers": workers,
        "servers": f"{row.servers}x{cluster.gpus_per_server}",
        "configuration": paper_configuration(replicas),
        "pipedream_s": plan.time_per_minibatch,
        "data_parallel_s": plan.data_parallel_time,
        "speedup": plan.data_parallel_time / plan.time_per_minibatch,
        "replicas": replicas,
        "stage_ends": [s.layers[-1] for s in plan.stages[:-1]],
        "cost_model": cost_model,
        "topology": topology.to_json(),
        "topology_kind": topology_kind,
        "simulated_pipedream_s": simulated,
        "simulated_data_parallel_s": simulated_dp,
        "simulated_speedup": None if simulated is None else simulated_dp / simulated,
        "simulated_steady_state": steady,
        "paper": {
            "configuration": row.configuration,
            "speedup_epoch_time": row.speedup_epoch_time,
            "speedup_time_to_accuracy": row.speedup_time_to_accuracy,
        },
        "paper_configuration_s": paper_s,
        "paper_configuration_speedup": None if paper_s is None else plan.data_parallel_time / paper_s,
    }


def reproduce(profiles: Path, cost_models: list[str], topologies: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows for every paper row whose ``profiles/<model>/graph.txt`` exists, and the models skipped."""
    from lightning_pipedream.plan.profile import load_pipedream_graph

    if not profiles.is_dir():
        raise UsageError(
            f"--profiles {profiles} is not a folder; give the folder that holds PipeDream's profiles as "
            "<model>/graph.txt (e.g. ../shared/pipedream-profiles)."
        )
    models = list(dict.fromkeys(row.model for row in PAPER_ROWS))
    found = {m: profiles / m / "graph.txt" for m in models if (profiles / m / "graph.txt").is_file()}
    if not found:
        raise UsageError(
            f"--profiles {profiles} has none of the paper's profiles; expected <model>/graph.txt for "
            f"{', '.join(models)}."
        )
    loaded = {m: load_pipedream_graph(path) for m, path in found.items()}
    rows = [
        table_row(loaded[row.model], row, cost_model, topology)
        for cost_model in cost_models
        for topology in topologies
        for row in PAPER_ROWS
        if row.model in loaded
    ]
    return rows, [m for m in models if m not in found]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.1f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows for people: ours beside the paper's, one line each."""
    header = (
        "model",
        "cluster",
        "servers",
        "cost",
        "topology",
        "ours",
        "ms",
        "DP ms",
        "speedup",
        "sim. speedup",
        "paper",
        "paper's config ms",
        "paper speedup",
    )
    lines = [header]
    for r in rows:
        lines.append(
            (
                r["model"],
                r["cluster"],
                r["servers"],
                r["cost_model"],
                r["topology_kind"],
                r["configuration"],
                _ms(r["pipedream_s"]),
                _ms(r["data_parallel_s"]),
                f"{r['speedup']:.2f}x",
                "-" if r["simulated_speedup"] is None else f"{r['simulated_speedup']:.2f}x",
                r["paper"]["configuration"],
                _ms(r["paper_configuration_s"]),
                f"{r['paper']['speedup_epoch_time']:g}x",
            )
        )
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def run(args: argparse.Namespace) -> int:
    cost_models = _choices(args.cost_model, ("paper", "code"), "--cost-model")
    topologies = _choices(args.topology, TOPOLOGIES, "--topology")
    rows, skipped = reproduce(args.profiles, cost_models, topologies)
    print(format_table(rows))
    if skipped:
        print(f"skipped (no <model>/graph.txt in {args.profiles}): {', '.join(skipped)}", file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0
