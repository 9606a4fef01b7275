"""The pipeline under a model of NCCL's point-to-point rules: every schedule runs without a deadlock through the
directional transport and equals one process (or its schedule's rule); the one-group ordering deadlocks in it."""

from __future__ import annotations

import copy

import pytest
import torch
from pipedream_reference import Minibatch, PipeDreamRule, train_one_process
from torch import nn
from torch.func import functional_call

from lightning_pipedream.runtime.communication.transport import Transport
from lightning_pipedream.runtime.pipeline import Pipeline
from lightning_pipedream.schedule.builders import inference
from lightning_pipedream.testing.nccl_model import DeadlockError, PointToPointModel

LR, MOMENTUM = 0.1, 0.9


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(4):
        mods += [nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*mods)


def batches(n: int, size: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 8, generator=g), torch.randn(size, 8, generator=g)) for _ in range(n)]


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def even(layers: int, stages: int) -> list[int]:
    return [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]


def train(world: int, schedule: str, chunks: int, steps: int, transport: str = "directional", **options) -> tuple:
    """``world`` ranks as threads of this process under the model train one Pipeline: the merged weights and the
    last stage's losses."""
    model = PointToPointModel(world, watchdog_s=30)
    layers = mlp()  # made once: the ranks' threads share torch's random generator

    def rank_main(rank: int):
        pipe = Pipeline(copy.deepcopy(layers), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule=schedule, chunks=chunks,
                        transport=transport, reverse_group="reverse" if transport == "directional" else None,
                        **options)
        assert pipe.transport.directional == (transport == "directional")
        losses = [pipe.step(x, y) for x, y in batches(steps)]
        pipe.drain()
        return pipe.state_dict(), losses

    results = model.run(rank_main, timeout=60)
    state = {k: v for part, _ in results for k, v in part.items()}
    # The losses of the rank that computes them: the last (rank 0 under a V schedule).
    losses = next(losses for _, losses in reversed(results) if any(loss is not None for loss in losses))
    return state, losses, model


def assert_close_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


# ------------------------------------------------------------------------------------------ the model itself
def both_send_then_receive(rank: int, grouped: bool, directional: bool) -> float:
    peer = 1 - rank
    out, into = torch.full((4,), float(rank)), torch.empty(4)
    if grouped:
        ops = [torch.distributed.P2POp(torch.distributed.isend, out, peer),
               torch.distributed.P2POp(torch.distributed.irecv, into, peer)]
        for work in torch.distributed.batch_isend_irecv(ops):
            work.wait()
    else:
        up, down = (None, "down") if directional else (None, None)
        send = torch.distributed.isend(out, peer, group=up if rank < peer else down)
        torch.distributed.irecv(into, peer, group=up if peer < rank else down).wait()
        send.wait()
    return into[0].item()


def test_two_ranks_that_both_send_first_deadlock_and_the_model_names_both_stream_heads():
    with pytest.raises(DeadlockError) as caught:
        PointToPointModel(2).run(lambda rank: both_send_then_receive(rank, False, False), timeout=30)
    words = str(caught.value)
    assert "no progress in" not in words  # found by the model, not by its watchdog; the run's timeout raises another
    assert "rank 0 with 1: call #0 [send to 1 (16 B)]" in words
    assert "rank 1 with 0: call #0 [send to 0 (16 B)]" in words


@pytest.mark.parametrize(("grouped", "directional"), [(True, False), (False, True)])
def test_a_group_or_a_stream_per_direction_lets_both_progress(grouped, directional):
    model = PointToPointModel(2)
    assert model.run(lambda rank: both_send_then_receive(rank, grouped, directional)) == [1.0, 0.0]
    assert model.messages == 2


def test_a_receive_posted_ahead_holds_back_the_send_behind_it():
    def rank_main(rank: int) -> None:
        into = torch.empty(2)
        posted = torch.distributed.irecv(into, 1 - rank)  # at the head of the pair's stream
        torch.distributed.isend(torch.ones(2), 1 - rank)  # queued behind it: never reaches the head
        posted.wait()

    with pytest.raises(DeadlockError, match=r"rank 0 with 1: call #0 \[recv from 1 \(8 B\)\]"):
        PointToPointModel(2).run(rank_main, timeout=30)


def test_a_receive_of_another_size_is_an_error():
    def rank_main(rank: int) -> None:
        if rank == 0:
            torch.distributed.isend(torch.ones(3), 1).wait()
        else:
            torch.distributed.irecv(torch.empty(2), 0).wait()

    with pytest.raises(RuntimeError, match="rank 0's send of 12 B .* met rank 1's receive of 8 B"):
        PointToPointModel(2).run(rank_main, timeout=30)


# ------------------------------------------------------------------------------------------ every schedule
@pytest.mark.parametrize(
    ("schedule", "stages", "chunks", "options"),
    [
        ("gpipe", 2, 4, {}),
        ("gpipe", 4, 3, {}),  # a batch of 12 in 3
        ("1f1b", 2, 4, {}),
        ("1f1b", 3, 5, {}),  # 12 does not divide by 5: micro-batches of unequal sizes, descriptions change
        ("1f1b", 4, 8, {}),
        ("zb-h1", 3, 4, {}),
        ("interleaved", 2, 4, {"virtual_stages": 2}),
        ("interleaved", 3, 3, {"virtual_stages": 2}),
        ("1f1b", 2, 2, {"recompute": True}),
        ("zb-v", 2, 4, {}),  # a V: rank 0 holds stages 0 and 3, the loss
        ("zb-v", 3, 5, {}),  # micro-batches of unequal sizes, fewer than 2P - 1
        ("dualpipev", 2, 4, {}),
        ("dualpipev", 3, 6, {}),
        ("zb-v", 4, 8, {}),  # 8 chunks of one layer each
        ("dualpipev", 4, 8, {}),
    ],
)
def test_flushed_schedules_equal_one_process_under_nccl_rules(schedule, stages, chunks, options):
    reference = mlp()
    want, want_losses = train_one_process(reference, sgd(reference.parameters()), batches(3))
    state, losses, model = train(stages, schedule, chunks, 3, **options)
    assert_close_state(state, want)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert model.messages > 0


