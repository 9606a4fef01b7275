"""Graph capture and split, in one process: the stages composed equal the model, for four model families.

Every check runs in a forked child (:func:`in_child`), capture included: once torch.export has run in a process,
a backward there (any test's) makes autograd refuse to work in processes forked from it later (torch's fork
check), which would break the multi-process tests that run after these in the same session.
"""

from __future__ import annotations

import copy

import pytest
import torch
from graph_models import make
from torch import nn

from lightning_pipedream.graph import (
    GraphCaptureError,
    SplitError,
    build_stages,
    capture,
    consolidate_state_dict,
    split_graph,
)
from lightning_pipedream.graph.split_points import choose_split_points, profile_graph
from lightning_pipedream.runtime.faults.launch import run_local

pytestmark = pytest.mark.multiprocess  # starts several processes: not in the fast suite

FAMILIES = ["transformer", "resnet", "gpt", "lstm"]


def captured(family: str):
    model, args = make(family)
    return model, args, capture(model, args)


def _call(rank, world, fn, args):
    return fn(*args)


def in_child(fn, *args):
    """Run ``fn(*args)`` in a forked process (its assertions fail the test with their traceback)."""
    return run_local(_call, 1, fn, args, timeout=120)[0]


def even_points(cap, stages: int) -> list[str]:
    names = cap.layer_names
    return [names[len(names) * s // stages] for s in range(1, stages)]


def run_stages(stages, args):
    value = (args, {})
    for stage in stages:
        value = stage(value)
    return value


def summed_grads(stages) -> dict[str, torch.Tensor]:
    """Each parameter's gradient summed over the stages' copies, under its canonical name."""
    total: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, param in stage.canonical_parameters().items():
            if param.grad is not None:
                total[name] = total[name] + param.grad if name in total else param.grad.clone()
    return total


@pytest.mark.parametrize("family", FAMILIES)
def test_stages_compose_to_the_model(family):
    in_child(check_composition, family)


def check_composition(family):
    model, args, cap = captured(family)
    for num_stages in (2, 3):
        check_stages(model, args, cap, num_stages)


def check_stages(model, args, cap, num_stages):
    reference = copy.deepcopy(model)
    split = split_graph(cap, even_points(cap, num_stages))
    stages = build_stages(copy.deepcopy(model), split)
    assert len(stages) == num_stages
    output = run_stages(stages, args)
    want = reference(*args)
    torch.testing.assert_close(output, want, rtol=0, atol=0)
    output.float().square().mean().backward()
    want.float().square().mean().backward()
    grads = summed_grads(stages)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=0, atol=0, msg=name)
    # The stages' state, mapped back, is the model's state_dict: same keys, same order, same values (BatchNorm
    # statistics updated by the forward included).
    state = consolidate_state_dict([s.state_dict() for s in stages], list(reference.state_dict()))
    assert list(state) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)


def test_tied_parameters_and_skip_values_cross_stages():
    in_child(check_tied_parameters_and_skip_values_cross_stages)


def check_tied_parameters_and_skip_values_cross_stages():
    model, args, cap = captured("gpt")
    split = split_graph(cap, ["blocks.1", "blocks.3"])
    # The tied embedding/projection is held by the first stage (lookup) and the last (projection).
    assert split.ties == {"tok.weight": [0, 2]}
    stages = build_stages(model, split)
    assert "head.weight" in stages[2].state_dict() and "tok.weight" in stages[2].state_dict()
    assert stages[0].tok.weight is not stages[2].tok.weight  # each stage its own copy
    # The boolean causal mask made in stage 0 is used by every block: it passes through stage 1 to stage 2.
    mask = next(n for n in cap.graph.nodes if n.name == "triu")
    assert mask.name in split.programs[1].input_names and mask.name in split.programs[1].output_names
    assert mask.name in split.programs[2].input_names
    assert mask.meta["val"].dtype == torch.bool


def test_shared_embedding_integer_inputs_and_masks_cross_stages():
    in_child(check_shared_embedding)


def check_shared_embedding():
    model, args, cap = captured("transformer")
    # Stage 1 begins at the second call of the shared embedding: the target tokens (int64) and the padding mask
    # (bool) cross, and the embedding is a tie group of stages 0 and 1.
    assert "embed#2" in cap.layer_names
    split = split_graph(cap, ["embed#2"])
    assert split.ties == {"embed.weight": [0, 1]}
    crossing = {name: val.dtype for name, val in zip(split.programs[1].input_names, split.programs[1].input_vals)}
    assert torch.int64 in crossing.values() and torch.bool in crossing.values(), crossing
    stages = build_stages(copy.deepcopy(model), split)
    reference = copy.deepcopy(model)
    output = run_stages(stages, args)
    torch.testing.assert_close(output, reference(*args), rtol=0, atol=0)
    output.sum().backward()
    reference(*args).sum().backward()
    torch.testing.assert_close(summed_grads(stages)["embed.weight"], reference.embed.weight.grad)


