"""What the always-on time accounting costs, and whether its bubble is the one the schedules should have.

Run from the repository root::

    python -m benchmarks.speed.observability                      # ~5 min on 2 quiet cores: results/observability.json
    python -m benchmarks.speed.observability --quick --json /tmp/q.json
    python -m benchmarks.speed.observability --model sleep --sleep-ms 10 --append "load 5"  # observability_sleep.json

Each case runs the runtime's ``Pipeline`` (no Lightning) on P CPU processes (gloo, shared memory), a balanced MLP of
``4 x P`` blocks Linear(512, 512) + Tanh, batches of 64 in M = 8 micro-batches, one thread per process. Within one
set of processes it alternates blocks of steps in three modes, rotating their order each round, so that the
machine's swings hit them alike:

- ``off``: the accounts never open a step (each action still makes the call, which returns at once: the floor this
  measures against is "the accounting compiled in but idle");
- ``on``: the accounts open and close every step (what every fit does: PipeDreamStrategy's default);
- ``trace``: ``on`` plus the executor's records (what ``trace=`` keeps for the merged timeline);
- ``memory``: ``trace`` plus the live tensor bytes' meter entered around every step (what ``trace_memory=True`` adds for
  ``pipeline/stage{k}/peak_live_mb``: ``strategy/reporting/live_memory.py``).

``--model sleep`` swaps the MLP for blocks whose forward, input-gradient and weight-gradient passes each sleep (a
stage's pass ``--sleep-ms`` in all): a pipeline balanced in time whose processes do not crowd the cores, the model on
which the measured bubble is compared with ``(P-1)/(M+P-1)`` and the simulator (4 processes computing on 2 cores wait
for peers the kernel has descheduled, and the MLP's first and last stages differ in time: no input gradient, the
loss).

Figures: the accounting's cost per action timed alone (``StepAccounts.action`` against an empty call), and from
it its estimated share of each case's step; per mode the median over rounds of seconds per step (the slowest
rank's), the paired ratios ``on/off``, ``trace/on`` and ``memory/trace``; the measured bubble (all ranks' waiting over
their step time) beside ``(P-1)/(M+P-1)`` (gpipe, 1f1b), the schedule simulator's at equal stages, and the
simulator's at the run's own action times (each stage's median F, B and W in the traced blocks), and that again with
the run's messages (each send's host time added to the pass that sends, every message arriving the median receive's
transfer after it left), for gpipe, 1f1b, interleaved (2 stages per process) and zb-h1; and with one stage made 2x
slower (a
layer that sleeps as long as the stage computes), each stage's waiting against the balanced run's, the share of
the extra waiting that falls on the other stages, and the stage the figures name as the slowest (largest compute).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
MODES = ("off", "on", "trace", "memory")


class _SleepThrough(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in the forward and ``backward_s`` in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:  # type: ignore[override]
        ctx.backward_s = backward_s
        if forward_s:
            time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.backward_s:
            time.sleep(ctx.backward_s)
        return grad, None, None


class SleepBlock(nn.Module):
    """A block whose forward, input-gradient and weight-gradient passes each sleep ``seconds``: a pipeline balanced
    in time, whose processes leave the cores to each other (4 processes on 2 cores do not slow each other down).

    ``Linear(width, width)`` on a weight passed through a sleeping identity, then a sleeping identity on the
    activations: the plain backward runs both sleeps; a split backward's input half runs the activations' (B)
    and its weight half, starting where the graph branches to the weight, the weight's (W).
    """

    def __init__(self, width: int, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _SleepThrough.apply(self.linear.weight, 0.0, self.seconds)
        h = nn.functional.linear(x, weight, self.linear.bias)
        return _SleepThrough.apply(h, self.seconds, self.seconds)


class Sleep(nn.Module):
    """Sleeps ``seconds`` in its forward (and nothing in its backward): a stage made slower."""

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds:
            time.sleep(self.seconds)
        return x


def _rank(rank: int, world: int, spec: dict, init: str, out: str) -> None:
    from lightning_pipedream.runtime.pipeline import Pipeline
    from lightning_pipedream.strategy.reporting.live_memory import WindowMemory, stage_tensors

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    virtual = spec.get("virtual_stages", 1)  # interleaved: each process holds that many stages of 4 / virtual blocks
    width, blocks = spec["width"], 4 // virtual
    layers: list[nn.Module] = []
    balance = []
    for _ in range(world * virtual):
        if spec.get("model") == "sleep":  # each pass of a stage sleeps sleep_ms, split among its blocks
            stage = [SleepBlock(width, spec["sleep_ms"] * 1e-3 / virtual / blocks) for _ in range(blocks)]
        else:
            stage = [m for _ in range(blocks) for m in (nn.Linear(width, width), nn.Tanh())]
        layers += stage + [Sleep()]
        balance.append(len(stage) + 1)
    pipe = Pipeline(nn.Sequential(*layers), loss_fn=nn.functional.mse_loss,
                    optimizer=lambda p: torch.optim.SGD(p, lr=1e-4), balance=balance, schedule=spec["schedule"],
                    chunks=spec["chunks"], virtual_stages=virtual)
    sleeper = next(m for m in pipe.engine.stage.module.modules() if isinstance(m, Sleep))
    x, y = torch.randn(64, width), torch.randn(64, width)
    accounts = pipe.engine.accounts
    executor = pipe.engine.executor

    def block(mode: str, steps: int) -> dict:
        executor.record = mode in ("trace", "memory")
        accounts.take()
        memory = None
        if mode == "memory":
            memory = WindowMemory(stage_tensors([pipe.module], lambda: [pipe.optimizer],
                                                pipe.engine.weights), 0, None, 0)
        dist.barrier()
        began = time.perf_counter()
        for k in range(steps):
            if mode != "off":
                accounts.begin_step()
            if memory is not None:
                memory.begin_step(k)
            pipe.step(x, y)
            if memory is not None:
                memory.end_step()
            if mode != "off":
                accounts.end_step()
        seconds = time.perf_counter() - began
        if mode != "off":
            accounts.finish()
        # The traced blocks' actions, by kind and stage: the simulator is also run at the times this run's actions took
        # (a first stage's B is almost free, its input needing no gradient, so stages differ by kind).
        spans: dict[str, list[float]] = {}
        for (action, start, end), sent_at in zip(executor.records, executor.sent_at):
            if action.op.value in ("F", "B", "W", "O", "SA", "SG"):
                spans.setdefault(f"{action.op.value}{action.stage}", []).append(end - start)
            elif action.op.is_recv and sent_at is not None:  # a receive's transfer: from the later of its start
                spans.setdefault("transfer", []).append(end - max(start, sent_at))  # and the send's, to its end
        executor.records.clear()
        executor.sent_at.clear()
        figures = accounts.take()
        return {"seconds": seconds, "compute": figures.compute, "wait": figures.wait, "step": figures.step,
                "transfer": figures.transfer,
                "action_s": {key: statistics.median(v) for key, v in spans.items()}}

    for _ in range(2):  # warm-up
        pipe.step(x, y)
    results: dict = {"rounds": []}
    for r in range(spec["rounds"]):
        order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
        results["rounds"].append({mode: block(mode, spec["steps"]) for mode in order})
    # The slow stage: its sleeping layer sleeps as long as the stage computes (measured in the "on" blocks).
    slow = spec["slow_stage"]
    if slow is not None:
        on = [rd["on"] for rd in results["rounds"]]
        per_step = statistics.median(o["compute"] for o in on) / spec["steps"]
        per_forward = per_step / 3 / spec["chunks"]  # forward ~ a third of forward + backward, per micro-batch
        share = torch.tensor([per_forward])
        dist.broadcast(share, src=slow)
        if rank == slow:
            sleeper.seconds = float(share) * 3  # the stage's whole work again, in its forwards
        results["slow"] = [block("on", spec["steps"]) for _ in range(spec["rounds"])]
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run_case(schedule: str, stages: int, spec: dict) -> dict:
    from lightning_pipedream.schedule.builders import build_schedule
    from lightning_pipedream.schedule.simulate import simulate

    spec = {**spec, "schedule": schedule}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_rank, args=(stages, spec, f"file://{tmp}/rendezvous", out), nprocs=stages, join=True)
        ranks = json.loads(Path(out).read_text())
    rounds = spec["rounds"]
    per_mode = {m: [max(ranks[k]["rounds"][r][m]["seconds"] for k in range(stages)) / spec["steps"]
                    for r in range(rounds)] for m in MODES}
    on_off = [per_mode["on"][r] / per_mode["off"][r] for r in range(rounds)]
    trace_on = [per_mode["trace"][r] / per_mode["on"][r] for r in range(rounds)]
    memory_trace = [per_mode["memory"][r] / per_mode["trace"][r] for r in range(rounds)]
    waits = [sum(ranks[k]["rounds"][r]["on"]["wait"] for k in range(stages)) for r in range(rounds)]
    steps = [sum(ranks[k]["rounds"][r]["on"]["step"] for k in range(stages)) for r in range(rounds)]
    m = spec["chunks"]
    virtual = spec.get("virtual_stages", 1)
    # Per stage of the schedule: an interleaved process's stages each hold 1 / virtual of its blocks. zb-h1 splits
    # each backward into its input half and its weight half (the simulator's default split of backward_s).
    sim = simulate(build_schedule(schedule, stages, m, virtual_stages=virtual), 1.0 / virtual,
                   2.0 / virtual).bubble_fraction
    # The simulator again, at the median time this run's traced actions of each kind took on each stage (over rounds).
    schedule_ir = build_schedule(schedule, stages, m, virtual_stages=virtual)
    traced = [ranks[k]["rounds"][r]["trace"]["action_s"] for k in range(stages) for r in range(rounds)]

    def measured(op: str) -> list[float] | None:
        times = [[t[f"{op}{s}"] for t in traced if f"{op}{s}" in t] for s in range(stages * virtual)]
        return [statistics.median(t) for t in times] if all(times) else None

    forward, backward, weight = measured("F"), measured("B"), measured("W")
    update = [statistics.median(t[key] for t in traced if key in t) for key in {k for t in traced for k in t}
              if key.startswith("O")]
    assert forward is not None and backward is not None, "a traced block without every stage's forward and backward"
    if weight is not None:  # the simulator's backward_s holds a split backward's W
        backward = [b + w for b, w in zip(backward, weight)]
    sim_measured = simulate(schedule_ir, forward, backward, weight_s=weight,
                            optimizer_s=max(update, default=0.0)).bubble_fraction
    # And with the run's messages: each send's host time added to the pass that sends (a forward sends its output,
    # an input-gradient pass its gradient), and every message arriving the median receive's transfer after it left.
    def sends(op: str) -> list[float]:  # a stage that sends none of this kind (the last's outputs): 0
        times = [[t[f"{op}{s}"] for t in traced if f"{op}{s}" in t] for s in range(stages * virtual)]
        return [statistics.median(t) if t else 0.0 for t in times]

    send_act, send_grad = sends("SA"), sends("SG")
    forward_sent = [f + sa for f, sa in zip(forward, send_act)]
    backward_sent = [b + sg for b, sg in zip(backward, send_grad)]
    transfers = [t["transfer"] for t in traced if "transfer" in t]
    latency = statistics.median(transfers) if transfers else 0.0
    sim_with_messages = simulate(schedule_ir, forward_sent, backward_sent, weight_s=weight, latency=latency,
                                 optimizer_s=max(update, default=0.0)).bubble_fraction
    case = {
        "schedule": schedule, "stages": stages, "chunks": m, "virtual_stages": virtual,
        "seconds_per_step": {mode: statistics.median(v) for mode, v in per_mode.items()},
        "on_over_off": statistics.median(on_off), "on_over_off_rounds": on_off,
        "trace_over_on": statistics.median(trace_on), "trace_over_on_rounds": trace_on,
        "memory_over_trace": statistics.median(memory_trace), "memory_over_trace_rounds": memory_trace,
        "bubble_measured": statistics.median(w / s for w, s in zip(waits, steps)),
        "bubble_closed_form": (stages - 1) / (m + stages - 1) if schedule in ("gpipe", "1f1b") else None,
        "bubble_simulated": sim,
        "bubble_simulated_at_measured_action_times": sim_measured,
        "bubble_simulated_at_measured_times_and_messages": sim_with_messages,
        "message_ms_measured": {"send_activation": [v * 1e3 for v in send_act],
                                "send_gradient": [v * 1e3 for v in send_grad],
                                "receive_transfer_median": latency * 1e3},
        "action_ms_measured": {"forward": [v * 1e3 for v in forward], "backward": [v * 1e3 for v in backward],
                               "weight": None if weight is None else [v * 1e3 for v in weight]},
        "wait_ms_per_stage": [statistics.median(ranks[k]["rounds"][r]["on"]["wait"] for r in range(rounds))
                              * 1e3 / spec["steps"] for k in range(stages)],
    }
    slow = spec["slow_stage"]
    if slow is not None:
        slowed = [statistics.median(b["wait"] for b in ranks[k]["slow"]) * 1e3 / spec["steps"] for k in range(stages)]
        compute = [statistics.median(b["compute"] for b in ranks[k]["slow"]) for k in range(stages)]
        extra = [s - b for s, b in zip(slowed, case["wait_ms_per_stage"])]
        total_extra = sum(e for e in extra if e > 0)
        case["slow_stage"] = {
            "stage": slow, "wait_ms_per_stage": slowed, "extra_wait_ms_per_stage": extra,
            "share_of_extra_wait_on_other_stages": (sum(e for k, e in enumerate(extra) if k != slow and e > 0)
                                                    / total_extra) if total_extra > 0 else None,
            "named_slowest": max(range(stages), key=lambda k: compute[k]),
        }
    return case


def action_cost_ns(calls: int = 200_000, repeats: int = 5) -> dict:
    """The accounting's own cost per action, timed in this process: ``StepAccounts.action`` for a receive (the
    longest path) in an open step, minus the same loop calling a function that returns at once. Median of repeats."""
    from lightning_pipedream.runtime.execution.accounts import StepAccounts
    from lightning_pipedream.schedule.actions import Op

    accounts = StepAccounts()
    accounts.begin_step()

    def nothing(op: Op, start: float, end: float, sent_at: float | None = None) -> None:
        return None

    def loop(fn) -> float:
        began = time.perf_counter()
        for _ in range(calls):
            fn(Op.RECV_ACT, 1.0, 2.0, 1.5)
        return (time.perf_counter() - began) / calls

    costs = [(loop(accounts.action) - loop(nothing)) * 1e9 for _ in range(repeats)]
    clock_ns = statistics.median(_clock_read() for _ in range(repeats)) * 1e9
    return {"action_ns": statistics.median(costs), "action_ns_rounds": costs, "clock_read_ns": clock_ns}


def _clock_read(calls: int = 200_000) -> float:
    began = time.perf_counter()
    for _ in range(calls):
        time.perf_counter()
    return (time.perf_counter() - began) / calls


def draw_merged_trace(trace_file: str | Path, png: str | Path, title: str = "") -> Path:
    """A PNG of a merged trace (``pipeline_trace.json``): per stage a measured row (compute coloured by kind, the
    waiting red, sends and receives grey) and under it the predicted row. For docs/reading_a_run.md."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    events = json.loads(Path(trace_file).read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    pids = sorted(names, key=lambda pid: (pid % 10_000, pid >= 10_000))
    colours = {"F": "#4C72B0", "B": "#DD8452", "W": "#C44E52", "O": "#55A868"}
    fig = Figure(figsize=(12, 0.55 * len(pids) + 1.3))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    row = {pid: len(pids) - 1 - i for i, pid in enumerate(pids)}
    for e in events:
        if e.get("ph") != "X" or e["pid"] not in row:
            continue
        left, width, y = e["ts"] / 1e3, e["dur"] / 1e3, row[e["pid"]]
        if e.get("cat") == "waiting":
            ax.barh(y - 0.3, width, left=left, height=0.2, color="#D62728")
        elif e.get("cat") in ("send", "receive"):
            ax.barh(y + 0.3, width, left=left, height=0.15, color="#999999")
        else:
            ax.barh(y, width, left=left, height=0.55, color=colours.get(e["name"][:1], "#777777"),
                    alpha=0.45 if e.get("cat") == "predicted" else 1.0, edgecolor="black", linewidth=0.3)
    ax.set_yticks([row[p] for p in pids], [names[p] for p in pids], fontsize=8)
    ax.set_xlabel("milliseconds")
    ax.set_title(title, fontsize=10)
    legend = [Patch(color=c, label=n) for n, c in (("forward", "#4C72B0"), ("backward", "#DD8452"),
                                                   ("update", "#55A868"), ("waiting", "#D62728"),
                                                   ("send / receive", "#999999"))]
    fig.legend(handles=legend, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.3 / fig.get_figheight(), 1, 1))
    fig.savefig(png, dpi=110)
    return Path(png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps and rounds: a smoke run")
    parser.add_argument("--json", help="where the results go (default results/observability.json, or "
                        "results/observability_sleep.json with --model sleep)")
    parser.add_argument("--stages", default="2,4", help="comma-separated process counts (default 2,4)")
    parser.add_argument("--model", choices=("mlp", "sleep"), default="mlp",
                        help="mlp: Linear(512, 512) + Tanh blocks that compute; sleep: blocks whose forward, "
                        "input-gradient and weight-gradient passes each sleep --sleep-ms per stage (balanced in time, "
                        "and 4 processes do not crowd 2 cores)")
    parser.add_argument("--sleep-ms", type=float, default=4.0, help="with --model sleep: each pass of a stage")
    parser.add_argument("--append", metavar="NOTE", help="add this run to --json's earlier runs (with NOTE: when, how "
                        "loaded) and write every run and their summary (per case, the median over runs)")
    args = parser.parse_args()
    sleep = args.model == "sleep"
    args.json = args.json or str(ROOT / "benchmarks" / "results" / (
        "observability_sleep.json" if sleep else "observability.json"))
    spec = {"width": 16 if sleep else 256 if args.quick else 512, "chunks": 8, "steps": 3 if args.quick else 10,
            "rounds": 3 if args.quick else 5, "slow_stage": None, "model": args.model,
            "sleep_ms": args.sleep_ms if sleep else None}
    load_before = os.getloadavg()
    cost = action_cost_ns()
    print(json.dumps(cost), flush=True)
    cases = []
    for stages in (int(s) for s in args.stages.split(",")):
        for schedule in ("gpipe", "1f1b"):
            slow = 1 if (schedule == "1f1b" and stages == 2) else None
            case = run_case(schedule, stages, {**spec, "slow_stage": slow})
            # The accounting's share of the step, from its cost per action (a flushed step: 2 M computes and up to
            # 4 M sends and receives per rank, the update, the sends' wait) and the step's time.
            actions = 6 * spec["chunks"] + 2
            case["accounting_share_of_step_estimated"] = (actions * cost["action_ns"] * 1e-9
                                                          / case["seconds_per_step"]["on"])
            cases.append(case)
            print(json.dumps({k: v for k, v in case.items() if not k.endswith("_rounds")}), flush=True)
        # The schedules whose bubble only the simulator gives (no closed form): measured against it.
        for schedule, virtual in (("interleaved", 2), ("zb-h1", 1)):
            case = run_case(schedule, stages, {**spec, "virtual_stages": virtual})
            cases.append(case)
            print(json.dumps({k: v for k, v in case.items() if not k.endswith("_rounds")}), flush=True)
    command = "python -m benchmarks.speed.observability" + (" --quick" if args.quick else "") + (
        f" --model sleep --sleep-ms {args.sleep_ms:g}" if sleep else "")
    result = {"command": command,
              "cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
              "spec": spec, "accounting_cost": cost, "cases": cases}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.append:  # one more run beside the file's earlier ones, and their summary again
        earlier = json.loads(path.read_text()) if path.exists() else {}
        runs = earlier.get("runs", [earlier] if earlier.get("cases") else []) + [
            dict(result, note=f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.append}")]
        path.write_text(json.dumps({"command": command + " --append NOTE (several runs)", "runs": runs,
                                    "summary": summarise(runs)}, indent=1))
    else:
        path.write_text(json.dumps(result, indent=1))
    print(f"written {args.json}")


def summarise(runs: list[dict]) -> list[dict]:
    """Per case, each run's measured bubble minus its reference, in points, and their median: ``(P-1)/(M+P-1)`` for
    gpipe and 1f1b, the simulator at the run's own action times for the others."""
    out = []
    for i, case in enumerate(runs[0]["cases"]):
        same = [r["cases"][i] for r in runs]
        closed = case["bubble_closed_form"] is not None
        ref = "closed_form" if closed else "simulated_at_measured_action_times"
        diffs = [c["bubble_measured"] - c[f"bubble_{ref}"] for c in same]
        out.append({"schedule": case["schedule"], "stages": case["stages"], "reference": ref,
                    "measured_minus_reference_points": [round(d * 100, 2) for d in diffs],
                    "median_points": round(statistics.median(diffs) * 100, 2),
                    "within_2_points_at_median": abs(statistics.median(diffs)) <= 0.02})
    return out


if __name__ == "__main__":
    main()
