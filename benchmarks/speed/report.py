"""Markdown tables of the benchmark results, as docs/benchmarks.md shows them.

python benchmarks/speed/report.py [--schedules benchmarks/results/schedules.json]
    [--memory benchmarks/results/memory.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

NAMES = {
    "ours_gpipe": "ours gpipe",
    "ours_1f1b": "ours 1f1b",
    "ours_pipedream": "ours pipedream",
    "ours_gpipe_trace": "ours gpipe, trace=True",
    "ours_1f1b_trace": "ours 1f1b, trace=True",
    "ours_pipedream_trace": "ours pipedream, trace=True",
    "torch_gpipe": "torch ScheduleGPipe",
    "torch_1f1b": "torch Schedule1F1B",
    "one_thread": "1 process, 1 thread, 8 micro-batches",
    "one_thread_per_minibatch": "1 process, 1 thread, SGD step per 64",
    "two_threads": "1 process, 2 threads, batch of 512",
}


def _f(value, fmt: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def throughput(doc: dict) -> str:
    rows = [
        "| contender | steps/s (median) | min - max | samples/s | quiet runs: steps/s (n) | vs torch, same schedule | "
        "vs 1 thread | CPU s per step | page faults per step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in doc["contenders"].items():
        vs_torch = _f(r.get("ratio_vs_torch"), ".3f")
        if "ratio_vs_torch_of" in r and not r["ratio_vs_torch_of"].endswith(name.split("_")[1]):
            vs_torch += f" (vs {r['ratio_vs_torch_of'].replace('torch_', '')})"
        quiet = f"{_f(r['steps_per_s_quiet'])} ({r['quiet_runs']})" if r["steps_per_s_quiet"] else "- (0)"
        rows.append(
            f"| {NAMES.get(name, name)} | {r['steps_per_s']:.2f} | "
            f"{r['spread']['min']:.2f} - {r['spread']['max']:.2f} | "
            f"{r['samples_per_s']:.0f} | {quiet} | {vs_torch} | {r['speedup_vs_one_thread']:.3f} | "
            f"{r['cpu_s_per_step_median']:.3f} | {r['page_faults_per_step_median']:.0f} |"
        )
    return "\n".join(rows)


def targets(doc: dict) -> str:
    c = doc["contenders"]
    rows = ["| target | all runs (median) | quiet runs | paired by round (median) |", "|---|---|---|---|"]
    for s in ("gpipe", "1f1b"):
        r = c.get(f"ours_{s}", {})
        if "ratio_vs_torch" in r:
            rows.append(
                f"| ours {s} / torch {s} >= 1.0 (aim 1.15) | {r['ratio_vs_torch']:.3f} | "
                f"{_f(r.get('ratio_vs_torch_quiet'), '.3f')} | {r['ratio_vs_torch_paired_median']:.3f} |"
            )
    r = c.get("ours_pipedream", {})
    if r:
        rows.append(
            f"| pipedream / 1 thread (same micro-batches) >= 1.7 | {r['speedup_vs_one_thread']:.3f} | "
            f"{_f(r.get('speedup_vs_one_thread_quiet'), '.3f')} | {r['speedup_vs_one_thread_paired_median']:.3f} |"
        )
        if "speedup_vs_one_thread_same_updates" in r:
            rows.append(
                f"| pipedream / 1 thread with an SGD step per 64 (same work) | "
                f"{r['speedup_vs_one_thread_same_updates']:.3f} | - | - |"
            )
    for s in ("gpipe", "1f1b"):
        for who in ("ours", "torch"):
            r = c.get(f"{who}_{s}")
            if r:
                rows.append(
                    f"| {who} {s}: share of the ideal 2x over 1 thread | {r['ideal_speedup_fraction']:.3f} | "
                    f"{_f(r.get('speedup_vs_one_thread_quiet') and r['speedup_vs_one_thread_quiet'] / 2, '.3f')} | - |"
                )
    return "\n".join(rows)


def simulator(doc: dict) -> str:
    rows = [
        "| schedule | measured s/step | simulated, isolated costs | measured / simulated | "
        "simulated, concurrent costs | "
        "measured / simulated | simulated, costs from the trace | measured / simulated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in ("gpipe", "1f1b", "pipedream"):
        r = doc["contenders"].get(f"ours_{s}")
        if not r or "simulated_step_s" not in r:
            continue
        rows.append(
            f"| {s} | {r['measured_step_s']:.4f} ({r['measured_step_from']}) | {r['simulated_step_s']:.4f} | "
            f"{r['measured_over_simulated']:.3f} | {r['simulated_step_s_concurrent_costs']:.4f} | "
            f"{r['measured_over_simulated_concurrent_costs']:.3f} | "
            f"{_f(r.get('simulated_step_s_trace_costs'), '.4f')} | "
            f"{_f(r.get('measured_over_simulated_trace_costs'), '.3f')} |"
        )
    return "\n".join(rows)


def costs(doc: dict) -> str:
    rows = [
        "| costs (ms) | forward s0 | forward s1 | backward s0 | backward s1 | optimizer s0 | optimizer s1 |",
        "|---|---|---|---|---|---|---|",
    ]

    def row(label: str, p: dict) -> str:
        ms = [f"{v * 1e3:.2f}" for k in ("forward_s", "backward_s", "optimizer_s") for v in p[k]]
        return f"| {label} | " + " | ".join(ms) + " |"

    rows.append(row("isolated (1 process, lower of before/after)", doc["profile"]))
    rows.append(row("concurrent (2 processes at once)", doc["profile_runs"]["concurrent"]))
    for s, r in doc.get("simulated_trace_costs", {}).items():
        rows.append(row(f"recorded in the {s} trace", r["costs"]))
    link = doc["link"]
    rows.append("")
    rows.append(
        f"Link (our transport, ping-pong / 2): {link['small'] * 1e6:.0f} us for a tiny message, "
        f"{link['activation'] * 1e6:.0f} us for one activation ({link['activation_bytes'] // 1024} KiB): "
        f"latency {link['latency_s'] * 1e6:.0f} us, bandwidth {link['bandwidth_Bps'] / 1e9:.1f} GB/s."
    )
    return "\n".join(rows)


def bubbles(doc: dict) -> str:
    rows = [
        "| schedule | analytic (p-1)/(m+p-1) | simulated (isolated costs) | simulated (costs from the trace) | "
        "measured in one step (trace) | measured over the timed run (trace) |",
        "|---|---|---|---|---|---|",
    ]
    for s, b in doc["bubble"].items():
        rows.append(
            f"| {s} | {b['analytic']:.3f} | {_f(b['simulated'], '.3f')} | "
            f"{_f(b.get('simulated_trace_costs'), '.3f')} | "
            f"{_f(b.get('measured_in_step_median'), '.3f')} | {b['measured_whole_step_median']:.3f} |"
        )
    return "\n".join(rows)


def trace_overhead(doc: dict) -> str:
    t = doc["trace_overhead"]
    rows = [
        "| schedule | step time with trace / without - 1 (medians) | same, paired by round (median) | "
        "CPU time per step with trace / without - 1 (medians) | "
        "recording cost (actions x cost per record) / step time |",
        "|---|---|---|---|---|",
    ]
    c = doc["contenders"]
    for s in ("gpipe", "1f1b", "pipedream"):
        if s in t:
            cpu = c[f"ours_{s}_trace"]["cpu_s_per_step_median"] / c[f"ours_{s}"]["cpu_s_per_step_median"] - 1
            rows.append(
                f"| {s} | {t[s]['median_ratio_minus_1']:+.2%} | {t[s]['paired_median']:+.2%} | {cpu:+.2%} | "
                f"{t[s].get('record_cost_fraction_of_step', 0):.4%} |"
            )
    rows.append("")
    rows.append(
        f"One record (two perf_counter calls and a list append) costs {t['record_cost_s_per_action'] * 1e9:.0f} ns."
    )
    return "\n".join(rows)


def memory(doc: dict) -> str:
    rows = [
        "| schedule | rank | micro-batches in flight (peak) | stored activations, MB (peak) | weight versions (peak) | "
        "weights, MB | RSS after setup, MB | peak RSS, MB | peak RSS - setup, MB | RSS at the end, MB | "
        "RSS after gc.collect + malloc_trim, MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s, ranks in doc["ranks"].items():
        for r in ranks:
            rows.append(
                f"| {s} | {r['rank']} | {r['peak_in_flight']} | {r['peak_activation_mb']:.2f} | "
                f"{r.get('peak_weight_versions', 1)} | {r.get('weight_versions_mb', r['param_mb']):.1f} | "
                f"{r['rss_setup_mb']:.0f} | {r['peak_rss_mb']:.0f} | {_f(r['peak_rss_growth_mb'], '.0f')} | "
                f"{r['rss_end_mb']:.0f} | {_f(r['rss_after_malloc_trim_mb'], '.0f')} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=Path, default=Path("benchmarks/results/schedules.json"))
    parser.add_argument("--memory", type=Path, default=Path("benchmarks/results/memory.json"))
    args = parser.parse_args(argv)
    if args.schedules.exists():
        doc = json.loads(args.schedules.read_text())
        m = doc["machine"]
        print(
            f"Machine: {m['cpus']} CPUs, {m['platform']}, torch {m['torch']}. Before the run other processes used "
            f"{m['load_before']['foreign_cores']:.2f} cores (load average {m['load_before']['loadavg_1m']:.2f}); "
            f"during the runs {m['foreign_cores_during_runs_median']:.2f} cores (median, max "
            f"{m['foreign_cores_during_runs_max']:.2f}). {doc['config']['rounds']} rounds x "
            f"{doc['config']['timed_steps_per_run']} timed steps; {doc['seconds']:.0f} s in all.\n"
        )
        for title, fn in (
            ("Throughput", throughput),
            ("Targets", targets),
            ("Simulator", simulator),
            ("Costs", costs),
            ("Bubble", bubbles),
            ("Trace overhead", trace_overhead),
        ):
            print(f"### {title}\n\n{fn(doc)}\n")
    if args.memory.exists():
        print(f"### Memory\n\n{memory(json.loads(args.memory.read_text()))}\n")


if __name__ == "__main__":
    main()
