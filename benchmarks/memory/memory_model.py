"""The memory model measured against its predictions: every schedule, with and without recompute, per stage."""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common.proc_memory import status_kb, try_reset_peak_rss
from lightning_pipedream.plan.balance import even_balance
from lightning_pipedream.plan.live_bytes import LiveTensorBytes
from lightning_pipedream.plan.memory import flight_schedule, held_bytes, predict_memory, stage_bytes
from lightning_pipedream.plan.profile import Profile, profile_module
from lightning_pipedream.runtime.faults.launch import run_local
from lightning_pipedream.runtime.pipeline import Pipeline
from lightning_pipedream.schedule.specs import spec_of

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved", "pipedream", "2bw", "zb-v", "dualpipev")
STAGES = 2
VIRTUAL = 2  # model chunks per process under interleaved (and the V schedules' two)
OPTIMIZER = "adam"  # two state buffers per parameter: the optimizer term is visible


def build_model(name: str, width: int) -> nn.Sequential:
    """``mlp``: 4 x (Linear(w, 4w), ReLU, Linear(4w, w)); ``block``: 4 Transformer encoder layers (16 tokens)."""
    torch.manual_seed(0)
    if name == "mlp":
        layers: list[nn.Module] = []
        for _ in range(4):  # a stage ending in Linear(4w, w) hands on an output nobody on it saves
            layers += [nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width)]
        return nn.Sequential(*layers)
    if name == "block":
        return nn.Sequential(*[nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1, batch_first=True)
                               for _ in range(4)])
    raise ValueError(f"Unknown model {name!r}; use mlp or block.")


def make_batch(name: str, width: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (batch, width) if name == "mlp" else (batch, 16, width)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-4)


def _trim(run: dict) -> None:
    if run["quick"]:  # a full collection costs ~0.2 s a call, and --quick's RSS figures are rough anyway
        return
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _pipeline(run: dict) -> tuple[Pipeline, Any, Any]:
    model = build_model(run["model"], run["width"])
    pipe = Pipeline(model, loss_fn=nn.functional.mse_loss, optimizer=adam, schedule=run["schedule"],
                    chunks=run["chunks"], balance=run["balance"], recompute=run["recompute"],
                    virtual_stages=run["virtual_stages"])
    del model  # the other stages' layers: this rank keeps only its own
    x, y = make_batch(run["model"], run["width"], run["batch"])
    return pipe, (x if pipe.is_first else None), (y if pipe.is_last else None)  # each rank holds what it reads


def worker(rank: int, world: int, runs: list[dict]) -> list[dict]:
    """One rank: every configuration in turn, each measured on a fresh stage after a warm-up one."""
    return [_measure(run) for run in runs]


def _measure(run: dict) -> dict:
    schedule = run["schedule"]
    asynchronous = spec_of(schedule).asynchronous
    steps = run["steps"] + (STAGES if asynchronous else 0)  # pipedream, 2bw: fill the pipeline first
    # A first stage runs the same steps with the runtime's counter on (Stage.track_activations): its peak is (a).
    # It is thrown away: the counter's saved-tensor hooks keep zb-h1's retained graphs alive (+21 MiB a step on the
    # block model's last stage), so the whole-stage figures come from a second stage without it. The first run also
    # makes torch's code pages, gloo's buffers and the allocator's arenas resident (150 MB), so the baseline below
    # holds them and not the model's tensors.
    with LiveTensorBytes():  # the meter's own code is warmed up too
        pipe, x, y = _pipeline(run)
        pipe.engine.track_activations()
        stages = list(pipe.engine.stages.values())
        counted = {"peak": 0}

        def after_forward(forward: Callable) -> Callable:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                out = forward(*args, **kwargs)
                # the rank's live count over all its chunks at once (engine.activation_bytes sums each chunk's peak)
                counted["peak"] = max(counted["peak"], sum(s.activation_bytes for s in stages))
                return out
            return wrapped

        for stage in stages:
            stage.forward = after_forward(stage.forward)  # type: ignore[method-assign]
        for _ in range(steps):
            pipe.step(x, y)
        pipe.drain()
    stages.clear()  # the thrown-away stage's last references
    del pipe, x, y
    _trim(run)
    measured = metered_run(lambda: _pipeline(run), steps, run["quick"])
    measured["peak_activation_bytes"] = counted["peak"]  # the runtime's own count, from the thrown-away stage
    return measured


