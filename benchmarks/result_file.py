"""Where a benchmark's figures go: one JSON document (in ``benchmarks/results/`` by default), with the machine's load
average when the run ended beside the one it measured before."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write ``result`` as indented JSON to ``path`` (its folder made if needed), with ``load_after``, and say where."""
    result["load_after"] = os.getloadavg()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