def test_resnet_skip_connection_crosses_with_its_block():
    in_child(check_resnet_skip_connection_crosses_with_its_block)


def check_resnet_skip_connection_crosses_with_its_block():
    model, args, cap = captured("resnet")
    # Cut inside a residual block: the block's input (the identity path) crosses beside the main path.
    split = split_graph(cap, ["layer2.0.conv2"])
    assert len(split.programs[1].input_names) == 2
    assert split.ties == {}


def test_split_points_are_module_names_in_run_order():
    in_child(check_split_points_are_module_names_in_run_order)


def check_split_points_are_module_names_in_run_order():
    model, args, cap = captured("gpt")
    split = split_graph(cap, ["blocks.2"])
    assert split.programs[1].layers[0] == "blocks.2.ln1"
    with pytest.raises(SplitError, match=r"split_points names 'blocks\.9', which is not a module that runs in forward. "
                                         r"Modules in the order they run: tok, pos, blocks, blocks\.0, "):
        split_graph(cap, ["blocks.9"])
    with pytest.raises(SplitError, match=r"split_points must follow the order the modules run in: 'blocks\.1' "
                                         r"\(layer \d+\) does not come after 'blocks\.2'"):
        split_graph(cap, ["blocks.2", "blocks.1"])
    with pytest.raises(SplitError, match="split point 'tok' is where the forward starts: it would leave stage 0 empty"):
        split_graph(cap, ["tok"])


def test_a_stage_refuses_an_input_it_was_not_captured_for():
    in_child(check_a_stage_refuses_an_input_it_was_not_captured_for)


def check_a_stage_refuses_an_input_it_was_not_captured_for():
    model, args, cap = captured("lstm")
    stages = build_stages(copy.deepcopy(model), split_graph(cap, ["rnn2"]))
    with pytest.raises(KeyError, match="Stage 0 has no captured graph for this input in training mode"):
        stages[0](((torch.zeros(3, 6, dtype=torch.long),), {}))
    stages[0].eval()
    with pytest.raises(KeyError, match="in evaluation mode"):
        stages[0]((args, {}))
    # A capture in eval mode (another mode, the same split points) adds its programs to the same stages.
    model.eval()
    for stage, program_split in zip(stages, [split_graph(capture(model, args), ["rnn2"])] * 2):
        stage.add_split(program_split)
    for stage in stages:
        stage.eval()
    with torch.no_grad():
        torch.testing.assert_close(run_stages(stages, args), model(*args))


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if x.sum() > 0:
            x = x * 2
        return self.b(x)


def test_untraceable_model_error_names_the_line_and_the_way_out():
    in_child(check_untraceable_model_error_names_the_line_and_the_way_out)


def check_untraceable_model_error_names_the_line_and_the_way_out():
    with pytest.raises(GraphCaptureError) as info:
        capture(Branchy(), (torch.randn(2, 4),))
    text = str(info.value)
    assert text.startswith("Could not trace Branchy.forward into a graph at ")
    assert "test_split.py:" in text and "in forward: if x.sum() > 0:" in text
    assert ("Move the branch out of forward (into training_step, say); or name where stages begin, "
            "PipeDreamStrategy(split_points=['model.layers.4', ...]): then only the innermost module holding them "
            "that the step calls is traced, and the code around it runs as it is on the first and last stages; "
            "or put the layers in one nn.Sequential attribute: PipeDreamStrategy splits that without tracing.") in text


def test_profile_is_a_dag_the_partitioner_splits():
    in_child(check_profile)


def check_profile():
    model, args, cap = captured("gpt")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile = profile_graph(cap, model, args, warmup=0, repeats=1)
    assert profile.names == cap.layer_names
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # Skip connections: some layer feeds one that is not next (the residual stream, the causal mask).
    assert any(b > a + 1 for a, b in profile.edges)
    # The cut after a block's last add carries the residual stream and the mask, and nothing from inside the block.
    points, plan = choose_split_points(cap, model, args, None, 3, profile=profile)
    assert len(points) == 2 and plan.stages[0].layers[0] == "tok"
    split = split_graph(cap, points)
    stages = build_stages(copy.deepcopy(model), split)
    torch.testing.assert_close(run_stages(stages, args), copy.deepcopy(model)(*args), rtol=0, atol=0)
