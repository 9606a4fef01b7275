"""In-process unit tests of the pure parts the multi-process runs rely on: tensor trees, split/merge, weight versions."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn

from lightning_pipedream.runtime.communication.microbatch import batch_size, merge, split
from lightning_pipedream.runtime.stages.weights import WeightVersions
from lightning_pipedream.tree import TensorTreeError, flatten, map_tensors, tensors, unflatten

Pair = namedtuple("Pair", "x y")


# --------------------------------------------------------------------------------------------
# Tensor trees


def test_flatten_unflatten_round_trip_keeps_structure_and_constants():
    a, b, c = torch.zeros(2), torch.ones(3), torch.arange(4)
    tree = {"x": (a, [b, None]), "n": 3, "s": "text", "y": c}
    leaves, spec = flatten(tree)
    assert [t is u for t, u in zip(leaves, [a, b, c])] == [True, True, True]
    rebuilt = unflatten(leaves, spec)
    assert rebuilt["n"] == 3 and rebuilt["s"] == "text" and rebuilt["x"][1][1] is None
    assert isinstance(rebuilt["x"], tuple) and isinstance(rebuilt["x"][1], list)


def test_flatten_names_the_path_of_what_cannot_cross_a_stage():
    with pytest.raises(TensorTreeError, match=r"output of stage 1 contains output of stage 1\['a'\]\[1\] of type set"):
        flatten({"a": (torch.zeros(1), {1})}, "output of stage 1")


def test_map_tensors_keeps_namedtuples_and_foreign_leaves():
    marker = object()
    tree = [Pair(torch.ones(2), marker), {"k": torch.zeros(1)}]
    out = map_tensors(lambda t: t + 1, tree)
    assert isinstance(out[0], Pair) and out[0].y is marker
    assert torch.equal(out[0].x, torch.full((2,), 2.0)) and torch.equal(out[1]["k"], torch.ones(1))
    assert [t.shape for t in tensors(tree)] == [torch.Size([2]), torch.Size([1])]


# --------------------------------------------------------------------------------------------
# split / merge


def test_split_sizes_differ_by_at_most_one_and_merge_restores_the_batch():
    batch = {"x": torch.arange(10.0).reshape(5, 2), "y": torch.arange(5), "scale": torch.tensor(2.0), "tag": "b"}
    parts = split(batch, 3)
    assert [batch_size(p) for p in parts] == [2, 2, 1]
    assert all(p["tag"] == "b" and p["scale"].item() == 2.0 for p in parts)  # 0-dim and constants go to each part
    merged = merge([{"x": p["x"], "y": p["y"]} for p in parts])
    assert torch.equal(merged["x"], batch["x"]) and torch.equal(merged["y"], batch["y"])


def test_merge_stacks_zero_dim_outputs():
    assert torch.equal(merge([torch.tensor(1.0), torch.tensor(2.0)]), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize(
    ("batch", "chunks", "message"),
    [
        (torch.zeros(2, 3), 3, "A batch of 2 samples cannot be split into chunks=3 micro-batches; use a batch size"),
        (torch.zeros(2), 0, "chunks must be >= 1, got 0"),
        ((torch.zeros(2), torch.zeros(3)), 1, r"different sizes along dim 0 \(\[2, 3\]\)"),
        (torch.tensor(1.0), 1, "no tensor with a batch dimension"),
    ],
)
def test_split_errors_say_what_to_change(batch, chunks, message):
    with pytest.raises(ValueError, match=message):
        split(batch, chunks)


# --------------------------------------------------------------------------------------------
# WeightVersions


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(2, 1, bias=False)


def _sgd_step(layer: nn.Linear, versions: WeightVersions, lr: float = 0.5) -> None:
    versions.before_update()
    torch.optim.SGD([layer.weight], lr=lr).step()  # in place, or out of place where a stash needs the storage
    layer.weight.grad = None
    versions.after_update()


def test_stashed_backward_uses_the_weights_of_its_forward():
    layer = _linear()
    w0 = layer.weight.detach().clone()
    versions = WeightVersions(layer)
    x = torch.ones(1, 2)
    p0 = versions.forward_params(0)
    out0 = torch.func.functional_call(layer, p0, (x,))
    p1 = versions.forward_params(1)
    out1 = torch.func.functional_call(layer, p1, (x,))
    (out0 * out0).sum().backward()  # grad = 2 * out0 * x, at w0
    versions.collect_grads(0)
    assert torch.allclose(layer.weight.grad, 2 * (x @ w0.T) * x)
    _sgd_step(layer, versions)
    assert torch.equal(p1["weight"], w0), "the update wrote into the weights minibatch 1's forward saved"
    assert versions.stored_versions() == 2  # live + the one minibatch 1 still needs
    (out1 * out1).sum().backward()
    versions.collect_grads(1)
    assert torch.allclose(layer.weight.grad, 2 * (x @ w0.T) * x)  # at w0 again, not the updated weights
    assert versions.stored_versions() == 1
    versions.clear()


def test_without_stashing_updates_go_into_the_live_storage():
    layer = _linear()
    versions = WeightVersions(layer, stashing=False)
    p0 = versions.forward_params(0)
    layer.weight.grad = torch.ones_like(layer.weight)
    _sgd_step(layer, versions)
    assert torch.equal(p0["weight"], layer.weight.detach())  # the forward's leaves see the new weights
    assert versions.stored_versions() == 1


def test_vertical_sync_serves_an_old_version_until_no_one_needs_it():
    layer = _linear()
    w0 = layer.weight.detach().clone()
    versions = WeightVersions(layer, vertical_sync=True)
    layer.weight.grad = torch.ones_like(layer.weight)
    _sgd_step(layer, versions)  # version 0 is kept for vertical sync
    old = versions.forward_params(5, version=0)
    assert torch.equal(old["weight"], w0) and versions.num_updates == 1
    newest = versions.forward_params(6, version=7)  # a version from the future means the live one
    assert torch.equal(newest["weight"], layer.weight.detach())
    versions.after_update(keep_from=1)  # minibatch 5 still holds version 0: kept
    assert torch.equal(versions.forward_params(7, version=0)["weight"], w0)
    for mb in (5, 6, 7):
        versions.collect_grads(mb)
    versions.after_update(keep_from=3)
    with pytest.raises(RuntimeError, match="Weight version 0 is no longer stored"):
        versions.forward_params(8, version=0)


def test_weight_versions_refuse_misuse():
    with pytest.raises(ValueError, match="vertical_sync=True needs weight_stashing=True"):
        WeightVersions(_linear(), stashing=False, vertical_sync=True)
    versions = WeightVersions(_linear())
    versions.forward_params(0)
    with pytest.raises(RuntimeError, match=r"Minibatches \[0\] are still in flight; drain the pipeline first"):
        versions.clear()


def test_collect_grads_accumulates_over_microbatches():
    layer = _linear()
    versions = WeightVersions(layer, stashing=False)
    x = torch.ones(1, 2)
    for mb in range(2):
        params = versions.forward_params(mb)
        torch.func.functional_call(layer, params, (x,)).sum().backward()
        versions.collect_grads(mb)
    assert torch.equal(layer.weight.grad, 2 * x)


def test_live_storage_is_updated_in_place_once_its_last_user_is_done():
    layer = _linear()
    versions = WeightVersions(layer)
    ptr = layer.weight.data_ptr()
    out = torch.func.functional_call(layer, versions.forward_params(0), (torch.ones(1, 2),))
    out.sum().backward()
    versions.collect_grads(0)  # minibatch 0 no longer needs the live storage
    _sgd_step(layer, versions)
    assert layer.weight.data_ptr() == ptr, "no minibatch was in flight: the update needs no copy"
    assert versions.num_updates == 1 and versions.stored_versions() == 1
    layer.weight.grad = torch.ones_like(layer.weight)
    _sgd_step(layer, versions)
    assert versions.num_updates == 2


def test_a_finished_stash_is_reused_by_the_next_copy():
    # PipeDream's steady state on a first stage: minibatch t+1's forward uses the live weights when
    # minibatch t's update comes, so each update copies; the storage of the stash whose backward is
    # done is written into instead of allocating a new one. (The copy path: out of place, SGD writes the new
    # weights into the gradient's storage instead; test_out_of_place_* below.)
    layer = _linear()
    versions = WeightVersions(layer, out_of_place=False)
    x = torch.ones(1, 2)
    outs = {0: torch.func.functional_call(layer, versions.forward_params(0), (x,))}
    storages = [layer.weight.detach()]  # kept alive here: a fresh allocation cannot land at its address
    for t in range(4):
        outs[t + 1] = torch.func.functional_call(layer, versions.forward_params(t + 1), (x,))
        outs.pop(t).sum().backward()
        versions.collect_grads(t)
        _sgd_step(layer, versions)
        storages.append(layer.weight.detach())
        assert versions.stored_versions() == 2
    pointers = [s.data_ptr() for s in storages]
    assert len(set(pointers[:2])) == 2  # the first copy allocates (no stash has finished yet)
    assert pointers[2:] == [pointers[0], pointers[1], pointers[0]], "later copies reuse the finished stashes"
    # d(w . x)/dw = x at any weights: four updates of 0.5 x, copied forward through the reused storages
    torch.testing.assert_close(layer.weight.detach(), _linear().weight.detach() - 4 * 0.5 * x)


def test_collect_grads_skips_frozen_parameters_and_keeps_the_rest():
    torch.manual_seed(0)
    layer = nn.Linear(2, 1)
    layer.weight.requires_grad_(False)  # the first parameter gets no gradient
    versions = WeightVersions(layer)
    out = torch.func.functional_call(layer, versions.forward_params(0), (torch.ones(1, 2),))
    out.sum().backward()
    versions.collect_grads(0)
    assert layer.weight.grad is None
    assert torch.equal(layer.bias.grad, torch.ones(1))


def test_vertical_sync_serves_the_live_version_by_number_and_keeps_keep_from():
    layer = _linear()
    versions = WeightVersions(layer, vertical_sync=True)
    live = versions.forward_params(0, version=0)  # the live version asked for by its number
    assert torch.equal(live["weight"], layer.weight.detach())
    torch.func.functional_call(layer, live, (torch.ones(1, 2),)).sum().backward()
    versions.collect_grads(0)
    w0 = layer.weight.detach().clone()
    _sgd_step(layer, versions)
    versions.after_update(keep_from=0)  # version 0 may still be asked for: kept
    assert torch.equal(versions.forward_params(1, version=0)["weight"], w0)


def test_a_module_without_parameters_has_no_stored_versions():
    assert WeightVersions(nn.ReLU()).stored_versions() == 0


def _first_stage_steady_state(
    out_of_place: bool, make_optimizer, steps: int = 5, closure=None, flat_grads: bool = False
) -> tuple[nn.Sequential, WeightVersions, list[list[int]]]:
    """PipeDream's first stage: minibatch t+1's forward runs on the live weights before minibatch t's update,
    so every update needs the old weights kept. Returns the model, its versions and each update's storages.
    ``flat_grads``: the gradients are views into one flat buffer (as a bucketed all-reduce leaves them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    versions = WeightVersions(model, out_of_place=out_of_place)
    optimizer = make_optimizer(model.parameters())
    xs = torch.randn(steps + 1, 2, 4, generator=torch.Generator().manual_seed(1))
    outs = {0: torch.func.functional_call(model, versions.forward_params(0), (xs[0],))}
    storages = []
    for t in range(steps):
        outs[t + 1] = torch.func.functional_call(model, versions.forward_params(t + 1), (xs[t + 1],))
        (outs.pop(t) ** 2).sum().backward()
        versions.collect_grads(t)
        if flat_grads:
            flat = torch.cat([p.grad.flatten() for p in model.parameters()])
            for p, part in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()])):
                p.grad = part.view_as(p)
        versions.before_update()
        optimizer.step() if closure is None else optimizer.step(lambda: closure(model))
        optimizer.zero_grad(set_to_none=True)
        versions.after_update()
        storages.append([p.data_ptr() for p in model.parameters()])
    return model, versions, storages