def metered_run(build: Callable[[], tuple[Pipeline, Any, Any]], steps: int, quick: bool) -> dict:
    """Build a stage with ``build`` (pipeline, inputs, targets) and train it ``steps`` steps (then drain) under
    :class:`LiveTensorBytes`: its peak live tensor bytes and the phase at the peak, its RSS, and the terms measured
    (weights, gradients, optimizer state, weight versions). The meter counts the calling thread's tensors only (a
    dispatch mode is per thread), so ranks run as threads of one process are measured apart
    (``benchmarks/memory/gpu_check.py``); the RSS figures are the whole process's."""
    run = {"quick": quick}
    rss_base = status_kb("VmRSS")
    meter = LiveTensorBytes()
    with meter:
        pipe, x, y = build()
    for t in (*pipe.module.parameters(), x, y):  # made before the meter could see them (parameters: by the model)
        if t is not None:
            meter.add(t)
    _trim(run)
    rss_ready = status_kb("VmRSS")
    meter.reset_peak()  # the full model's construction is not part of training's peak
    reset = try_reset_peak_rss()
    weights = pipe.engine.weights
    peaks = {"activations": 0, "versions": 1, "gradients": 0}  # activations: what the caller counted, if it did

    def versions_after(forward: Callable) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            if weights is not None:
                peaks["versions"] = max(peaks["versions"], weights.stored_versions())
            return out
        return wrapped

    for stage in pipe.engine.stages.values():
        stage.forward = versions_after(stage.forward)  # type: ignore[method-assign]
    update = pipe._update

    def counting_update(minibatch: int) -> None:
        peaks["gradients"] = max(peaks["gradients"], _nbytes(p.grad for p in pipe.module.parameters()
                                                               if p.grad is not None))
        update(minibatch)
        if weights is not None:  # the new live version beside the stashed ones
            peaks["versions"] = max(peaks["versions"], weights.stored_versions())

    pipe._update = meter.labelled("update", counting_update)  # type: ignore[method-assign]
    for stage in pipe.engine.stages.values():
        for name in ("forward", "backward", "backward_input", "backward_weight"):
            setattr(stage, name, meter.labelled(name, getattr(stage, name)))
    started = time.perf_counter()
    with meter:
        for _ in range(steps):
            pipe.step(x, y)
        pipe.drain()
    seconds = time.perf_counter() - started
    hwm = status_kb("VmHWM")
    params = _nbytes(pipe.module.parameters())
    state = _nbytes(t for s in pipe.optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor)) if pipe.optimizer is not None else 0
    return {
        "rank": pipe.rank,
        "peak_activation_bytes": peaks["activations"],
        "parameters": params,
        "gradients": peaks["gradients"],
        "optimizer_state": state,
        "weight_versions": peaks["versions"],
        "peak_tensor_bytes": meter.peak,  # every live storage (LiveTensorBytes)
        "peak_phase": meter.peak_phase,  # what ran at the peak, and the live bytes when it began
        "peak_phase_base_bytes": meter.peak_phase_base,
        "transient_bytes": dict(meter.transient),  # per phase, its most bytes above what it began with
        "rss_base_bytes": rss_base * 1024,
        "rss_ready_bytes": rss_ready * 1024,
        "peak_rss_bytes": hwm * 1024,
        # VmHWM was reset once the stage was built (else it holds the construction's peak too)
        "peak_rss_growth_bytes": (hwm - rss_base) * 1024 if reset else None,
        "hwm_reset": reset,
        "train_s": seconds,
    }


def counter_bytes(model: nn.Sequential, x: torch.Tensor, balance: list[int]) -> list[float]:
    """Per stage, per whole batch, what the runtime's counter sees without recompute: its input and what its own
    layers save (each stage profiled alone, so an output saved only by the next stage's first layer is left out)."""
    out, first = [], 0
    with torch.no_grad():
        for count in balance:
            part = model[first: first + count]
            local = profile_module(part, x, warmup=0, repeats=1)
            out.append(float(local.extra["input_bytes"]) + sum(float(layer.saved_bytes or 0) for layer in local.layers))
            x, first = part(x), first + count
    return out


