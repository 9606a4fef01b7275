"""The profiler (sleeping layers, tuples, no side effects), profile files and PipeDream's graph.txt format."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from lightning_pipedream.plan import LayerProfile, Profile, Topology, load_pipedream_graph, partition, profile_module


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class Sleeper(nn.Module):
    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        return _Sleep.apply(x, self.forward_s, self.backward_s)


MS = 1e-3
SLEEPS = [10 * MS, 10 * MS, 10 * MS, 30 * MS, 10 * MS, 10 * MS]  # each layer's forward; its backward sleeps twice that


def test_sleeping_layers_are_measured_at_least_as_long_as_they_sleep():
    layers = nn.Sequential(*[Sleeper(f, 2 * f) for f in SLEEPS])
    # The input requires grad, as a later stage's would, so that the first layer's backward runs too.
    profile = profile_module(layers, torch.randn(4, 8, requires_grad=True), warmup=1, repeats=3)
    assert profile.names == [str(i) for i in range(6)]
    for layer, f in zip(profile.layers, SLEEPS):
        # Sleep never returns early; a busy machine only adds to it, so only the lower bound is the layer's own.
        assert f <= layer.forward_s and 2 * f <= layer.backward_s


def test_sleeping_layers_give_the_expected_time_balance():
    # The partitioner's choice on those layers' own times, written here: measured ones follow a busy machine's delays
    # (a sleep that lasted longer than asked moves the split), which the test above bounds from below only.
    profile = Profile([LayerProfile(str(i), f, 2 * f, 4 * 8 * 4, 0) for i, f in enumerate(SLEEPS)])
    # Forward+backward per layer: 30, 30, 30, 90, 30, 30 ms.
    assert partition(profile, Topology.flat(2), "time").balance == [3, 3]
    assert partition(profile, Topology.flat(3), "time").balance == [3, 1, 2]


def test_twenty_layers_profile_and_report_the_overhead():
    # How long profiling takes is the profile's own report (profiling_s, kept in its JSON), not a bound here.
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(20)])
    started = time.perf_counter()
    profile = profile_module(layers, torch.randn(64, 256))
    wall = time.perf_counter() - started
    assert len(profile.layers) == 20
    assert profile.profiling_s is not None and 0 < profile.profiling_s <= wall  # the profiler's own time, reported
    model_s = sum(l.forward_s + l.backward_s for l in profile.layers)
    assert profile.profiling_s > model_s  # it ran every layer (warmup + repeats) at least once more than one step
    assert Profile.from_json(profile.to_json()).profiling_s == profile.profiling_s
    print(f"profiling 20 layers took {profile.profiling_s:.3f} s for {model_s * 1e3:.2f} ms of forward+backward "
          f"({profile.profiling_s / model_s:.0f}x one training step)")
    assert all(l.activation_bytes == 64 * 256 * 4 and l.parameter_bytes == (256 * 256 + 256) * 4 for l in profile.layers)


class Split(nn.Module):
    def forward(self, x):
        return x, x.sum(dim=1), torch.arange(3)  # an integer tensor rides along without gradients


class Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, inputs):
        x, s, index = inputs
        return {"h": self.linear(x) + s[:, None], "index": index}


class Head(nn.Module):
    def forward(self, tree):
        return tree["h"].relu()


def test_layers_that_pass_tuples_and_dicts():
    profile = profile_module(nn.Sequential(Split(), Merge(), Head()), torch.randn(5, 8, requires_grad=True))
    split, merge, head = profile.layers
    int_bytes = torch.arange(3).element_size() * 3
    assert split.activation_bytes == 5 * 8 * 4 + 5 * 4 + int_bytes
    assert merge.activation_bytes == 5 * 8 * 4 + int_bytes and merge.parameter_bytes == (64 + 8) * 4
    assert head.activation_bytes == 5 * 8 * 4
    assert all(l.backward_s > 0 for l in profile.layers) and profile.batch_size == 5
    # A batch of data needs no gradient: a first layer without parameters then has no backward.
    assert profile_module(nn.Sequential(Split(), Merge()), torch.randn(5, 8)).layers[0].backward_s == 0.0


def test_profiling_leaves_no_trace():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    stats = layers[1].running_mean.clone()
    batch = torch.randn(8, 4) + 3.0
    rng = torch.get_rng_state()
    profile_module(layers, batch)
    assert torch.equal(layers[1].running_mean, stats) and layers[1].num_batches_tracked.item() == 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in layers.parameters())


def test_bad_profiler_input():
    with pytest.raises(ValueError, match="needs a non-empty torch.nn.Sequential"):
        profile_module(nn.Sequential(), torch.zeros(1))
    with pytest.raises(ValueError, match="repeats >= 1"):
        profile_module(nn.Sequential(nn.ReLU()), torch.zeros(1), repeats=0)


# ---------------------------------------------------------------------------------------------------------
# Files

def test_profile_json_round_trip(tmp_path):
    profile = Profile([LayerProfile("a", 0.1, 0.2, 10, 20), LayerProfile("b", 0.3, 0.4, 30, 40, "Linear")],
                      edges=[(0, 1)], batch_size=8, source="test")
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile
    assert Profile.from_json(profile.to_json()) == profile


GRAPH = """node1 -- Input -- forward_compute_time=5.000, backward_compute_time=0.000, activation_size=100.0, parameter_size=0.000
node3 -- ReLU -- forward_compute_time=1.000, backward_compute_time=2.000, activation_size=[10.0; 20.0], parameter_size=0.000
node2 -- Conv2d(3, 8) -- forward_compute_time=3.000, backward_compute_time=4.000, activation_size=40.0, parameter_size=896.000
node4 -- Add -- forward_compute_time=0.500, backward_compute_time=0.500, activation_size=30.0, parameter_size=0.000
\tnode1 -- node2
\tnode2 -- node3
\tnode3 -- node4
\tnode2 -- node4
"""


def test_pipedream_graph_format(tmp_path):
    path = tmp_path / "graph.txt"
    path.write_text(GRAPH)
    profile = load_pipedream_graph(path)
    assert profile.names == ["node1", "node2", "node3", "node4"]  # a topological order, whatever the file's
    inp, conv, relu, add = profile.layers
    assert (inp.forward_s, inp.activation_bytes) == (0.0, 0)  # PipeDream's optimizer ignores the input's cost
    assert conv.forward_s == pytest.approx(0.003) and conv.backward_s == pytest.approx(0.004)
    assert relu.activation_bytes == 30 and conv.parameter_bytes == 896 and conv.description == "Conv2d(3, 8)"
    assert profile.edges == [(0, 1), (1, 2), (1, 3), (2, 3)]
    assert profile.cut_bytes() == [0, 40, 70]  # after node3, node2's output still crosses to node4
    assert profile.no_cut_after == [0]  # the input stays with the first layer
    assert Profile.load(path) == profile  # Profile.load recognises the format


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"is empty"),
        ("   \n\n", r"is empty"),
        (GRAPH.replace("activation_size=40.0", "activation_size=lots"), r"graph.txt, line 3: activation_size is 'lots'"),
        (GRAPH.replace("node4 -- Add -- ", "node4 -- Add "), r"graph.txt, line 4: expected 'nodeN -- description"),
        (GRAPH.replace("\tnode3 -- node4", "\tnode3 node4"), r"graph.txt, line 7: expected an edge 'nodeA -- nodeB'"),
        (GRAPH.replace("forward_compute_time=1.000", "forward_compute_time=-1.000"), r"line 2: forward_compute_time is '-1.000'"),
        (GRAPH + "\tnode4 -- node9\n", r"an edge names node9, which no node line defines"),
        (GRAPH + "\tnode4 -- node2\n", r"the graph has a cycle through node2, node3, node4"),
        (GRAPH.splitlines()[0] + "\n" + GRAPH.splitlines()[0] + "\n", r"line 2: node node1 is defined twice"),
    ],
)
def test_malformed_pipedream_graph(tmp_path, text, message):
    path = tmp_path / "graph.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_pipedream_graph(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"The profile .*p.json is empty"),
        ('{"layers": [\n  {"name": "a",\n  "forward_s": 1,,}\n]}', r"is not valid JSON: line 3, column"),
        ('{"layers": []}', r"has no layers"),
        ('{"layers": [{"name": "a", "forward_s": 1}]}', r"Layer 0 of the profile .* needs name, forward_s, backward_s"),
        ('{"layers": [{"name": "a", "forward_s": -1, "backward_s": 0, "activation_bytes": 0, "parameter_bytes": 0}]}',
         r"Layer 0 \(a\) of the profile .* has forward_s=-1; use a number >= 0"),
        ('{"steps": 3}', r"JSON object with a 'layers' list"),
    ],
)
def test_malformed_profile_json(tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        Profile.load(path)


def test_inconsistent_profiles():
    a, b = LayerProfile("a", 1, 1, 0, 0), LayerProfile("b", 1, 1, 0, 0)
    with pytest.raises(ValueError, match="names two layers 'a'"):
        Profile([a, a])
    with pytest.raises(ValueError, match="edge 1 -> 0 that goes backwards; list layers in a topological order"):
        Profile([a, b], edges=[(1, 0)])
    with pytest.raises(ValueError, match="no_cut_after=1; use indices of layers 0..0"):
        Profile([a, b], no_cut_after=[1])


def test_shipped_profiles_load(pipedream_profiles):
    root = pipedream_profiles
    sizes = {m: len(load_pipedream_graph(root / m / "graph.txt").layers)
             for m in ["vgg16", "alexnet", "resnet50", "gnmt8", "gnmt16"]}
    assert sizes == {"vgg16": 41, "alexnet": 23, "resnet50": 177, "gnmt8": 48, "gnmt16": 96}
