"""The code examples in docs/ run as written."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_engine_example_trains_and_returns_the_whole_model():
    text = (DOCS / "engine.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(DOCS / "engine.md"), "exec"), namespace)
    state = namespace["state"]
    assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    assert all(torch.isfinite(v).all() for v in state.values())
