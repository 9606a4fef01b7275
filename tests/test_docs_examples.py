"""The code examples in docs/ run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiprocess  # starts several processes: not in the fast suite

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_engine_example_trains_and_returns_the_whole_model():
    text = (DOCS / "engine.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(DOCS / "engine.md"), "exec"), namespace)
    state = namespace["state"]
    assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    # The example trains with 1f1b, which equals one process: the same 20 steps on the whole model.
    reference = namespace["model"]()
    sgd = torch.optim.SGD(reference.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        x = torch.randn(64, 32, generator=g)
        sgd.zero_grad()
        torch.nn.functional.mse_loss(reference(x), x.sum(1, keepdim=True)).backward()
        sgd.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=f"{name} differs from one process")
