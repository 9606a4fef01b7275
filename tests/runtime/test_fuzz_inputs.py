"""Fuzzed inputs: plan JSON, profile JSON, PipeDream graph.txt and the CLI's arguments.

Whatever the input, a reader returns a result or raises a ValueError (``PlanFormatError``/``ProfileFormatError``
for the files) whose message names the file, line or field; the CLI exits 0, or 2 with argparse's usage, or
1/2 with one ``error:`` line, never a traceback. Examples are bounded (no database: see conftest.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_pipedream.cli import main
from lightning_pipedream.plan import Plan, Profile, load_pipedream_graph
from lightning_pipedream.plan.errors import InputFormatError, PlanFormatError, ProfileFormatError

# FUZZ_EXAMPLES=5000 fuzzes longer, locally; CI runs the bounded default.
FUZZ = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# ---------------------------------------------------------------------------------------------------------
# Building blocks: JSON values that are right, and ones that are wrong in the ways people get them wrong

weird = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
good_number = st.one_of(st.integers(0, 10**9), st.floats(0, 1e6, allow_nan=False))
maybe_number = st.one_of(good_number, good_number, weird)
names = st.text(alphabet="abcdefgh_0123456789.", min_size=1, max_size=6)


def _mutate(draw, entry: dict, fields: list[str]) -> dict:
    """Drop a field, add an unknown one, or give a field a wrong value, sometimes."""
    entry = dict(entry)
    action = draw(st.sampled_from(["keep", "keep", "drop", "extra", "wrong"]))
    if action == "drop" and entry:
        entry.pop(draw(st.sampled_from(sorted(entry))))
    elif action == "extra":
        entry[draw(st.sampled_from(["replica", "time", "Name", "layer", "edges"]))] = draw(weird)
    elif action == "wrong":
        entry[draw(st.sampled_from(fields))] = draw(weird)
    return entry


@st.composite
def layer_json(draw) -> dict:
    layer = {
        "name": draw(names),
        "forward_s": draw(maybe_number),
        "backward_s": draw(maybe_number),
        "activation_bytes": draw(maybe_number),
        "parameter_bytes": draw(maybe_number),
    }
    if draw(st.booleans()):
        layer["description"] = draw(st.one_of(st.text(max_size=5), weird))
    return _mutate(draw, layer, sorted(layer))


@st.composite
def profile_json(draw):
    layers = draw(st.lists(layer_json(), max_size=6))
    count = max(len(layers), 1)
    index = st.one_of(st.integers(0, count), st.integers(-2, count + 2), weird)
    data = {
        "layers": layers,
        "edges": draw(
            st.one_of(st.none(), st.lists(st.one_of(st.lists(index, min_size=2, max_size=2), weird), max_size=5), weird)
        ),
        "batch_size": draw(st.one_of(st.none(), st.integers(1, 64), weird)),
        "source": draw(st.one_of(st.just(""), st.text(max_size=5), weird)),
        "profiling_s": draw(st.one_of(st.none(), good_number, weird)),
        "no_cut_after": draw(st.one_of(st.lists(index, max_size=3), weird)),
    }
    data = _mutate(draw, data, sorted(data))
    return draw(st.one_of(st.just(data), st.just(data), weird))


@st.composite
def stage_json(draw) -> dict:
    stage = {
        "layers": draw(st.one_of(st.lists(names, max_size=3), st.lists(weird, max_size=2), weird)),
        "replicas": draw(st.one_of(st.integers(1, 4), weird)),
        "compute_s": draw(maybe_number),
        "forward_s": draw(maybe_number),
        "parameter_bytes": draw(maybe_number),
        "output_bytes": draw(maybe_number),
    }
    return _mutate(draw, stage, sorted(stage))


@st.composite
def plan_json(draw):
    level = st.lists(st.one_of(st.integers(-1, 4), st.floats(allow_nan=True), weird), min_size=1, max_size=3)
    data = {
        "stages": draw(st.one_of(st.lists(stage_json(), max_size=4), weird)),
        "schedule": draw(st.one_of(st.sampled_from(["pipedream", "1f1b", "gpipe", "zigzag"]), weird)),
        "chunks": draw(st.one_of(st.integers(1, 8), weird)),
        "time_per_minibatch": draw(maybe_number),
        "speedup_vs_one_worker": draw(st.one_of(st.none(), maybe_number)),
        "method": draw(st.one_of(st.sampled_from(["pipedream", "time"]), weird)),
        "cost_model": draw(st.one_of(st.none(), st.just("code"), weird)),
        "topology": draw(st.one_of(st.none(), st.lists(st.one_of(level, weird), max_size=3), weird)),
        "source": draw(st.one_of(st.just("p.json"), weird)),
        "extra": draw(st.one_of(st.just({}), weird)),
    }
    data = _mutate(draw, data, sorted(data))
    return draw(st.one_of(st.just(data), st.just(data), weird))


def _dumps(data) -> str:
    return json.dumps(data, allow_nan=True)


# ---------------------------------------------------------------------------------------------------------
# The readers


def _read(path: Path, text: str | bytes, read):
    """Write ``text`` at ``path`` and ``read`` it: the result, or the ValueError, which must name the file."""
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        return read(path)
    except ValueError as err:
        assert isinstance(err, InputFormatError), f"{type(err).__name__}: {err}"
        assert path.name in str(err), f"the message does not name the file: {err}"
        return err


def _check_profile(result) -> None:
    if isinstance(result, Profile):  # a profile that loads is usable
        assert len(result.cut_bytes()) == len(result.layers) - 1
        assert Profile.from_json(json.loads(_dumps(result.to_json()))) == result


def _check_plan(result) -> None:
    if isinstance(result, Plan):
        result.describe()
        assert sum(result.balance) == sum(len(s.layers) for s in result.stages)
        assert Plan.from_json(json.loads(_dumps(result.to_json()))) == result


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)


@FUZZ
@given(data=profile_json())
def test_profile_json_fuzzed(scratch, data):
    result = _read(scratch / "fuzzed_profile.json", _dumps(data), Profile.load)
    if isinstance(result, ValueError):
        assert isinstance(result, ProfileFormatError)
    _check_profile(result)


@FUZZ
@given(data=plan_json())
def test_plan_json_fuzzed(scratch, data):
    result = _read(scratch / "fuzzed_plan.json", _dumps(data), Plan.load)
    if isinstance(result, ValueError):
        assert isinstance(result, PlanFormatError)
    _check_plan(result)


def _garble(text: str, draw) -> str:
    """Cut, repeat, or splice random characters into ``text``."""
    if not text:
        return draw(st.text(max_size=20))
    at = draw(st.integers(0, len(text)))
    how = draw(st.sampled_from(["cut", "insert", "replace", "keep"]))
    noise = draw(st.text(alphabet=st.characters(codec="utf-8"), max_size=6))
    if how == "cut":
        return text[:at]
    if how == "insert":
        return text[:at] + noise + text[at:]
    if how == "replace":
        return text[:at] + noise + text[at + len(noise) :]
    return text


@FUZZ
@given(data=st.data())
def test_json_text_fuzzed(scratch, data):
    """Valid-looking JSON cut or spliced, random text, and bytes that are not UTF-8."""
    good_profile = _dumps(
        {
            "layers": [{"name": "a", "forward_s": 1, "backward_s": 2, "activation_bytes": 3, "parameter_bytes": 4}],
            "edges": None,
        }
    )
    good_plan = _dumps({"stages": [{"layers": ["a"], "replicas": 1}, {"layers": ["b"], "replicas": 2}]})
    text = data.draw(
        st.one_of(
            st.builds(_garble, st.sampled_from([good_profile, good_plan]), st.just(data.draw)),
            st.text(max_size=40),
            st.binary(max_size=30),
        )
    )
    _check_profile(_read(scratch / "fuzzed_text_profile.json", text, Profile.load))
    _check_plan(_read(scratch / "fuzzed_text_plan.json", text, Plan.load))


GRAPH = """node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=100.0, parameter_size=0.000
node2 -- Conv2d(3, 8) -- forward_compute_time=1.000, backward_compute_time=2.000, activation_size=40.0, parameter_size=64.000
node3 -- ReLU() -- forward_compute_time=0.500, backward_compute_time=0.500, activation_size=[40.0; 8.0], parameter_size=0.000
node4 -- Linear(8, 2) -- forward_compute_time=0.250, backward_compute_time=0.250, activation_size=8.0, parameter_size=72.000 -- stage_id=1
\tnode1 -- node2
\tnode2 -- node3
\tnode3 -- node4
"""

number_text = st.one_of(
    st.sampled_from(["1.0", "0", "-1", "nan", "inf", "1e400", "1e308", "abc", "", "1_0", "0x10", " 2"]),
    st.floats(allow_nan=True).map(str),
    st.text(alphabet="0123456789.e-+;[] ", max_size=8),
)


@st.composite
def graph_line(draw) -> str:
    node = draw(st.sampled_from(["node1", "node2", "node3", "node4", "node9", "n", "node2x"]))
    if draw(st.booleans()):
        other = draw(st.sampled_from(["node1", "node2", "node3", "node4", "node9", ""]))
        return f"\t{node} -- {other}" if draw(st.booleans()) else f"\t{node} {other}"
    desc = draw(st.sampled_from(["Input0", "Linear(2, 2)", "", "a -- b", "Input1"]))
    sizes = draw(st.one_of(number_text, st.lists(number_text, max_size=3).map(lambda xs: "[" + "; ".join(xs) + "]")))
    return (
        f"{node} -- {desc} -- forward_compute_time={draw(number_text)}, backward_compute_time={draw(number_text)}, "
        f"activation_size={sizes}, parameter_size={draw(number_text)}"
    )


@FUZZ
@given(data=st.data())
def test_pipedream_graph_fuzzed(scratch, data):
    """Well-formed graphs with lines changed, added or removed, and text cut or spliced."""
    lines = GRAPH.splitlines()
    for _ in range(data.draw(st.integers(0, 3))):
        at = data.draw(st.integers(0, len(lines)))
        how = data.draw(st.sampled_from(["add", "replace", "drop"]))
        if how == "add" or not lines:
            lines.insert(at, data.draw(graph_line()))
        elif how == "replace":
            lines[min(at, len(lines) - 1)] = data.draw(graph_line())
        else:
            del lines[min(at, len(lines) - 1)]
    text = _garble("\n".join(lines) + "\n", data.draw)
    path = scratch / "fuzzed_graph.txt"
    result = _read(path, text, lambda p: load_pipedream_graph(p, attach_side_sources=data.draw(st.booleans())))
    if isinstance(result, ValueError):
        assert isinstance(result, ProfileFormatError)
        assert re.search(r"line \d+|has no nodes|is empty|cycle|not UTF-8|profile", str(result)), str(result)
    _check_profile(result)
    # Profile.load recognises the format, or reads it as JSON if it starts with "{"
    _check_profile(_read(path, text, Profile.load))


# ---------------------------------------------------------------------------------------------------------
# Pinned wordings of errors that used to be crashes


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"layers": [{"name": "a", "forward_s": 1, "backward_s": 0, "activation_bytes": 1e999, '
            '"parameter_bytes": 0}]}',
            r"Layer 0 \(a\) of the profile .*p.json\) has activation_bytes=inf; use a number >= 0",
        ),
        (
            '{"layers": [{"name": "a", "forward_s": 1, "backward_s": 0, "activation_bytes": 1' + "0" * 400 + ", "
            '"parameter_bytes": 0}]}',
            r"has activation_bytes=1000.*; use a number >= 0",
        ),
        (
            '{"layers": ["a"]}',
            r"Layer 0 of the profile .*p.json\) is 'a'; each layer is an object with name, forward_s",
        ),
        (
            '{"layers": [{"name": 3, "forward_s": 1, "backward_s": 0, "activation_bytes": 0, "parameter_bytes": 0}]}',
            r"Layer 0 of the profile .* has name=3; give each layer a non-empty string",
        ),
        (
            '{"layers": [{"name": "a", "forward_s": 1, "backward_s": 0, "activation_bytes": 0, "parameter_bytes": 0}], '
            '"edges": 5}',
            r"p.json\) has edges=5; use a list of \[producer, consumer\] pairs, or null",
        ),
        (
            '{"layers": [{"name": "a", "forward_s": 1, "backward_s": 0, "activation_bytes": 0, "parameter_bytes": 0}], '
            '"edges": [["x", 1]]}',
            r"p.json\) has an edge \['x', 1\]; an edge is a pair of layer indices",
        ),
        (
            '{"layers": [{"name": "a", "forward_s": 1, "backward_s": 0, "activation_bytes": 0, "parameter_bytes": 0}], '
            '"no_cut_after": ["x"]}',
            r"has no_cut_after=\['x'\]; use a list of layer indices",
        ),
        (
            '{"layers": [{"name": "a", "forward_s": 1, "backward_s": 0, "activation_bytes": 0, "parameter_bytes": 0}], '
            '"batch_size": 0}',
            r"has batch_size=0; use a whole number >= 1, or null",
        ),
        ('{"layers": ' + "[" * 100_000, r"p.json is not valid JSON: its arrays or objects nest too deeply"),
        (b"\xff\xfe{", r"The profile .*p.json is not UTF-8 text"),
    ],
)
def test_profile_errors_that_were_crashes(tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ProfileFormatError, match=message):
        Profile.load(path)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"stages": []}, r"The plan .*plan.json has no stages"),
        ({"stages": [{"layers": [1]}]}, r"Stage 0 of the plan .*plan.json has a layer 1; layers are the profile's"),
        (
            {"stages": [{"layers": ["a"]}, {"layers": ["a"]}]},
            r"Stage 1 of the plan .* lists layer 'a', which stage 0 lists too; each layer belongs to one stage",
        ),
        ({"stages": [{"layers": ["a"], "replicas": True}]}, r"Stage 0 .* has replicas=True; use a whole number >= 1"),
        ({"stages": [{"layers": ["a"], "compute_s": "1"}]}, r"has compute_s='1'; use a number >= 0"),
        ({"stages": [{"layers": ["a"]}], "chunks": None}, r"The plan .*plan.json has chunks=None; use a whole number"),
        ({"stages": [{"layers": ["a"]}], "schedule": "zigzag"}, r"has schedule='zigzag'; use one of gpipe, 1f1b"),
        (
            {"stages": [{"layers": ["a"]}], "topology": [[0, 1e9]]},
            r"has topology=\[\[0, 1000000000.0\]\]: Topology level 0 has 0 workers",
        ),
        ({"stages": [{"layers": ["a"]}], "topology": [{"w": 1}]}, r"has topology=\[\{'w': 1\}\]: Topology level 0"),
        ({"stages": [{"layers": ["a"]}], "extra": []}, r"has extra=\[\]; use a JSON object"),
    ],
)
def test_plan_errors_that_were_crashes(tmp_path, data, message):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFormatError, match=message):
        Plan.load(path)


def test_graph_errors_name_the_line(tmp_path):
    path = tmp_path / "graph.txt"
    path.write_text(GRAPH + "\tnode4 -- node9\n")
    with pytest.raises(ProfileFormatError, match=r"graph.txt, line 8: an edge names node9, which no node line"):
        load_pipedream_graph(path)
    path.write_text(GRAPH.replace("activation_size=[40.0; 8.0]", "activation_size=[1e308; 1e308]"))
    with pytest.raises(ProfileFormatError, match=r"graph.txt, line 3: activation_size .* adds up to more than"):
        load_pipedream_graph(path)


# ---------------------------------------------------------------------------------------------------------
# The CLI, in process


def _cli(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """Run ``main(argv)`` in ``cwd``; its exit status (SystemExit included), stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    before = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.chdir(before)
    return code, out.getvalue(), err.getvalue()