def predicted(profile: Profile, seen: list[float], run: dict) -> list[dict]:
    """predict_memory's terms per rank, and the part of the activation term the runtime's counter sees."""
    sizes = stage_bytes(profile, run["balance"])
    schedule, chunks, v, rc = run["schedule"], run["chunks"], run["virtual_stages"], run["recompute"]
    memory = predict_memory(sizes, schedule, chunks, virtual_stages=v, recompute=rc, optimizer=OPTIMIZER)
    # The counter (Stage.track_activations) sees a stage's inputs and what autograd saves on it: not its output when
    # nothing on the stage saves it, nor, with recompute, anything but the inputs.
    kept = [s.input if rc else k for s, k in zip(sizes, seen)]
    flight = flight_schedule(schedule, STAGES, chunks, None, v)
    counter = held_bytes(flight, [k / chunks for k in kept])
    # Stage 0's micro-batches are views of one batch and the counter counts a view's whole storage: the batch once per
    # micro-batch held, instead of 1 / chunks of it.
    views = held_bytes(flight, [sizes[0].input * (chunks - 1) / chunks] + [0.0] * (len(sizes) - 1))
    out = []
    for m, (seen_bytes, _), (view_bytes, _) in zip(memory, counter, views):
        terms = m.to_json()
        terms["activations_counter_sees"] = round(seen_bytes)
        terms["counter_batch_view_excess"] = round(view_bytes)
        out.append(terms)
    return out


def _ratio(measured: float | None, predicted_bytes: float) -> float | None:
    return None if measured is None or not predicted_bytes else measured / predicted_bytes


def _load() -> dict:
    """Other processes' CPU use: the load averages and the cores in use now (from /proc/stat, over 0.5 s)."""
    def busy() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return sum(fields) - fields[3] - fields[4], sum(fields)

    a, ta = busy()
    time.sleep(0.5)
    b, tb = busy()
    return {"loadavg": list(os.getloadavg()), "cores": os.cpu_count(),
            "busy_cores": round((b - a) / max(1, tb - ta) * (os.cpu_count() or 1), 2)}


