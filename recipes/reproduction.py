"""The statistical-efficiency comparison of a reproduction sweep: quality per epoch and against time, and a table.

`python recipes/train.py -m experiment=paper_<task>` calls `write_reproduction` when the sweep ends;
`python recipes/reproduction.py <sweep dir>` redraws from the jobs' results.json files.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

# the order of the table and the legend: the reference first, then synchronous, then asynchronous pipelines
CONTENDERS = ("ddp", "gpipe", "1f1b", "pipedream", "pipedream_no_stashing", "pipedream_vertical_sync")
TABLE_COLUMNS = ("contender", "seeds", "epochs", "final_metric", "final_metric_min", "final_metric_max",
                 "epochs_to_target", "seconds_to_target", "train_seconds_per_epoch", "seconds_total")


def load_runs(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every job's results.json under `sweep_dir` that names a contender."""
    runs = [json.loads(path.read_text()) for path in sorted(sweep_dir.glob("*/results.json"))]
    return [run for run in runs if run.get("contender")]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _epochs_to_target(run: dict[str, Any]) -> int | None:
    """Epochs completed when the metric first reached the target (the validation whose time is time_to_target_s)."""
    if run.get("time_to_target_s") is None:
        return None
    for entry in run["history"]:
        if entry["seconds"] == run["time_to_target_s"]:
            return entry["epoch"] + 1
    return None


def table_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per contender, means over its seeds. Epochs and seconds to target average the seeds that reached it
    (`seeds` says how many of how many did, e.g. '1/2')."""
    by_contender: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_contender[run["contender"]].append(run)
    order = [c for c in CONTENDERS if c in by_contender] + sorted(set(by_contender) - set(CONTENDERS))
    rows = []
    for contender in order:
        done = [run for run in by_contender[contender] if not run.get("error") and run.get("history")]
        finals = [run["history"][-1]["metric"] for run in done]
        reached = [run for run in done if run.get("time_to_target_s") is not None]
        epochs = [_epochs_to_target(run) for run in reached]
        rows.append({
            "contender": contender,
            "seeds": f"{len(reached)}/{len(by_contender[contender])}",
            "epochs": _mean([run["history"][-1]["epoch"] + 1 for run in done]),
            "final_metric": _mean(finals),
            "final_metric_min": min(finals) if finals else None,
            "final_metric_max": max(finals) if finals else None,
            "epochs_to_target": _mean([e for e in epochs if e is not None]),
            "seconds_to_target": _mean([run["time_to_target_s"] for run in reached]),
            "train_seconds_per_epoch": _mean([run["history"][-1]["train_seconds"] / (run["history"][-1]["epoch"] + 1)
                                              for run in done]),
            "seconds_total": _mean([run["history"][-1]["seconds"] for run in done]),
        })
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "not reached"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown_table(rows: list[dict[str, Any]], metric_name: str) -> str:
    header = ["contender", "seeds reaching target", "epochs", f"final {metric_name} (mean)", "min", "max",
              "epochs to target", "seconds to target", "training s / epoch", "seconds in all"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(row[c]) for c in TABLE_COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    """Two panels: the metric after each epoch, and against seconds of the job; one line per contender and seed."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    metric_name = runs[0]["metric_name"]
    fig, (per_epoch, per_second) = plt.subplots(1, 2, figsize=(10, 3.8))
    colours = {c: f"C{i}" for i, c in enumerate(CONTENDERS)}
    styles = ["-", "--", ":", "-."]
    seeds = sorted({run["seed"] for run in runs})
    labelled: set[str] = set()
    rank = {c: i for i, c in enumerate(CONTENDERS)}
    for run in sorted(runs, key=lambda r: (rank.get(r["contender"], len(rank)), r["contender"], r["seed"])):
        if run.get("error") or not run.get("history"):
            continue
        epochs = [entry["epoch"] + 1 for entry in run["history"]]
        metric = [entry["metric"] for entry in run["history"]]
        seconds = [entry["seconds"] for entry in run["history"]]
        contender = run["contender"]
        style = dict(color=colours.get(contender, "k"), linestyle=styles[seeds.index(run["seed"]) % len(styles)],
                     marker=".", linewidth=1.2)
        label = contender if contender not in labelled else None
        labelled.add(contender)
        per_epoch.plot(epochs, metric, label=label, **style)
        per_second.plot(seconds, metric, **style)
    per_epoch.set_xlabel("epoch")
    per_second.set_xlabel("seconds (job start, held-out evaluation excluded)")
    for axis in (per_epoch, per_second):
        axis.set_ylabel(metric_name)
        axis.grid(alpha=0.3)
        if metric_name == "perplexity":
            axis.set_yscale("log")
    per_epoch.legend(fontsize=8)
    fig.suptitle(f"{title}  (seeds {', '.join(map(str, seeds))}: line styles)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_reproduction(sweep_dir: Path) -> str | None:
    """Write reproduction.md, .csv and .png in `sweep_dir`; returns the table (None: no contender jobs there)."""
    runs = load_runs(sweep_dir)
    if not runs:
        return None
    rows = table_rows(runs)
    first = runs[0]
    metric_name = first.get("metric_name") or "metric"
    table = markdown_table(rows, metric_name)
    title = f"{first['task']}: {first['model']}"
    (sweep_dir / "reproduction.md").write_text(f"# {title}\n\n{table}")
    with (sweep_dir / "reproduction.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=TABLE_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    if any(run.get("history") for run in runs):
        plot(runs, sweep_dir / "reproduction.png", title)
    return table


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python recipes/reproduction.py <sweep dir of python recipes/train.py -m experiment=paper_...>")
    table = write_reproduction(Path(sys.argv[1]))
    if table is None:
        sys.exit(f"{sys.argv[1]}: no results.json of a contender= job in its subfolders")
    print(table, end="")