@pytest.mark.parametrize(("stages", "vertical_sync"), [(2, False), (3, False), (4, False), (3, True)])
def test_pipedream_follows_its_rule_under_nccl_rules(stages, vertical_sync):
    n = 7
    model = mlp()
    rule = PipeDreamRule(model, even(len(model), stages), sgd, nn.functional.mse_loss, lambda t: {},
                         vertical_sync=vertical_sync)
    rule.segment([Minibatch(t, x, y) for t, (x, y) in enumerate(batches(n))])
    state, _, _ = train(stages, "pipedream", 1, n, vertical_sync=vertical_sync)
    assert_close_state(state, model.state_dict())


def two_bw_rule(n: int) -> dict:
    """PipeDream-2BW in one process: W(t+1) = W(t) - lr * grad f_t(W(t-1)), with W(-1) = W(0)."""
    model = mlp()
    opt = sgd(model.parameters())
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    for x, y in batches(n):
        params = {k: w.clone().requires_grad_() for k, w in before.items()}
        grads = torch.autograd.grad(nn.functional.mse_loss(functional_call(model, params, (x,)), y),
                                    list(params.values()))
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize(("stages", "chunks"), [(2, 2), (3, 4)])
def test_two_bw_follows_its_rule_under_nccl_rules(stages, chunks):
    state, _, _ = train(stages, "2bw", chunks, 5)
    assert_close_state(state, two_bw_rule(5))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_unequal_replicas_equal_one_process_under_nccl_rules(schedule):
    # 3 ranks: stage 0 on two replicas (each half of every batch, gradients all-reduced), stage 1 on one.
    reference = mlp()
    want, _ = train_one_process(reference, sgd(reference.parameters()), batches(3))
    state, _, _ = train(3, schedule, 2, 3, replicas=[2, 1])
    assert_close_state(state, want)


def test_round_robin_pipedream_runs_under_nccl_rules():
    model = PointToPointModel(3, watchdog_s=30)
    layers = mlp()

    def rank_main(rank: int):
        pipe = Pipeline(copy.deepcopy(layers), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule="pipedream",
                        replicas=[2, 1], transport="directional", reverse_group="reverse")
        losses = [pipe.step(x, y) for x, y in batches(5)]
        pipe.drain()
        return pipe.state_dict(), losses

    results = model.run(rank_main, timeout=60)
    for key, value in results[0][0].items():  # the replicas of stage 0 stay identical
        assert torch.equal(value, results[1][0][key]), key
    assert all(loss is not None and loss > 0 for loss in results[2][1])


def test_several_minibatches_per_step_and_evaluation_under_nccl_rules():
    """pipedream admitting 3 minibatches per step (as ``minibatches_per_batch=3`` does) equals 3 one-minibatch
    steps; after a drain, evaluation's inference schedule gives one process's outputs at the drained weights."""
    stages, n = 3, 6
    data = batches(n)
    model = PointToPointModel(stages, watchdog_s=30)
    layers = mlp()
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))

    def rank_main(rank: int):
        pipe = Pipeline(copy.deepcopy(layers), loss_fn=nn.functional.mse_loss, optimizer=sgd, schedule="pipedream",
                        transport="directional", reverse_group="reverse")
        engine = pipe.engine

        def inputs(mb: int) -> torch.Tensor:
            return data[mb][0]

        def loss(mb: int, out: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(out, data[mb][1])

        for _ in range(n // 3):
            engine.train_step(inputs, loss, pipe._update, minibatches=3)
        pipe.drain()
        outputs = engine.executor.run(inference(stages, 2).actions[rank], inputs=lambda mb: x.chunk(2)[mb],
                                      loss=lambda mb, out: out.detach(), optimizer_step=lambda a: None, train=False)
        return pipe.state_dict(), outputs, x

    results = model.run(rank_main, timeout=60)
    state = {k: v for part, _, _ in results for k, v in part.items()}
    reference = mlp()
    rule = PipeDreamRule(reference, even(len(reference), stages), sgd, nn.functional.mse_loss, lambda t: {})
    rule.segment([Minibatch(t, x, y) for t, (x, y) in enumerate(data)])
    assert_close_state(state, reference.state_dict())
    _, outputs, x = results[-1]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([outputs[0], outputs[1]]), reference(x), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ the planted ordering
@pytest.mark.parametrize(("schedule", "stages", "chunks"), [("1f1b", 2, 4), ("pipedream", 3, 1), ("gpipe", 2, 2)])
def test_one_group_for_both_directions_deadlocks_under_nccl_rules(schedule, stages, chunks):
    """What ran before the directional transport (both directions of a link on one group, receives posted
    ahead): the model finds its deadlock within seconds and names the ranks' stream heads."""
    with pytest.raises(DeadlockError) as caught:
        train(stages, schedule, chunks, 3, transport="gloo")
    words = str(caught.value)
    assert "no progress in" not in words  # the deadlock check answered, not the model's watchdog
    assert "deadlock under NCCL's point-to-point rules: rank 0 waits on" in words
    assert "Stream heads: rank 0 with 1: call #" in words


def test_transport_directional_needs_a_reverse_group():
    with pytest.raises(ValueError, match=r"transport='directional' needs reverse_group= \(a second process group "
                                         r"of the same ranks, for the messages to lower ranks\)"):
        Transport(kind="directional")
