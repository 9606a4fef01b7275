"""The layers import one way (strategy -> runtime -> graph -> plan -> schedule; cli -> plan, schedule), and so do
runtime/'s rooms (execution -> stages -> communication -> faults) and strategy/'s (training, inference -> setup ->
checkpoints, reporting); no circle anywhere; Lightning only under strategy/;
no private names across modules; no schedule names compared outside schedule/ and cli/. Every rule is checked over
every file of the package, and each checker is shown to catch a planted violation."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_pipedream.schedule.specs import SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_pipedream"
OURS = ("lightning_pipedream", "benchmarks", "recipes")

LAYERS = ("schedule", "plan", "graph", "runtime", "strategy", "cli")
# layer -> the package's layers it may import (besides itself and the `tree` utility, which imports only torch)
MAY_IMPORT = {
    "schedule": set(),
    "plan": {"schedule"},
    "graph": {"plan", "schedule"},
    "runtime": {"graph", "plan", "schedule"},
    "strategy": {"runtime", "graph", "plan", "schedule"},
    "cli": {"plan", "schedule"},
}
NO_TORCH = {"schedule"}  # pure Python: the validator, simulator and renderer run without torch
LIGHTNING = ("lightning", "pytorch_lightning")
LIGHTNING_ALLOWED = {"strategy"}  # and lightning_pipedream/__init__.py, which only hooks the strategy's registration
TESTING = "testing"  # lightning_pipedream/testing/: what tests and benchmarks check the package against (no layer)


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


def layer_of(path: Path) -> str | None:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 and parts[0] in LAYERS else None


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def layering_violations(path: Path) -> list[str]:
    """What ``path`` imports against the layering."""
    layer = layer_of(path)
    bad = []
    for module in sorted(imported_modules(path)):
        top = module.split(".")[0]
        where = f"{path.relative_to(ROOT)} imports {module}"
        if top in LIGHTNING and layer not in LIGHTNING_ALLOWED and path != PACKAGE / "__init__.py":
            bad.append(f"{where}: Lightning is known only under strategy/")
        if top == "torch" and layer in NO_TORCH:
            bad.append(f"{where}: {layer}/ is pure Python")
        if top == "lightning_pipedream" and layer is not None:
            parts = module.split(".")
            other = parts[1] if len(parts) > 1 else ""
            if other in LAYERS and other != layer and other not in MAY_IMPORT[layer]:
                bad.append(f"{where}: {layer}/ may import only {sorted(MAY_IMPORT[layer]) or 'no other layer'}")
            if other == TESTING:
                bad.append(f"{where}: {TESTING}/ is for the tests and benchmarks; the package never imports it")
            if other == "tree" and layer in NO_TORCH:
                bad.append(f"{where}: {layer}/ is pure Python")
        if path.name == "tree.py" and path.parent == PACKAGE and top in OURS + LIGHTNING:
            bad.append(f"{where}: tree.py is the bottom utility (torch only)")
    return bad


def private_imports(path: Path) -> list[str]:
    """Private names (``_x``) that ``path`` imports from another module of ours."""
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.relative_to(ROOT)} imports {node.module}.{alias.name}"
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
            and node.module.split(".")[0] in OURS for alias in node.names if alias.name.startswith("_")]


def schedule_name_comparisons(path: Path) -> list[str]:
    """``x == "pipedream"``, ``x in ("pipedream", "2bw")`` and the like: the spec table says what a schedule is."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        if any("method" in ast.unparse(side) for side in [node.left, *node.comparators]):
            continue  # the partitioner's method "pipedream" (PipeDream's optimizer) is not a schedule
        for operand in [node.left, *node.comparators]:
            names = [operand] if isinstance(operand, ast.Constant) else (
                list(operand.elts) if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [])
            if any(isinstance(n, ast.Constant) and n.value in SCHEDULES for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} compares with a schedule name")
                break
    return found