def _check_cli(argv: list[str], cwd: Path) -> None:
    code, _, err = _cli(argv, cwd)  # an exception other than SystemExit fails the test with its traceback
    assert "Traceback" not in err, err
    if code == 0:
        return
    assert code in (1, 2), (code, err)
    if err.startswith("usage:"):  # argparse: usage, then one line naming the argument
        assert code == 2 and err.rstrip().splitlines()[-1].startswith("python -m lightning_pipedream"), err
    else:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{argv}: {err!r}"


def _files(folder: Path) -> dict[str, str]:
    """Inputs the fuzzed argv may name: good, bad and missing files (relative to ``folder``)."""
    good_profile = {
        "layers": [
            {
                "name": n,
                "forward_s": 0.001 * (i + 1),
                "backward_s": 0.002,
                "activation_bytes": 100,
                "parameter_bytes": 1000,
            }
            for i, n in enumerate("abcdef")
        ]
    }
    files = {
        "good.json": json.dumps(good_profile),
        "graph.txt": GRAPH,
        "bad.json": '{"layers": [{"name": "a"}]}',
        "broken.json": '{"layers": [',
        "binary.bin": "\udcff\udcfe",
        "empty.txt": "",
    }
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8", errors="surrogateescape")
    (folder / "adir").mkdir(exist_ok=True)
    return files


