"""The pipeline engine without Lightning: numerics against a single process, PipeDream's rule, failures."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from pipedream_reference import Minibatch, PipeDreamRule, train_one_process
from torch import nn
from torch.func import functional_call

from lightning_pipedream.plan.balance import stage_slice
from lightning_pipedream.runtime.communication.transport import Transport
from lightning_pipedream.runtime.faults.launch import RankFailedError, run_local
from lightning_pipedream.runtime.pipeline import Pipeline

pytestmark = pytest.mark.multiprocess  # starts several processes: not in the fast suite

LR, MOMENTUM = 0.1, 0.9


def mlp(layers: int = 8, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers // 2):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods)


def batches(n: int, size: int = 10, width: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, width, generator=g), torch.randn(size, width, generator=g)) for _ in range(n)]


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def train_pipeline(rank, world, schedule, chunks, n_batches, batch_size, options):
    pipe = Pipeline(mlp(), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule=schedule, chunks=chunks, **options)
    losses = [pipe.step(x, y) for x, y in batches(n_batches, batch_size)]
    pipe.drain()
    return pipe.state_dict(), losses


def gather(results):
    state = {}
    for part, _ in results:
        state.update(part)
    return state, results[-1][1]


def assert_close_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_flushed_schedules_equal_single_process(schedule, stages):
    reference = mlp()
    want, want_losses = train_one_process(reference, sgd(reference.parameters()), batches(3))
    for chunks in (1, 3, 8):  # a batch of 10 does not divide into 3 or 8 micro-batches
        state, losses = gather(run_local(train_pipeline, stages, schedule, chunks, 3, 10, {}, timeout=90))
        assert_close_state(state, want)
        assert losses == pytest.approx(want_losses, rel=1e-5)


def pipedream_reference(n_batches: int, stages: int, vertical_sync: bool = False) -> dict:
    """PipeDream's rule in one process: stage s computes minibatch t's gradient at the weights
    after max(0, t - (stages - s) + 1) of its updates and applies it to its newest weights."""
    model = mlp()
    balance = [len(model) // stages + (1 if s < len(model) % stages else 0) for s in range(stages)]
    parts = [stage_slice(model, balance, s) for s in range(stages)]
    optimizers = [sgd(p.parameters()) for p in parts]
    history = [[{n: p.detach().clone() for n, p in part.named_parameters()}] for part in parts]
    for t, (x, y) in enumerate(batches(n_batches)):
        leaves = []
        h = x
        for s, part in enumerate(parts):
            version = max(0, t - stages + 1) if vertical_sync else max(0, t - (stages - s) + 1)
            params = {n: w.clone().requires_grad_() for n, w in history[s][version].items()}
            leaves.append(params)
            h = functional_call(part, params, (h,))
        loss = nn.functional.mse_loss(h, y)
        loss.backward()
        for s, part in enumerate(parts):
            for n, p in part.named_parameters():
                p.grad = leaves[s][n].grad
            optimizers[s].step()
            history[s].append({n: p.detach().clone() for n, p in part.named_parameters()})
    return model.state_dict()


@pytest.mark.parametrize("stages", [2, 3])
def test_pipedream_follows_weight_stashing_rule(stages):
    n = 7
    want = pipedream_reference(n, stages)
    state, _ = gather(run_local(train_pipeline, stages, "pipedream", 1, n, 10, {}, timeout=90))
    assert_close_state(state, want)
    # Without stashing the backward runs at the newest weights on the forward's activations: the rule's ablation
    # (tests/helpers/pipedream_reference.py), which differs from the stashing rule.
    state, _ = gather(run_local(train_pipeline, stages, "pipedream", 1, n, 10, {"weight_stashing": False}, timeout=90))
    model = mlp()
    balance = [len(model) // stages + (1 if s < len(model) % stages else 0) for s in range(stages)]
    rule = PipeDreamRule(model, balance, sgd, nn.functional.mse_loss, lambda t: {}, stashing=False)
    rule.segment([Minibatch(t, x, y) for t, (x, y) in enumerate(batches(n))])
    assert_close_state(state, model.state_dict())
    differences = [(state[k] - want[k]).abs().max().item() for k in want]
    assert max(differences) > 1e-4


def test_pipedream_vertical_sync_uses_input_stage_version():
    n, stages = 7, 3
    want = pipedream_reference(n, stages, vertical_sync=True)
    state, _ = gather(run_local(train_pipeline, stages, "pipedream", 1, n, 10, {"vertical_sync": True}, timeout=90))
    assert_close_state(state, want)
    assert max((state[k] - pipedream_reference(n, stages)[k]).abs().max().item() for k in want) > 1e-4


def count_versions(rank, world):
    pipe = Pipeline(mlp(), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule="pipedream")
    peak = 0
    for x, y in batches(8):
        pipe.step(x, y)
        peak = max(peak, pipe.engine.weights.stored_versions())
    pipe.drain()
    return peak, pipe.engine.weights.stored_versions(), pipe.engine.in_flight


def test_pipedream_keeps_at_most_in_flight_versions():
    results = run_local(count_versions, 3, timeout=90)
    for stage, (peak, after_drain, in_flight) in enumerate(results):
        # the live weights plus one stash per in-flight minibatch that predates an update
        assert peak <= 3 - stage, (stage, peak)
        assert after_drain == 1 and in_flight == 0


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)

    def forward(self, tokens):
        return self.emb(tokens)


class LSTMLayer(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.lstm = nn.LSTM(width, width, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


def sequence_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Embed(), LSTMLayer(), LSTMLayer(), nn.Linear(8, 20))


def sequence_batches():
    g = torch.Generator().manual_seed(2)
    for length in (5, 9, 3, 12, 7):  # a different sequence length every step
        tokens = torch.randint(0, 20, (6, length + 1), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def sequence_loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, 20), targets.reshape(-1))


def sequence_sgd(lr: float):
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)


def train_sequence(rank, world, schedule, chunks, lr=LR):
    pipe = Pipeline(sequence_model(), loss_fn=sequence_loss, optimizer=sequence_sgd(lr), schedule=schedule,
                    chunks=chunks)
    losses = [pipe.step(x, y) for x, y in sequence_batches()]
    pipe.drain()
    return pipe.state_dict(), losses


def test_sequence_lengths_change_every_step():
    reference = sequence_model()
    want, _ = train_one_process(reference, sgd(reference.parameters()), sequence_batches(), sequence_loss)
    state, losses = gather(run_local(train_sequence, 2, "1f1b", 2, timeout=90))
    assert len(losses) == 5 and all(loss > 0 for loss in losses)
    assert_close_state(state, want)
    # pipedream: PipeDream's rule (weight stashing) in one process, losses and weights; at lr 1.0 stage 0's
    # staleness moves the weights ~1e-4..1e-3 away from synchronous training (at lr 0.1 only ~1e-6).
    model = sequence_model()
    rule = PipeDreamRule(model, [2, 2], sequence_sgd(1.0), sequence_loss, lambda t: {})
    rule.segment([Minibatch(t, x, y) for t, (x, y) in enumerate(sequence_batches())])
    state, losses = gather(run_local(train_sequence, 2, "pipedream", 1, 1.0, timeout=90))
    assert losses == pytest.approx(rule.losses, rel=1e-5)
    assert_close_state(state, model.state_dict())
    synchronous = sequence_model()
    train_one_process(synchronous, sequence_sgd(1.0)(synchronous.parameters()), sequence_batches(), sequence_loss)
    assert max((state[k] - v).abs().max().item() for k, v in synchronous.state_dict().items()) > 1e-4


class Boom(nn.Linear):
    def forward(self, x):
        raise ValueError("boom in stage 1")


def failing_stage(rank, world):
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), Boom(4, 4)), loss_fn=nn.functional.mse_loss, optimizer=sgd,
                    schedule="1f1b", chunks=2)
    pipe.step(torch.randn(4, 4), torch.randn(4, 4))


def test_failing_stage_stops_every_rank_with_its_error():
    # run_local's watchdog (its timeout) kills ranks still running then, and reports only the ranks that reported:
    # "2 of 2 ranks failed" says the failure stopped both, not the watchdog.
    with pytest.raises(RankFailedError) as info:
        run_local(failing_stage, 2, timeout=120)
    text = str(info.value)
    assert "2 of 2 ranks failed" in text and "did not finish" not in text
    rank0 = text.split("--- rank 1 ---")[0]
    assert "PeerFailedError: Pipeline stage 1 failed with ValueError: boom in stage 1" in rank0


def killed_rank(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would: no traceback, no report
    torch.distributed.barrier()


def test_a_rank_that_dies_without_a_report_is_named_with_its_signal():
    with pytest.raises(RankFailedError) as info:
        run_local(killed_rank, 2, timeout=120)
    text = str(info.value)
    assert "--- rank 1 ---\nended without a report, killed by signal 9 (SIGKILL)" in text, text


def bad_pipeline(rank, world, case):
    if case == "stages":
        Pipeline(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), loss_fn=nn.functional.mse_loss, optimizer=sgd)
    elif case == "small-batch":
        pipe = Pipeline(mlp(), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule="gpipe", chunks=8)
        pipe.step(torch.randn(4, 8), torch.randn(4, 8))


def test_more_stages_than_layers_and_batch_smaller_than_chunks():
    with pytest.raises(RankFailedError, match="The model has 2 layers but 3 stages were asked for; every stage needs"):
        run_local(bad_pipeline, 3, "stages", timeout=60)
    with pytest.raises(RankFailedError, match=r"A batch of 4 samples cannot be split into chunks=8 micro-batches; use a "):
        run_local(bad_pipeline, 2, "small-batch", timeout=60)


def test_bad_arguments_are_rejected_before_any_communication():
    layers = mlp()
    with pytest.raises(ValueError, match="chunks must be an integer >= 1, got 0"):
        Pipeline(layers, loss_fn=nn.functional.mse_loss, optimizer=sgd, chunks=0)
    with pytest.raises(ValueError, match="Unknown schedule 'zigzag'. Choose one of: gpipe, 1f1b, pipedream"):
        Pipeline(layers, loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule="zigzag")
    with pytest.raises(ValueError, match="schedule='pipedream' runs each batch as one PipeDream minibatch"):
        Pipeline(layers, loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule="pipedream", chunks=4)
    with pytest.raises(TypeError, match="Pipeline needs an nn.Sequential"):
        Pipeline(nn.Linear(2, 2), loss_fn=nn.functional.mse_loss, optimizer=sgd)
    with pytest.raises(ValueError, match="virtual_stages=2 applies to schedule='interleaved' only"):
        Pipeline(layers, loss_fn=nn.functional.mse_loss, optimizer=sgd, virtual_stages=2)
    with pytest.raises(ValueError, match="schedule='2bw' does not support replicas yet; use replicas=None"):
        Pipeline(layers, loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule="2bw", replicas=[2, 1])
    with pytest.raises(ValueError, match="Prebuilt stage modules run one stage per process; use virtual_stages=1"):
        Pipeline([layers], loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule="interleaved", virtual_stages=2)
    from lightning_pipedream.runtime.execution.engine import PipelineEngine

    with pytest.raises(ValueError, match=r"schedule='interleaved' with virtual_stages=2 needs that many model chunks "
                                         "on each rank, got 1"):
        PipelineEngine(layers, 0, 2, None, schedule="interleaved", chunks=2, virtual_stages=2)


def test_stage_output_that_is_not_a_tensor_tree():
    from lightning_pipedream.runtime.stages.stage import Stage

    class Odd(nn.Module):
        def forward(self, x):
            return {"features": x, "meta": object()}

    stage = Stage(nn.Sequential(Odd()), index=0, num_stages=2)
    with pytest.raises(TypeError, match=r"output of stage 0 contains output of stage 0\['meta'\] of type object, "
                                        "which cannot cross a pipeline stage"):
        stage.forward(0, torch.randn(2, 2))


# ------------------------------------------------------------------------------------------
# The newer schedules (issue 13): zero bubble and interleaved equal one process, 2BW its rule,
# recomputation the same weights with fewer stored activations.


def single_process(n_batches: int = 3) -> tuple[dict, list[float]]:
    model = mlp()
    return train_one_process(model, sgd(model.parameters()), batches(n_batches))


@pytest.mark.parametrize(
    ("schedule", "stages", "options"),
    [  # (the Trainer runs 2 and 3 stages x 2, 4, 8 micro-batches of both: tests/strategy/test_exactness.py)
        ("zb-h1", 3, {}),
        ("interleaved", 2, {"virtual_stages": 4}),  # 8 stages of one layer each
        ("interleaved", 3, {"virtual_stages": 2}),  # 8 micro-batches: a first group of 5, then 3
        ("interleaved", 1, {"virtual_stages": 2}),  # both chunks on one process: the message stays in memory
    ],
)
def test_zero_bubble_and_interleaved_equal_single_process(schedule, stages, options):
    want, want_losses = single_process()
    for chunks in (2, 8):
        state, losses = gather(run_local(train_pipeline, stages, schedule, chunks, 3, 10, options, timeout=90))
        assert_close_state(state, want)
        assert losses == pytest.approx(want_losses, rel=1e-5)


def narrowing_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    widths = [8, 6, 5, 7, 8]  # each of the 4 chunks' inputs and outputs has a shape of its own
    return nn.Sequential(*[m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.Tanh())])


def count_messages(rank, world, chunks):
    sent = []
    isend = Transport._isend  # every message, through shared memory or torch.distributed

    def counting_isend(self, tensor, *args, **kwargs):
        sent[-1] += 1
        return isend(self, tensor, *args, **kwargs)

    Transport._isend = counting_isend
    pipe = Pipeline(narrowing_mlp(), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule="interleaved",
                    chunks=chunks, virtual_stages=2)
    for x, y in batches(3):
        sent.append(0)
        pipe.step(x, y)
    Transport._isend = isend
    return pipe.state_dict(), sent


def test_interleaved_link_sends_one_message_per_tree():
    # Two chunks per process: the link between the two processes carries activations and gradients of
    # three model edges, each of its own shape. Each edge keeps its own message layout, so after the
    # first step (which describes each edge once) every tree is one message: per process and step,
    # 3 edges out of 6 leave it, once per micro-batch.
    model = narrowing_mlp()
    want, _ = train_one_process(model, sgd(model.parameters()), batches(3))
    results = run_local(count_messages, 2, 5, timeout=90)
    assert_close_state(gather(results)[0], want)
    for _, sent in results:
        assert sent[1:] == [3 * 5, 3 * 5]
        assert sent[0] > 3 * 5


def two_bw_reference(n_batches: int) -> tuple[dict, list[float]]:
    """PipeDream-2BW's rule in one process: W(t+1) = W(t) - lr * grad f_t(W(t-1)), W(-1) = W(0); the
    gradient of minibatch t is that of its whole batch (micro-batch gradients coalesced)."""
    model = mlp()
    opt = sgd(model.parameters())
    before = {k: p.detach().clone() for k, p in model.named_parameters()}  # W(t-1)
    losses = []
    for x, y in batches(n_batches):
        params = {k: w.clone().requires_grad_() for k, w in before.items()}
        loss = nn.functional.mse_loss(functional_call(model, params, (x,)), y)
        grads = torch.autograd.grad(loss, list(params.values()))
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def train_two_bw(rank, world, chunks, n_batches):
    pipe = Pipeline(mlp(), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule="2bw", chunks=chunks)
    losses, versions = [], 0
    for x, y in batches(n_batches):
        losses.append(pipe.step(x, y))
        versions = max(versions, pipe.engine.weights.stored_versions())
    pipe.drain()
    return pipe.state_dict(), losses, versions, pipe.engine.in_flight


@pytest.mark.parametrize(("stages", "chunks"), [(1, 2), (2, 2), (2, 4), (3, 4), (4, 2)])
def test_two_bw_follows_its_rule_with_two_weight_versions(stages, chunks):
    n = 6
    want, want_losses = two_bw_reference(n)
    results = run_local(train_two_bw, stages, chunks, n, timeout=90)
    state = {k: v for part, *_ in results for k, v in part.items()}
    assert_close_state(state, want)
    assert results[-1][1] == pytest.approx(want_losses, rel=1e-5)
    assert all(versions == 2 and in_flight == 0 for _, _, versions, in_flight in results)
    # The one-step-late update is not synchronous training: the rule is what the test pins.
    assert max((state[k] - v).abs().max().item() for k, v in single_process(n)[0].items()) > 1e-3


def dropout_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(4):
        mods += [nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.3), nn.Linear(32, 8)]
    return nn.Sequential(*mods)


def train_recompute(rank, world, schedule, chunks, recompute):
    torch.manual_seed(100 + rank)  # each process's dropout masks
    options = {"virtual_stages": 2} if schedule == "interleaved" else {}
    pipe = Pipeline(dropout_mlp(), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule=schedule, chunks=chunks,
                    recompute=recompute, **options)
    pipe.engine.track_activations()
    for x, y in batches(3):
        pipe.step(x, y)
    pipe.drain()
    return pipe.state_dict(), pipe.engine.activation_bytes


@pytest.mark.parametrize(("schedule", "chunks"), [("1f1b", 4), ("zb-h1", 4), ("2bw", 2), ("interleaved", 2)])
def test_recompute_gives_the_same_weights_and_stores_less(schedule, chunks):
    kept = run_local(train_recompute, 2, schedule, chunks, False, timeout=90)
    replayed = run_local(train_recompute, 2, schedule, chunks, True, timeout=90)
    assert_close_state(gather([(s, None) for s, _ in replayed])[0], gather([(s, None) for s, _ in kept])[0])
    for (_, full), (_, inputs_only) in zip(kept, replayed):
        # Per stage of 4 Linear-Tanh-Dropout-Linear blocks on micro-batches of 10/chunks samples, measured
        # from what autograd saves: the recomputing stage keeps only its inputs (and the loss's on the last).
        assert inputs_only < full / 3, (full, inputs_only)
        assert inputs_only > 0


class TiedTwice(nn.Module):
    """One Linear used twice on the inputs' path: its weights are reached along the path itself."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        return self.linear(torch.tanh(self.linear(x)))


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("case", ["mlp", "lstm", "layernorm", "tied"])
def test_split_backward_equals_the_whole_backward(case, recompute):
    from lightning_pipedream.runtime.stages.stage import Stage

    torch.manual_seed(0)
    module, shape = {
        "mlp": (nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6)), (4, 6)),
        "lstm": (nn.Sequential(LSTMLayer(6), nn.Linear(6, 6)), (3, 5, 6)),
        "layernorm": (nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 6)), (4, 6)),
        "tied": (TiedTwice(), (4, 6)),
    }[case]
    stage = Stage(module, 1, 3, recompute=recompute)
    x, g = torch.randn(*shape, requires_grad=True), torch.randn(*shape)
    stage.forward(0, x)
    want_input = stage.backward(0, [g])[0]
    want = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    stage.forward(1, x.detach().requires_grad_())
    got_input = stage.backward_input(1, [g])[0]
    assert all(p.grad is None for p in module.parameters())  # B computes no weight gradient
    branches = stage._pending_weight[1][2]
    # From the branch points to the weights; a weight used along the path itself takes the whole backward. Under
    # recompute the weight half is one call from the outputs (each call would replay the forward).
    assert (branches is None) if recompute else branches.complete == (case != "tied")
    stage.backward_weight(1)
    torch.testing.assert_close(got_input, want_input, rtol=0, atol=0)
    for p, w in zip(module.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=1e-6, atol=1e-7)
    assert stage.in_flight() == 0


def count_replays(rank, world, recompute):
    forwards = [0]
    pipe = Pipeline(mlp(), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule="1f1b", chunks=2,
                    recompute=recompute)
    stage = pipe.engine.stage.module
    stage.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))
    for x, y in batches(2):
        pipe.step(x, y)
    return pipe.state_dict(), forwards[0]


def test_recompute_on_some_stages_only():
    # One flag per stage: stage 0 replays each micro-batch's forward in its backward, stage 1 keeps its activations
    reference = mlp()
    want, _ = train_one_process(reference, sgd(reference.parameters()), batches(2))
    results = run_local(count_replays, 2, [True, False], timeout=90)
    assert_close_state(gather([(state, None) for state, _ in results])[0], want)
    assert [forwards for _, forwards in results] == [2 * 2 * 2, 2 * 2]  # 2 batches x 2 micro-batches (x 2: replays)
    with pytest.raises(RankFailedError, match=r"recompute lists 3 flags for 2 model stages; give one per stage "
                                              r"\(\[True, False\]: stage 0 only\), or one bool for all"):
        run_local(count_replays, 2, [True, False, True], timeout=90)
