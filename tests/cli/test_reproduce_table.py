"""`python -m lightning_pipedream reproduce-table`: the paper's Table 1 from PipeDream's published profiles."""

from __future__ import annotations

import json

import pytest

from lightning_pipedream.cli import main
from lightning_pipedream.cli.reproduce_table import CLUSTERS, paper_configuration
from lightning_pipedream.plan import load_pipedream_graph

KEYS = {"model", "cluster", "workers", "configuration", "pipedream_s", "data_parallel_s", "speedup"}


_RUNS: dict[str, list[dict]] = {}  # the command runs once for all the tests that read its rows (~3 s)


@pytest.fixture
def table(pipedream_profiles, tmp_path):
    """One run of the command on the published profiles (default: the paper's cost model, flat topology)."""
    if "rows" not in _RUNS:
        path = tmp_path / "table.json"
        assert main(["reproduce-table", "--profiles", str(pipedream_profiles), "--json", str(path)]) == 0
        _RUNS["rows"] = json.loads(path.read_text())["rows"]
    return {(r["model"], r["cluster"], r["servers"]): r for r in _RUNS["rows"]}


def _paper_dp_time(graph, workers: int, bandwidth: float) -> float:
    """Data parallelism under the paper's cost model, from graph.txt's own numbers (ms and bytes): compute and a
    ring all-reduce of every parameter, 4 (m-1)/m |w| / B, overlapped (max), shared by m workers."""
    layers = load_pipedream_graph(graph).layers
    compute = sum(layer.forward_s + layer.backward_s for layer in layers)
    params = sum(layer.parameter_bytes for layer in layers)
    return max(compute, 4 * (workers - 1) / workers * params / bandwidth) / workers


def test_every_row_has_the_issue_keys_and_one_row_per_paper_row(table):
    assert len(table) == 12
    for row in table.values():
        assert KEYS <= set(row)
        assert row["speedup"] == pytest.approx(row["data_parallel_s"] / row["pipedream_s"])
        assert row["pipedream_s"] <= row["data_parallel_s"] * (1 + 1e-12)  # data parallelism is one of the plans


def test_resnet50_is_data_parallel_on_both_clusters_as_in_the_paper(table, pipedream_profiles):
    for key, bandwidth in ((("resnet50", "A", "4x4"), 1.25e9), (("resnet50", "B", "2x8"), 3.125e9)):
        row = table[key]
        assert (row["configuration"], row["workers"], row["paper"]["configuration"]) == ("16", 16, "16")
        assert row["speedup"] == pytest.approx(1.0)
        expected = _paper_dp_time(pipedream_profiles / "resnet50" / "graph.txt", 16, bandwidth)
        assert row["data_parallel_s"] == pytest.approx(expected, rel=1e-9)


def test_vgg16_on_16_workers_of_cluster_a_is_15_1_at_the_shipped_boundary(table, pipedream_profiles):
    row = table[("vgg16", "A", "4x4")]
    assert (row["configuration"], row["workers"], row["paper"]["configuration"]) == ("15-1", 16, "15-1")
    assert row["stage_ends"] == ["node34"]  # PipeDream's runtime/.../vgg16/gpus=16: stage 0 ends at node34
    assert row["data_parallel_s"] == pytest.approx(
        _paper_dp_time(pipedream_profiles / "vgg16" / "graph.txt", 16, 1.25e9), rel=1e-9
    )
    assert row["speedup"] > 2
    assert row["paper_configuration_s"] == pytest.approx(row["pipedream_s"])


def test_simulated_data_parallelism_is_compute_then_all_reduce(table, pipedream_profiles):
    """The simulator runs backward then the all-reduce, without overlap: (compute + 4 (m-1)/m |w| / B) / m."""
    row = table[("alexnet", "A", "4x4")]
    layers = load_pipedream_graph(pipedream_profiles / "alexnet" / "graph.txt").layers
    compute = sum(layer.forward_s + layer.backward_s for layer in layers)
    params = sum(layer.parameter_bytes for layer in layers)
    assert row["simulated_data_parallel_s"] == pytest.approx((compute + 4 * 15 / 16 * params / 1.25e9) / 16)
    assert row["simulated_steady_state"] is True


def test_paper_configuration_names():
    assert [paper_configuration(r) for r in ([16], [1, 1, 1, 1], [15, 1], [1, 1, 2])] == [
        "16",
        "straight",
        "15-1",
        "1-1-2",
    ]
    assert CLUSTERS["A"].between == 1.25e9 and CLUSTERS["B"].between == 3.125e9  # 10 and 25 Gbit/s


# A three-layer graph.txt: read from a folder named like one of the paper's models, without ../shared.
GRAPH = """node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=0.0, parameter_size=0.000
node2 -- Conv -- forward_compute_time=10.000, backward_compute_time=20.000, activation_size=1000000.0, parameter_size=4000.000
node3 -- Linear -- forward_compute_time=5.000, backward_compute_time=5.000, activation_size=1000.0, parameter_size=100000000.000
\tnode1 -- node2
\tnode2 -- node3
"""


def test_a_folder_with_some_profiles_gives_their_rows_and_names_the_rest(tmp_path, capsys):
    (tmp_path / "vgg16").mkdir()
    (tmp_path / "vgg16" / "graph.txt").write_text(GRAPH)
    out = tmp_path / "out" / "table.json"
    assert main(["reproduce-table", "--profiles", str(tmp_path), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["cluster"]) for r in rows] == [("vgg16", "A"), ("vgg16", "B")]
    # 40 ms of compute, 100,004,000 parameter bytes: the all-reduce, 4 * 15/16 * bytes / 1.25e9 = 0.3 s, is longer
    assert rows[0]["data_parallel_s"] == pytest.approx(4 * 15 / 16 * 100_004_000 / 1.25e9 / 16, rel=1e-12)
    err = capsys.readouterr().err
    assert "skipped (no <model>/graph.txt in" in err and "resnet50, alexnet, gnmt16, gnmt8" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profiles", "{missing}"], "is not a folder; give the folder that holds PipeDream's profiles"),
        (["--profiles", "{empty}"], "has none of the paper's profiles; expected <model>/graph.txt for vgg16"),
        (["--profiles", "{empty}", "--cost-model", "fast"], "--cost-model 'fast': choose paper or code"),
        (["--profiles", "{empty}", "--topology", "tree"], "--topology 'tree': choose flat or levels"),
    ],
)
def test_errors_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    argv = [a.format(missing=tmp_path / "missing", empty=tmp_path) for a in argv]
    assert main(["reproduce-table", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