good_int = st.integers(1, 4).map(str)
small_int = st.one_of(
    good_int, good_int, good_int, st.integers(-1, 5).map(str), st.sampled_from(["0", "x", "1.5", "", "2,2", "nan"])
)
good_value = st.one_of(good_int, st.sampled_from(["1.5", "0", "1e9", "1,2", "1,1", "2,1", "0.5,0.25", "1e9,1e9"]))
value_text = st.one_of(
    good_value,
    good_value,
    small_int,
    number_text,
    st.text(alphabet="abc,.-01 ", max_size=6),
    st.sampled_from(["inf", "-inf", "1e400", "1,2,3", "0,1"]),
)
path_value = st.sampled_from(
    [
        "good.json",
        "graph.txt",
        "bad.json",
        "broken.json",
        "binary.bin",
        "empty.txt",
        "adir",
        "missing.json",
        "adir/out.json",
        "nowhere/out.json",
    ]
)
FLAGS = {
    "plan": {
        "--profile": path_value,
        "--pipedream-graph": path_value,
        "--workers": small_int,
        "--bandwidth": value_text,
        "--memory": value_text,
        "--straight": None,
        "--method": st.sampled_from(["pipedream", "time", "uniform", "parameters", "fast"]),
        "--cost-model": st.sampled_from(["code", "paper", "x"]),
        "--free-side-sources": None,
        "--save": path_value,
        "--json": None,
    },
    "show": {
        "--schedule": st.sampled_from(["1f1b", "gpipe", "pipedream", "x"]),
        "--stages": small_int,
        "--replicas": value_text,
        "--chunks": small_int,
        "--minibatches": small_int,
        "--actions": None,
    },
    "simulate": {
        "--schedule": st.sampled_from(["1f1b", "gpipe", "pipedream", "x"]),
        "--stages": small_int,
        "--replicas": value_text,
        "--chunks": small_int,
        "--minibatches": small_int,
        "--forward": value_text,
        "--backward": value_text,
        "--activation-bytes": value_text,
        "--optimizer": value_text,
        "--parameter-bytes": value_text,
        "--profile": path_value,
        "--balance": value_text,
        "--bandwidth": value_text,
        "--latency": value_text,
        "--allreduce-bandwidth": value_text,
        "--json": None,
        "--trace": path_value,
    },
}
# a stray token: anything but an abbreviation of --plot, which would draw a PNG (slow, and matplotlib's business)
stray = st.text(alphabet="-abcdefghijklmnopqrstuvwxyz0123456789,.", max_size=8).filter(
    lambda t: not (len(t) >= 4 and "--plot".startswith(t)) and not t.startswith("--pl")
)