def test_every_file_imports_only_downwards() -> None:
    bad = [line for path in package_files() for line in layering_violations(path)]
    assert not bad, "imports against the layering (see DESIGN.md):\n" + "\n".join(bad)


def test_no_private_names_cross_modules() -> None:
    files = [p for folder in ("lightning_pipedream", "benchmarks", "recipes", "tests")
             for p in sorted((ROOT / folder).rglob("*.py"))]
    bad = [line for path in files for line in private_imports(path)]
    assert not bad, "private names imported from another module (make them public or keep them local):\n" + \
        "\n".join(bad)


def test_schedule_names_are_compared_only_in_schedule_and_cli() -> None:
    # cli/ speaks to users by name (its flags and the textbook bubble formulas); every other layer asks the specs.
    files = [p for p in package_files() if layer_of(p) not in ("schedule", "cli")]
    bad = [line for path in files for line in schedule_name_comparisons(path)]
    assert not bad, "ask lightning_pipedream.schedule.specs instead:\n" + "\n".join(bad)


@pytest.mark.parametrize(("layer", "code", "expected"), [
    ("schedule", "def f():\n    from lightning_pipedream.runtime import engine\n", "schedule/ may import only"),
    ("schedule", "import torch\n", "schedule/ is pure Python"),
    ("plan", "from ..graph import capture\n", "plan/ may import only ['schedule']"),
    ("runtime", "import lightning.pytorch\n", "Lightning is known only under strategy/"),
    ("runtime", "from lightning_pipedream.strategy.setup import placement\n", "runtime/ may import only"),
    ("graph", "from lightning_pipedream.runtime.execution.engine import PipelineEngine\n", "graph/ may import only"),
    ("cli", "from lightning_pipedream.runtime import engine\n", "cli/ may import only ['plan', 'schedule']"),
    ("runtime", "from lightning_pipedream.testing.nccl_model import PointToPointModel\n",
     "testing/ is for the tests and benchmarks"),
])
def test_the_layering_checker_catches_a_planted_violation(layer: str, code: str, expected: str) -> None:
    probe = PACKAGE / layer / "_probe_for_test.py"
    probe.write_text(code)
    try:
        assert any(expected in line for line in layering_violations(probe)), layering_violations(probe)
    finally:
        probe.unlink()


def test_the_other_checkers_catch_planted_violations(tmp_path: Path) -> None:
    probe = PACKAGE / "runtime" / "_probe_for_test.py"
    probe.write_text("from lightning_pipedream.runtime.execution.engine import _private\n"
                     "def f(s):\n    return s.schedule == '2bw' or s.name in ('gpipe', 'x')\n")
    try:
        assert private_imports(probe) == [
            "lightning_pipedream/runtime/_probe_for_test.py imports lightning_pipedream.runtime.execution.engine._private"]
        assert len(schedule_name_comparisons(probe)) == 2
    finally:
        probe.unlink()


# runtime/'s rooms, by concern; a room may import only those below it (the top files, pipeline.py, import any).
ROOMS = {
    "faults": set(),  # errors between ranks, flight recorder, watchdog, mailboxes, the launcher: what ends a run
    "communication": {"faults"},  # transport, shared memory, the NCCL model, micro-batches
    "stages": {"communication", "faults"},  # one rank's layers, weight versions, ties, replicas and shards
    "execution": {"stages", "communication", "faults"},  # the engine and its executor
}
# strategy/'s rooms, likewise (the top files, pipedream.py and __init__.py, import any); a room may stand apart from
# another at the same height (training and inference; reporting and checkpoints), importing neither.
STRATEGY_ROOMS = {
    "reporting": set(),  # what ranks tell each other about a step: summaries, logged values, the data check
    "checkpoints": set(),  # single-file and sharded checkpoints, and the commands (setup's pipeline by a protocol)
    "setup": {"reporting", "checkpoints"},  # options, placement, planning, the graph path, the stage pipeline
    "training": {"setup", "reporting", "checkpoints"},  # a fit: the step, updates, loss scale, divergence guard
    "inference": {"setup", "reporting", "checkpoints"},  # evaluation and generation
}
ROOMS_OF = {"runtime": ROOMS, "strategy": STRATEGY_ROOMS}  # a layer in rooms -> its rooms and what each may import


