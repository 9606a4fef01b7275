"""`python -m lightning_pipedream simulate`: predicted step time, bubble and stored activations of a schedule."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from lightning_pipedream.cli.show import UsageError, add_schedule_arguments, comma_separated, schedule_of, size_text
from lightning_pipedream.schedule.actions import Schedule
from lightning_pipedream.schedule.simulate import SimResult, per_stage, simulate
from lightning_pipedream.schedule.timeline import plot_timeline, to_chrome_trace


def _numbers(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number or comma-separated numbers such as 1.0,2.5, got {text!r}"
        ) from None
    if any(v < 0 or math.isnan(v) for v in values):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return values


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0 (bytes per second; 'inf' for free links), got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    costs = parser.add_argument_group("costs (seconds per micro-batch; one value, or one per stage: 1,1.5,1,1)")
    costs.add_argument("--forward", type=_numbers, help="forward seconds per stage (default: 1.0)")
    costs.add_argument("--backward", type=_numbers, help="backward seconds per stage (default: twice the forward)")
    costs.add_argument("--activation-bytes", type=_numbers, help="bytes each stage sends forward (default: 0)")
    costs.add_argument("--optimizer", type=float, default=0.0, help="seconds per optimizer step (default: 0)")
    costs.add_argument(
        "--weight",
        type=_numbers,
        help="zb-h1: seconds of the backward's weight-gradient half per stage (default: half the backward)",
    )
    costs.add_argument(
        "--recompute", action="store_true", help="activation recomputation: each backward replays its forward"
    )
    costs.add_argument(
        "--parameter-bytes",
        type=_numbers,
        help="with --replicas: each stage's parameter bytes, all-reduced among its replicas (default: 0)",
    )
    costs.add_argument(
        "--profile", type=Path, help="per-layer profile JSON (plan/profile.py) instead of --forward/--backward"
    )
    costs.add_argument(
        "--balance", help="with --profile: layers per stage, e.g. 3,2,2,3 (default: as equal as possible)"
    )
    links = parser.add_argument_group("links")
    links.add_argument("--bandwidth", type=_positive, default=math.inf, help="bytes per second (default: inf)")
    links.add_argument("--latency", type=float, default=0.0, help="seconds per message (default: 0)")
    links.add_argument(
        "--allreduce-bandwidth",
        type=_positive,
        help="bytes per second of the replicas' gradient all-reduce (default: --bandwidth)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the prediction as JSON")
    out.add_argument("--plot", type=Path, help="write a PNG timeline here")
    out.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace JSON here")


def _per_stage(flag: str, values: list[float] | None, stages: int, default: list[float]) -> list[float]:
    if values is None:
        return default
    try:
        return per_stage(flag, values if len(values) > 1 else values[0], stages)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _split(balance: str | None, layers: int, stages: int) -> list[int]:
    """Layers per stage: the user's --balance, checked, or an equal split (earlier stages take the remainder)."""
    if balance is None:
        if layers < stages:
            raise UsageError(
                f"the profile has {layers} layers, fewer than --stages {stages}; use at most {layers} stages."
            )
        return [layers // stages + (s < layers % stages) for s in range(stages)]
    counts = comma_separated(balance, int, "--balance", "whole numbers separated by commas, such as 3,2,2,3")
    if len(counts) != stages:
        raise UsageError(
            f"--balance lists {len(counts)} stages but --stages is {stages}; give one layer count per stage."
        )
    if any(c < 1 for c in counts) or sum(counts) != layers:
        raise UsageError(f"--balance {balance} must be counts >= 1 adding up to the profile's {layers} layers.")
    return counts


def _profile_costs(args: argparse.Namespace, schedule: Schedule) -> tuple[list[float], list[float], list[float], str]:
    if args.forward is not None or args.backward is not None or args.activation_bytes is not None:
        raise UsageError("give either --profile or --forward/--backward/--activation-bytes, not both.")
    from lightning_pipedream.plan.profile import Profile  # imported here: only --profile needs torch

    try:
        layers = Profile.load(args.profile).layers
    except (OSError, ValueError, KeyError) as err:
        raise UsageError(
            f"could not read the profile {args.profile}: {err}. Write one with `python -m lightning_pipedream plan`."
        ) from None
    counts = _split(args.balance, len(layers), schedule.num_stages)
    # A profile times whole batches; flushed schedules split each batch into --chunks micro-batches,
    # assumed to cost 1/chunks each. PipeDream runs one whole batch (minibatch) per step.
    scale = 1.0 / schedule.chunks
    fwd, bwd, act, start = [], [], [], 0
    for count in counts:
        stage = layers[start : start + count]
        fwd.append(scale * sum(layer.forward_s for layer in stage))
        bwd.append(scale * sum(layer.backward_s for layer in stage))
        act.append(scale * stage[-1].activation_bytes)
        start += count
    note = f"profile {args.profile}: layers per stage {','.join(map(str, counts))}"
    if scale != 1.0:
        note += f"; batch times split over {schedule.chunks} micro-batches"
    return fwd, bwd, act, note


def analytic_bubble(
    name: str, stages: int, chunks: int, *, virtual_stages: int = 1, forward: float = 1.0, backward: float = 2.0,
    weight: float | None = None,
) -> tuple[float, str] | None:
    """The bubble fraction theory gives for equal stages and free links, and its formula; None if none applies.

    gpipe, 1f1b: (p-1)/(m+p-1). interleaved (m a multiple of p): (p-1)/v over m + (p-1)/v. zb-h1
    (m >= p): (p-1)(F+B-W) over m(F+B+W) + (p-1)(F+B-W), B the input-gradient half.
    """
    p, m, v = stages, chunks, virtual_stages
    if name in ("gpipe", "1f1b") or (name == "interleaved" and v == 1):
        return (p - 1) / (m + p - 1), "(p-1)/(m+p-1)"
    if name == "interleaved" and m % p == 0:
        return ((p - 1) / v) / (m + (p - 1) / v), "((p-1)/v)/(m+(p-1)/v)"
    if name == "zb-h1" and m >= p:
        w = backward / 2 if weight is None else weight
        idle = (p - 1) * (forward + backward - 2 * w)
        return idle / (m * (forward + backward) + idle), "(p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W))"
    return None


def _report(
    schedule: Schedule, args: argparse.Namespace, result: SimResult, fwd: list[float], bwd: list[float], note: str
) -> str:
    fmt = lambda xs: ", ".join(f"{x:g}" for x in xs)  # noqa: E731
    lines = [f"{args.schedule} schedule, {size_text(schedule)}"]
    lines.append(f"  forward s:  {fmt(fwd)}\n  backward s: {fmt(bwd)}")
    lines.append(
        f"  links: bandwidth {args.bandwidth:g} B/s, latency {args.latency:g} s" + (f"\n  {note}" if note else "")
    )
    if result.steady_state:
        lines.append(f"step time         {result.step_time:.6g} s per minibatch (steady state)")
        lines.append(
            f"makespan          {result.makespan:.6g} s for all {schedule.minibatches} minibatches, "
            "fill and drain included"
        )
    else:
        lines.append(f"step time         {result.step_time:.6g} s")
        if result.step_time != result.makespan:
            lines.append(f"makespan          {result.makespan:.6g} s (too few minibatches for a steady state)")
    bubble = f"bubble fraction   {result.bubble_fraction:.4f}"
    analytic = _analytic(args, schedule, fwd, bwd)
    if analytic is not None:
        bubble += f"   (analytic {analytic[1]} = {analytic[0]:.4f}, for equal stages and free links)"
    lines.append(bubble)
    what = "micro-batch chunks stored, per rank" if schedule.virtual_stages > 1 else "micro-batches stored, per rank"
    if args.recompute:
        what += "; with recompute only their stage inputs, each backward replaying its forward"
    lines.append(f"peak activations  {' '.join(map(str, result.peak_activations))}   ({what})")
    return "\n".join(lines)


def _analytic(
    args: argparse.Namespace, schedule: Schedule, fwd: list[float], bwd: list[float]
) -> tuple[float, str] | None:
    if schedule.replicas is not None or args.recompute or len(set(fwd)) > 1 or len(set(bwd)) > 1:
        return None
    weight = None if args.weight is None or len(set(args.weight)) > 1 else args.weight[0]
    return analytic_bubble(
        args.schedule, schedule.num_ranks, schedule.chunks, virtual_stages=schedule.virtual_stages,
        forward=fwd[0], backward=bwd[0], weight=weight,
    )


def _costs(args: argparse.Namespace, schedule: Schedule) -> tuple[list[float], list[float], list[float], str]:
    """Per-stage forward and backward seconds, activation bytes, and a note on where they came from."""
    if not (0 <= args.latency < math.inf and 0 <= args.optimizer < math.inf):
        raise UsageError(
            f"--latency and --optimizer are seconds and must be >= 0 and finite, got {args.latency:g} and "
            f"{args.optimizer:g}."
        )
    if args.profile is not None:
        return _profile_costs(args, schedule)
    if args.balance is not None:
        raise UsageError("--balance splits the layers of a --profile; give --profile too, or drop --balance.")
    n = schedule.num_stages  # interleaved: one value per stage of the model (ranks x chunks), or one for all
    fwd = _per_stage("--forward", args.forward, n, [1.0 / schedule.virtual_stages] * n)
    bwd = _per_stage("--backward", args.backward, n, [2 * f for f in fwd])
    act = _per_stage("--activation-bytes", args.activation_bytes, n, [0.0] * n)
    v = schedule.virtual_stages
    return fwd, bwd, act, f"each of the {n} stages: 1/{v} of a rank's work" if v > 1 else ""


def run(args: argparse.Namespace) -> int:
    try:
        schedule = schedule_of(args)
        fwd, bwd, act, note = _costs(args, schedule)
        params = _per_stage("--parameter-bytes", args.parameter_bytes, schedule.num_stages, [0.0] * schedule.num_stages)
        weight = None if args.weight is None else _per_stage("--weight", args.weight, schedule.num_stages, [])
        if weight is not None and not schedule.splits_backward:
            raise UsageError(f"--weight times the split backward of zb-h1; {args.schedule} runs whole backwards.")
        if weight is not None and any(w > b for w, b in zip(weight, bwd)):
            raise UsageError(f"--weight {','.join(f'{w:g}' for w in weight)} must not exceed the backward's seconds.")
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = simulate(
        schedule,
        fwd,
        bwd,
        activation_bytes=act,
        bandwidth=args.bandwidth,
        latency=args.latency,
        optimizer_s=args.optimizer,
        parameter_bytes=params,
        allreduce_bandwidth=args.allreduce_bandwidth,
        weight_s=weight,
        recompute=args.recompute,
    )
    size = schedule.minibatches if schedule.name == "pipedream" else schedule.chunks
    if args.plot:
        plot_timeline(result.events, args.plot, title=f"{args.schedule}, {args.stages} stages x {size}")
    if args.trace:
        args.trace.parent.mkdir(parents=True, exist_ok=True)
        args.trace.write_text(json.dumps(to_chrome_trace(result.events)))
    if args.json:
        analytic = _analytic(args, schedule, fwd, bwd)
        out = result.summary() | {
            "analytic_bubble_fraction": None if analytic is None else analytic[0],
            "virtual_stages": schedule.virtual_stages,
            "recompute": args.recompute,
            "replicas": None if schedule.replicas is None else list(schedule.replicas),
            "parameter_bytes": params,
            "forward_s": fwd,
            "backward_s": bwd,
            "activation_bytes": act,
            "bandwidth": None if math.isinf(args.bandwidth) else args.bandwidth,
            "latency": args.latency,
        }
        print(json.dumps(out, indent=2))
    else:
        print(_report(schedule, args, result, fwd, bwd, note))
    return 0