@st.composite
def argv(draw) -> list[str]:
    command = draw(st.sampled_from(["plan", "show", "simulate", "plan", "simulate", "other"]))
    flags = dict(FLAGS.get(command, {}))
    args = [command]
    if command == "plan" and draw(st.integers(0, 3)) > 0:  # mostly valid enough to reach the partitioner
        source = draw(st.sampled_from(["--profile", "--pipedream-graph"]))
        args += [source, draw(st.sampled_from(["good.json", "graph.txt"]) | path_value)]
        args += ["--workers", draw(good_int | small_int), "--bandwidth", draw(st.just("1e9") | value_text)]
        for flag in ("--profile", "--pipedream-graph", "--workers", "--bandwidth"):
            del flags[flag]
    for _ in range(draw(st.integers(0, 4))):
        if flags and draw(st.integers(0, 19)) > 0:
            flag = draw(st.sampled_from(sorted(flags)))
            args.append(flag)
            if flags[flag] is not None:
                args.append(draw(flags[flag]))
        else:
            args.append(draw(stray))
    return args


@settings(FUZZ, max_examples=int(os.environ.get("FUZZ_EXAMPLES", "200")))
@given(args=argv())
def test_cli_fuzzed(scratch, args):
    folder = scratch / "cli"
    folder.mkdir(exist_ok=True)
    _files(folder)
    _check_cli(args, folder)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--profile", "binary.bin", "--workers", "2", "--bandwidth", "1e9"], r"binary.bin is not UTF-8 text"),
        (["plan", "--profile", "adir", "--workers", "2", "--bandwidth", "1e9"], r"error: .*Is a directory: 'adir'"),
        (
            ["plan", "--profile", "good.json", "--workers", "2", "--bandwidth", "1e9", "--save", "nowhere/out.json"],
            r"error: .*No such file or directory: 'nowhere/out.json'",
        ),
        (["simulate", "--stages", "2", "--trace", "adir"], r"error: .*Is a directory: 'adir'"),
        (["simulate", "--latency", "nan"], r"error: --latency and --optimizer are seconds and must be >= 0 and finite"),
        (
            ["simulate", "--profile", "bad.json", "--stages", "1"],
            r"error: could not read the profile bad.json: Layer 0 of the profile \(bad.json\)",
        ),
    ],
)
def test_cli_input_errors_are_one_line(tmp_path, argv, message):
    _files(tmp_path)
    code, _, err = _cli(argv, tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err


def test_cli_leaves_programming_errors_as_tracebacks(monkeypatch, tmp_path):
    import lightning_pipedream.cli.show as show

    monkeypatch.setattr(show, "render_grid", lambda schedule: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        _cli(["show", "--stages", "2"], tmp_path)


def test_non_finite_numbers_in_json_are_refused(tmp_path):
    layer = {"name": "a", "forward_s": math.nan, "backward_s": 0, "activation_bytes": 0, "parameter_bytes": 0}
    path = tmp_path / "nan.json"
    path.write_text(json.dumps({"layers": [layer]}))
    with pytest.raises(ProfileFormatError, match=r"Layer 0 \(a\) of the profile .*nan.json\) has forward_s=nan"):
        Profile.load(path)