def room_of(path: Path) -> str | None:
    parts = path.relative_to(PACKAGE).parts
    return parts[1] if len(parts) > 2 and parts[0] in ROOMS_OF else None


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path) -> set[str]:
    """The package's modules that ``path`` imports (``from a import b`` counts ``a.b`` when b is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        bases: list[tuple[str, list[str]]] = []
        if isinstance(node, ast.Import):
            bases = [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            bases = [(base, [alias.name for alias in node.names])]
        for base, names in bases:
            if base.split(".")[0] != PACKAGE.name:
                continue
            for name in names:
                if _module_path(f"{base}.{name}") is not None:
                    found.add(f"{base}.{name}")
            if _module_path(base) is not None and (not names or any(
                    _module_path(f"{base}.{name}") is None for name in names)):
                found.add(base)
    return found


def _module_path(module: str) -> Path | None:
    where = PACKAGE.parent.joinpath(*module.split("."))
    for candidate in (where.with_suffix(".py"), where / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def room_violations(path: Path) -> list[str]:
    """What a file under runtime/ or strategy/ imports from a room above its own (or from the layer's top files)."""
    room = room_of(path)
    if room is None:
        return []
    layer = path.relative_to(PACKAGE).parts[0]
    rooms = ROOMS_OF[layer]
    bad = []
    for module in sorted(package_imports(path)):
        parts = module.split(".")
        if parts[1:2] == [layer] and len(parts) > 2:
            other = parts[2]
            if other not in rooms or (other != room and other not in rooms[room]):
                allowed = sorted(rooms[room]) or "no other room"
                bad.append(f"{path.relative_to(ROOT)} imports {module}: {layer}/{room}/ may import only {allowed}")
    return bad


def circles(files: list[Path]) -> list[list[str]]:
    """Every circle of imports among ``files`` (each strongly connected set of modules, in a stable order)."""
    graph = {module_name(p): package_imports(p) for p in files}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for after in sorted(graph.get(node, ())):
            if after not in graph:
                continue
            if after not in index:
                visit(after)
                low[node] = min(low[node], low[after])
            elif after in stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_runtime_rooms_import_only_downwards() -> None:
    rooms = sorted(p.name for p in (PACKAGE / "runtime").iterdir() if (p / "__init__.py").exists())
    assert rooms == sorted(ROOMS), "a new room under runtime/ needs its place in ROOMS"
    bad = [line for path in package_files() if path.relative_to(PACKAGE).parts[0] == "runtime"
           for line in room_violations(path)]
    assert not bad, "imports against runtime/'s rooms:\n" + "\n".join(bad)


def test_strategy_rooms_import_only_downwards() -> None:
    rooms = sorted(p.name for p in (PACKAGE / "strategy").iterdir() if (p / "__init__.py").exists())
    assert rooms == sorted(STRATEGY_ROOMS), "a new room under strategy/ needs its place in STRATEGY_ROOMS"
    files = sorted((PACKAGE / "strategy").glob("*/*.py"))
    assert files and all(room_of(path) in STRATEGY_ROOMS for path in files)
    bad = [line for path in files for line in room_violations(path)]
    assert not bad, "imports against strategy/'s rooms:\n" + "\n".join(bad)


BENCHMARKS = ROOT / "benchmarks"


def benchmark_room_violations(path: Path) -> list[str]:
    """What a benchmark imports from another room of benchmarks/ than its own and ``common`` (which imports none)."""
    room = path.relative_to(BENCHMARKS).parts[0]
    allowed = {room} if room == "common" else {room, "common"}
    tree = ast.parse(path.read_text(), str(path))
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + [
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level]
    return [f"{path.relative_to(ROOT)} imports {m}: benchmarks/{room}/ may import only {sorted(allowed)}"
            for m in modules if m.split(".")[0] == "benchmarks" and (len(m.split(".")) < 2 or m.split(".")[1] not in allowed)]


def test_benchmark_rooms_import_only_common() -> None:
    files = sorted(BENCHMARKS.glob("*/*.py"))
    assert files and not [p for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py"], "a benchmark needs a room"
    bad = [line for path in files for line in benchmark_room_violations(path)]
    assert not bad, "imports between benchmark rooms (share through benchmarks/common/):\n" + "\n".join(bad)
    probe = BENCHMARKS / "memory" / "_probe_for_test.py"
    probe.write_text("from benchmarks.speed import schedules\nfrom benchmarks.common import figures\n")
    try:
        assert benchmark_room_violations(probe) == [
            "benchmarks/memory/_probe_for_test.py imports benchmarks.speed: benchmarks/memory/ may import only "
            "['common', 'memory']"]
    finally:
        probe.unlink()


def test_every_package_opens_with_a_one_line_docstring() -> None:
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(ROOT)} says nothing about what lives there"


def test_the_package_has_no_circle_of_imports() -> None:
    found = circles(package_files())
    assert not found, "circles of imports (move what both need below them):\n" + "\n".join(map(str, found))


MAX_LINES = 800  # a file longer than this holds more than one idea: split it by concern
STRATEGY_MAX_LINES = 600  # Lightning's hooks, each delegating (the per-batch work is strategy/training/training_step.py)


def test_no_file_is_too_long_to_read_whole() -> None:
    lengths = {path: len(path.read_text().splitlines()) for path in package_files()}
    long = [f"{path.relative_to(ROOT)}: {n} lines" for path, n in lengths.items() if n > MAX_LINES]
    assert not long, f"files over {MAX_LINES} lines:\n" + "\n".join(long)
    assert lengths[PACKAGE / "strategy" / "pipedream.py"] < STRATEGY_MAX_LINES


def test_no_file_in_strategy_is_over_its_limit() -> None:
    lengths = {path: len(path.read_text().splitlines()) for path in sorted((PACKAGE / "strategy").rglob("*.py"))}
    long = [f"{path.relative_to(ROOT)}: {n} lines" for path, n in lengths.items() if n > STRATEGY_MAX_LINES]
    assert not long, f"files in strategy/ over {STRATEGY_MAX_LINES} lines:\n" + "\n".join(long)


def test_the_room_and_circle_checkers_catch_planted_violations() -> None:
    faults = PACKAGE / "runtime" / "faults"
    one, two = faults / "_probe_one.py", faults / "_probe_two.py"
    one.write_text("from lightning_pipedream.runtime.faults import _probe_two\n"
                   "from lightning_pipedream.runtime.execution.engine import PipelineEngine\n")
    two.write_text("def f():\n    from lightning_pipedream.runtime.faults._probe_one import x\n")
    try:
        assert circles(package_files()) == [["lightning_pipedream.runtime.faults._probe_one",
                                             "lightning_pipedream.runtime.faults._probe_two"]]
        assert room_violations(one) == [
            "lightning_pipedream/runtime/faults/_probe_one.py imports lightning_pipedream.runtime.execution.engine: "
            "runtime/faults/ may import only no other room"]
    finally:
        one.unlink()
        two.unlink()


@pytest.mark.parametrize(("room", "code", "expected"), [
    ("setup", "from lightning_pipedream.strategy.training.training import Training\n",
     "imports lightning_pipedream.strategy.training.training: strategy/setup/ may import only "
     "['checkpoints', 'reporting']"),
    ("reporting", "def f():\n    from lightning_pipedream.strategy.setup import options\n",
     "imports lightning_pipedream.strategy.setup.options: strategy/reporting/ may import only no other room"),
    ("checkpoints", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from lightning_pipedream.strategy.setup.stage_pipeline import StagePipeline\n",
     "imports lightning_pipedream.strategy.setup.stage_pipeline: strategy/checkpoints/ may import only no other room"),
    ("training", "from lightning_pipedream.strategy.inference.evaluation import evaluate\n",
     "imports lightning_pipedream.strategy.inference.evaluation: strategy/training/ may import only "
     "['checkpoints', 'reporting', 'setup']"),
    ("inference", "from lightning_pipedream.strategy import pipedream\n",
     "imports lightning_pipedream.strategy.pipedream: strategy/inference/ may import only "
     "['checkpoints', 'reporting', 'setup']"),
])
def test_the_room_checker_catches_an_upward_import_in_strategy(room: str, code: str, expected: str) -> None:
    probe = PACKAGE / "strategy" / room / "_probe_for_test.py"
    probe.write_text(code)
    try:
        found = room_violations(probe)
        assert [line.split(" ", 1)[1] for line in found] == [expected], found
    finally:
        probe.unlink()


# Clock readings of the time module; a difference of two, or a name holding one, is a measured duration.
CLOCKS = {"time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns"}
HANG_LIMIT_WORDS = ("deadline", "limit")
MIN_HANG_LIMIT_S = 60  # the least seconds a literal hang limit may allow (a slow hour runs 2x a quiet one's time)


def _reads_clock(node: ast.AST, measured: set[str]) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id in measured:
            return True
        if isinstance(n, ast.Call):
            func = n.func
            if (isinstance(func, ast.Attribute) and func.attr in CLOCKS and isinstance(func.value, ast.Name)
                    and func.value.id == "time") or (isinstance(func, ast.Name) and func.id in CLOCKS):
                return True
    return False


def _is_hang_limit(node: ast.AST) -> bool:
    """A bare name (or attribute) that says it is a hang limit: ``deadline``, ``HANG_LIMIT``, ``self.limit``."""
    word = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return word is not None and any(hint in word.lower() for hint in HANG_LIMIT_WORDS)


def duration_asserts(path: Path) -> list[str]:
    """Asserts that bound a measured time from above by anything but an outer hang limit: a claim about speed.

    The rule: no test asserts how fast something ran (a busy or a slower machine fails it; speed belongs in
    benchmarks/). A time measured with the ``time`` module's clocks (a reading, a name assigned from one, or a
    difference of them) may appear in an assert only
    - as a lower bound (``waited > 0.25``: it waited as long as it had to; a busy machine only makes that longer),
      or against another measured time (``profiling_s <= wall``); or
    - against an outer hang limit, a bare name that says so (``time.monotonic() < deadline``, ``elapsed < limit``,
      ``< HANG_LIMIT``), set several times above what a slow hour takes: a deadline made from the clock and a literal
      (``deadline = time.monotonic() + 120``) allows at least MIN_HANG_LIMIT_S seconds.
    Everything else is a speed claim and fails: a bare number (``elapsed < 5.0``), and a bound built from a timeout
    plus a constant (``elapsed < timeout + 10``: a rank told by its peer "within the timeout and a few seconds" is a
    speed claim on a loaded machine; 16 processes on two cores end 20 s after their failure). To tell "told by its
    peer" from "gave up on a timeout", assert the event instead: the words a rank stopped with, which rank stopped
    it, the flight recorder's reason, or a timeout set far beyond the test's hang limit so that only being told can
    end the run in time. pytest-timeout bounds every test against a hang anyway.
    """
    tree = ast.parse(path.read_text(), str(path))
    measured: set[str] = set()
    found = []
    for node in ast.walk(tree):  # names that hold a clock reading or a duration, anywhere in the file
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None \
                and _reads_clock(node.value, set()):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            measured.update(names)
            literals = [n.value for n in ast.walk(node.value) if isinstance(n, ast.Constant)
                        and isinstance(n.value, (int, float))]
            if any(any(hint in name.lower() for hint in HANG_LIMIT_WORDS) for name in names) and literals \
                    and max(literals) < MIN_HANG_LIMIT_S:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} sets a hang limit under {MIN_HANG_LIMIT_S} s: "
                             f"{ast.unparse(node)}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            sides = [compare.left, *compare.comparators]
            for op, left, right in zip(compare.ops, sides, sides[1:]):
                if isinstance(op, (ast.Lt, ast.LtE)):
                    small, big = left, right
                elif isinstance(op, (ast.Gt, ast.GtE)):
                    small, big = right, left
                else:
                    continue
                if _reads_clock(small, measured) and not _reads_clock(big, measured) and not _is_hang_limit(big):
                    found.append(f"{path.relative_to(ROOT)}:{compare.lineno} asserts a duration: "
                                 f"{ast.unparse(compare)}")
    return found


