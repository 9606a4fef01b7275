"""The layers import one way: schedule <- plan, schedule <- runtime, and only strategy/cli on top know more."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pipedream"

# layer -> module prefixes it must never import (at any depth of the file, lazy imports included)
FORBIDDEN = {
    "schedule": ("lightning_pipedream.plan", "lightning_pipedream.runtime", "lightning_pipedream.strategy",
                 "lightning_pipedream.cli", "lightning", "torch"),
    "plan": ("lightning_pipedream.runtime", "lightning_pipedream.strategy", "lightning_pipedream.cli", "lightning"),
    "runtime": ("lightning_pipedream.strategy", "lightning_pipedream.cli", "lightning"),
    "cli": ("lightning_pipedream.strategy", "lightning_pipedream.runtime", "lightning"),
    "tree": ("lightning_pipedream.", "lightning"),
    # torch only: capture, profile and split a model's graph; the runtime runs its stages, the strategy wires it.
    "graph": ("lightning_pipedream.runtime", "lightning_pipedream.strategy", "lightning_pipedream.cli", "lightning"),
    # the pieces the strategy uses that need no Lightning themselves
    "strategy/summaries": ("lightning_pipedream.cli", "lightning"),
}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, top-level or inside functions ("from . import x" resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
    return found


def _violates(module: str, prefix: str) -> bool:
    return module == prefix.rstrip(".") or module.startswith(prefix if prefix.endswith(".") else prefix + ".")


def layer_files(layer: str) -> list[Path]:
    return [PACKAGE / f"{layer}.py"] if (PACKAGE / f"{layer}.py").exists() else sorted((PACKAGE / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_downwards(layer: str) -> None:
    files = layer_files(layer)
    assert files, f"no files for layer {layer}"
    bad = [f"{path.relative_to(PACKAGE.parent)} imports {module}"
           for path in files for module in sorted(imported_modules(path))
           for prefix in FORBIDDEN[layer] if _violates(module, prefix)]
    assert not bad, "imports against the layering (see DESIGN.md):\n" + "\n".join(bad)


def test_the_import_checker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    sample = PACKAGE / "schedule" / "_probe_for_test.py"
    sample.write_text("def f():\n    from lightning_pipedream.runtime import engine\n    import lightning.pytorch\n")
    try:
        assert {"lightning_pipedream.runtime", "lightning.pytorch"} <= imported_modules(sample)
    finally:
        sample.unlink()


def _fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


NO_LIGHTNING = ["lightning_pipedream", "lightning_pipedream.schedule.builders", "lightning_pipedream.schedule.check",
                "lightning_pipedream.schedule.simulate", "lightning_pipedream.cli", "lightning_pipedream.cli.show",
                "lightning_pipedream.cli.simulate", "lightning_pipedream.cli.plan", "lightning_pipedream.plan",
                "lightning_pipedream.runtime.pipeline"]


def test_fresh_imports_load_no_lightning() -> None:
    # One interpreter for all: if any of these imported Lightning, it would be in sys.modules at the end.
    # `show` comes first and is checked on its own: printing a grid needs neither torch nor Lightning.
    loaded = _fresh(
        "import json, sys; import lightning_pipedream.cli.show; "
        "first = [m for m in ('torch', 'lightning') if m in sys.modules]; "
        f"import {', '.join(NO_LIGHTNING)}; "
        "print(json.dumps([first, sorted(m for m in sys.modules if m.split('.')[0] in "
        "('lightning', 'pytorch_lightning'))]))"
    )
    assert loaded == [[], []], f"loaded {loaded}"


CHECK_REGISTERED = ("from lightning.pytorch.strategies import StrategyRegistry; import json; "
                    "names = [n in StrategyRegistry for n in ('pipedream', 'pipedream_1f1b', 'pipedream_gpipe')]; "
                    "t = L.Trainer(strategy='pipedream', accelerator='cpu', devices=2, logger=False); "
                    "print(json.dumps([names, type(t.strategy).__name__]))")


@pytest.mark.multiprocess  # two fresh interpreters that import Lightning: ~10 s each
@pytest.mark.parametrize("order", ["import lightning_pipedream; import lightning as L",
                                   "import lightning as L; import lightning_pipedream"])
def test_trainer_finds_the_strategy_names_whatever_the_import_order(order: str) -> None:
    assert _fresh(f"{order}; {CHECK_REGISTERED}") == [[True, True, True], "PipeDreamStrategy"]


def test_top_level_names_load_lazily() -> None:
    import lightning_pipedream

    assert lightning_pipedream.build_schedule("gpipe", 2, 2).num_stages == 2
    assert "PipeDreamStrategy" in dir(lightning_pipedream)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        lightning_pipedream.nope  # noqa: B018