@pytest.mark.parametrize("settings", [{}, {"weight_decay": 0.1}, {"maximize": True}, {"lr": torch.tensor(0.05)}])
def test_out_of_place_sgd_stashes_without_a_copy_and_equals_the_copy_path(settings):
    # the update writes the new weights into the finished stash's storage: no copy, the same values to the bit
    make = lambda params: torch.optim.SGD(params, **{"lr": 0.1, **settings})  # noqa: E731
    model, versions, storages = _first_stage_steady_state(True, make)
    reference, copied, copy_storages = _first_stage_steady_state(False, make)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert versions.copies == 0 and copied.copies == 5
    # each gradient (or the tensor made from it: weight decay, maximize) became its parameter's new weights
    assert versions.gradients_reused == 5 * len(list(model.parameters()))
    assert versions.stored_versions() == 2


def test_a_gradient_that_is_a_view_is_not_written_into():
    # gradients that are views into one flat buffer stay gradients: the update writes into the finished stash
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    model, versions, storages = _first_stage_steady_state(True, sgd, flat_grads=True)
    reference, _, _ = _first_stage_steady_state(False, sgd)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert versions.copies == 0 and versions.gradients_reused == 0
    # two storages per parameter in turn (the live one, and the stash of the minibatch in flight), as the copy's
    assert len({tuple(s) for s in storages[1:]}) == 2 and storages[1] == storages[3] != storages[2]
    assert versions.stored_versions() == 2