def test_no_test_asserts_how_fast_something_ran() -> None:
    bad = [line for path in sorted((ROOT / "tests").rglob("*.py")) for line in duration_asserts(path)]
    assert not bad, "assert behaviour, not speed (see duration_asserts for the rule):\n" + "\n".join(bad)


def test_the_duration_checker_catches_a_planted_speed_assert(tmp_path: Path) -> None:
    probe = ROOT / "tests" / "_probe_for_test.py"
    probe.write_text(
        "import time\nfrom time import perf_counter\n"
        "def test_speed(run, timeout, HANG_LIMIT):\n"
        "    start = time.monotonic()\n    run()\n"
        "    assert time.monotonic() - start < 5.0\n"  # a speed claim, inline
        "    wall = perf_counter() - start\n"
        "    assert run() and 2 > wall\n"  # a speed claim through a name, reversed
        "    assert 0.25 < wall < timeout + 10\n"  # a lower bound (allowed) and a timeout plus a constant (a claim)
        "    assert wall < timeout\n"  # a timeout is not a hang limit: a claim
        "    deadline = time.monotonic() + 60\n"
        "    assert time.monotonic() < deadline and wall < HANG_LIMIT\n"  # outer hang limits: allowed
        "    soon = time.monotonic() + 5\n"  # a near time, not named a limit: not one
        "    short_deadline = time.monotonic() + 10\n"  # a hang limit no slow hour stays within
    )
    try:
        assert [line.split(" asserts")[0].split(" sets")[0] for line in duration_asserts(probe)] == [
            "tests/_probe_for_test.py:14", "tests/_probe_for_test.py:6", "tests/_probe_for_test.py:8",
            "tests/_probe_for_test.py:9", "tests/_probe_for_test.py:10"]
    finally:
        probe.unlink()


def test_ci_runs_the_readme_commands_on_the_oldest_releases_pyproject_accepts() -> None:
    # What the README tells a user to run is what .ci/run runs, line for line; and the second environment's pins
    # are the lower bounds pyproject.toml claims, so that a claim cannot drift from what CI tests.
    readme = (ROOT / "README.md").read_text()
    block = readme.split("**Run the tests**", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    steps = re.findall(r"^step '(.*)'$", (ROOT / ".ci" / "run").read_text(), flags=re.M)
    assert steps == block.strip().splitlines()
    assert any("-c .ci/oldest.txt" in step for step in steps)
    pins = dict(line.strip().split("==") for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#"))
    dependencies = (ROOT / "pyproject.toml").read_text().split("dependencies = [", 1)[1].split("]", 1)[0]
    lower = dict(re.findall(r'^\s*"([A-Za-z0-9_.-]+)>=([0-9.]+)', dependencies, flags=re.M))
    assert set(lower) == {"torch", "lightning", "torchmetrics"}
    for name, bound in lower.items():
        assert name in pins and (pins[name] + ".").startswith(bound + "."), (name, bound, pins.get(name))


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
