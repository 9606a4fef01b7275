"""What every benchmark repeats: medians over its rounds (with their spread), timing a call a few times, and the JSON
document its figures go in (in ``benchmarks/results/`` by default), with the machine's load average when the run ended
beside the one it measured before."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def median_or_none(values: Iterable[float]) -> float | None:
    """The median of ``values``, or None when there are none (a contender that did not run)."""
    values = list(values)
    return statistics.median(values) if values else None


def spread(values: list[float]) -> dict:
    """The median of the rounds, their least and greatest, and every round's figure in order."""
    values = sorted(values)
    return {
        "median": statistics.median(values),
        "min": values[0],
        "max": values[-1],
        "runs": values,
    }


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``fn``."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write ``result`` as indented JSON to ``path`` (its folder made if needed), with ``load_after``, and say where."""
    result["load_after"] = os.getloadavg()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