def test_out_of_place_update_runs_after_the_closure_and_falls_back_to_the_copy_elsewhere():
    # Lightning clips gradients inside the closure that the optimizer's step calls: the update sees them clipped
    def clip(model: nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)

    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    model, versions, _ = _first_stage_steady_state(True, sgd, closure=clip)
    reference, _, _ = _first_stage_steady_state(False, sgd, closure=clip)
    assert versions.copies == 0 and all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    # momentum has a buffer that the step updates: the stash is copied first, as without out_of_place
    momentum = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    model, versions, _ = _first_stage_steady_state(True, momentum)
    reference, _, _ = _first_stage_steady_state(False, momentum)
    assert versions.copies == 5 and all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_an_in_place_update_outside_an_optimizer_is_refused_while_a_stash_needs_the_weights():
    layer = _linear()
    versions = WeightVersions(layer)
    torch.func.functional_call(layer, versions.forward_params(0), (torch.ones(1, 2),))  # minibatch 0 in flight
    versions.before_update()
    with torch.no_grad():
        layer.weight -= 0.5  # no optimizer: nothing moved the live weights away first
    with pytest.raises(RuntimeError, match=r"Parameters \['weight'\] were updated in place outside a torch.optim "
                       r"optimizer's step .* or build WeightVersions\(\.\.\., out_of_place=False\)"):
        versions.after_update()
    copying = WeightVersions(layer, out_of_place=False)
    leaves = copying.forward_params(0)
    kept = leaves["weight"].detach().clone()
    copying.before_update()
    with torch.no_grad():
        layer.weight -= 0.5
    copying.after_update()
    assert torch.equal(leaves["weight"], kept)  # the copy path protected minibatch 0's weights


def test_a_direct_stage_runs_on_its_parameters_and_refuses_to_update_under_a_minibatch_in_flight():
    # the last stage of a straight pipedream pipeline: forward, backward, update, in that order, on the parameters
    layer = _linear()
    versions = WeightVersions(layer, direct=True)
    assert versions.forward_params(0) is None  # the stage runs the module itself
    layer(torch.ones(1, 2)).sum().backward()
    versions.collect_grads(0)
    _sgd_step(layer, versions)  # in place: nothing in flight
    assert versions.staleness == [0] and versions.stored_versions() == 1
    versions.forward_params(1)
    with pytest.raises(RuntimeError, match=r"Minibatches \[1\] ran their forward on this stage's parameters and are "
                       r"still in flight at an update; a stage that holds several needs WeightVersions\(direct=False\)"):
        versions.before_update()