def runs_for(model: str, layers: int, quick: bool) -> list[dict]:
    chunks = 2 if quick else 4
    runs = []
    for schedule in SCHEDULES:
        v = VIRTUAL if spec_of(schedule).virtual_stages else 1  # interleaved; zb-v, dualpipev: chunks in a V
        if layers < STAGES * v:
            continue
        # pipedream: one minibatch per step; dualpipev: at least 2 micro-batches per rank (fewer run zb-v's order)
        count = {"pipedream": 1, "dualpipev": max(chunks, 2 * STAGES)}.get(schedule, chunks)
        for recompute in (False,) if quick else (False, True):  # --quick: every schedule, once
            runs.append({
                "schedule": schedule, "recompute": recompute, "virtual_stages": v, "chunks": count,
                "balance": even_balance(layers, STAGES * v),
            })
    return runs


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/memory_model.json"))
    parser.add_argument("--quick", action="store_true", help="a smoke test: the mlp, small, 1 step")
    parser.add_argument("--table", type=Path, default=None, help="print this JSON's table; run nothing")
    parser.add_argument("--models", default=None, help="comma-separated: mlp, block (default: both; --quick: mlp)")
    args = parser.parse_args(argv)
    if args.table:
        doc = json.loads(args.table.read_text())
        print(markdown(doc))
        return doc
    models = args.models.split(",") if args.models else (["mlp"] if args.quick else ["mlp", "block"])
    sizes = {"mlp": (64, 64), "block": (64, 32)} if args.quick else {"mlp": (256, 256), "block": (128, 64)}
    steps = 1 if args.quick else 3
    started = time.time()
    doc: dict[str, Any] = {
        "command": "python -m benchmarks.memory.memory_model" + (" --quick" if args.quick else ""),
        "machine": {"torch": torch.__version__, "load_before": _load()},
        "optimizer": OPTIMIZER, "stages": STAGES, "runs": [],
        # the ranks' transport (auto: shared memory here, whose mapped rings the count leaves out, as it does every
        # storage the allocator did not make; under gloo a rank's sends keep their messages until the step ends)
        "transport": os.environ.get("LIGHTNING_PIPEDREAM_TRANSPORT", "auto"),
    }
    for name in models:
        width, batch = sizes[name]
        model = build_model(name, width)
        x, _ = make_batch(name, width, batch)
        # the same model, batch and seed as the ranks
        profile = profile_module(model, x, warmup=0, repeats=1, working_sets=True)
        runs = runs_for(name, len(profile.layers), args.quick)
        for run in runs:
            run.update(model=name, width=width, batch=batch, steps=steps, quick=args.quick)
        measured = run_local(worker, STAGES, runs, timeout=60.0 + 30.0 * len(runs))
        for i, run in enumerate(runs):
            seen = counter_bytes(model, x, run["balance"])
            ranks = []
            for m, p in zip((per_rank[i] for per_rank in measured), predicted(profile, seen, run)):
                view_free = m["peak_activation_bytes"] - p["counter_batch_view_excess"]
                ranks.append({
                    "rank": m["rank"], "measured": m, "predicted": p,
                    "ratio": {
                        "activations": _ratio(m["peak_activation_bytes"], p["activations_counter_sees"]),
                        "activations_less_batch_views": _ratio(view_free, p["activations_counter_sees"]),
                        "peak": _ratio(m["peak_rss_growth_bytes"], p["predicted_peak_bytes"]),
                        "peak_tensors": _ratio(m["peak_tensor_bytes"], p["predicted_peak_bytes"]),
                        "parameters": _ratio(m["parameters"], p["parameters"]),
                        "gradients": _ratio(m["gradients"], p["gradients"]),
                        "optimizer_state": _ratio(m["optimizer_state"], p["optimizer_state"]),
                        "weight_versions": _ratio(m["weight_versions"], p["weight_versions"]),
                    },
                })
            doc["runs"].append({**run, "ranks": ranks})
            _print_row(run, ranks)
    doc["machine"]["load_after"] = _load()
    doc["seconds"] = round(time.time() - started, 1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def markdown(doc: dict) -> str:
    """The table of docs/partitioning.md: per configuration, rank 0 / rank 1."""
    def pair(ranks: list[dict], part: str, key: str, fmt: str, scale: float = 1.0) -> str:
        return " / ".join(format((r[part][key] or 0) / scale, fmt) for r in ranks)

    mib = float(2**20)
    lines = [
        "| model | schedule | recompute | predicted peak MiB | activations: counter / predicted (raw) "
        "| live tensors MiB (/ predicted) | peak during | RSS growth MiB (/ predicted) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in doc["runs"]:
        ranks = run["ranks"]
        lines.append(
            f"| {run['model']} | {run['schedule']} | {'yes' if run['recompute'] else 'no'} "
            f"| {pair(ranks, 'predicted', 'predicted_peak_bytes', '.2f', mib)} "
            f"| {pair(ranks, 'ratio', 'activations_less_batch_views', '.3f')} "
            f"({pair(ranks, 'ratio', 'activations', '.2f')}) "
            f"| {pair(ranks, 'measured', 'peak_tensor_bytes', '.2f', mib)} "
            f"({pair(ranks, 'ratio', 'peak_tensors', '.2f')}) "
            f"| {' / '.join(r['measured'].get('peak_phase', '?') for r in ranks)} "
            f"| {pair(ranks, 'measured', 'peak_rss_growth_bytes', '.2f', mib)} "
            f"({pair(ranks, 'ratio', 'peak', '.2f')}) |"
        )
    return "\n".join(lines)


def _print_row(run: dict, ranks: list[dict]) -> None:
    cells = []
    for r in ranks:
        m, p, q = r["measured"], r["predicted"], r["ratio"]
        growth = m["peak_rss_growth_bytes"]
        cells.append(f"act {m['peak_activation_bytes'] / 2**20:7.3f}/{p['activations_counter_sees'] / 2**20:7.3f} MiB "
                     f"({q['activations']:.3f}, less views {q['activations_less_batch_views']:.3f})  "
                     f"peak {(growth or 0) / 2**20:6.2f}/{p['predicted_peak_bytes'] / 2**20:6.2f} MiB "
                     f"({q['peak'] or 0:.2f}) tensors {m['peak_tensor_bytes'] / 2**20:6.2f} ({q['peak_tensors']:.2f}) "
                     f"in {m['peak_phase']} +{(m['peak_tensor_bytes'] - m['peak_phase_base_bytes']) / 2**20:.2f}")
    label = f"{run['model']:5s} {run['schedule']:11s} rc={int(run['recompute'])}"
    print(label, " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
