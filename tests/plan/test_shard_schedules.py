"""Sharded replicas with recompute, interleaved and zb-h1 in the plan: the memory model's terms by hand, the planner
choosing them when only they fit under a memory limit, and zb-h1's one all-gather per step."""

from __future__ import annotations

import pytest

from lightning_pipedream.plan.auto import NoPlanFitsError, auto_plan
from lightning_pipedream.plan.memory import StageBytes, predict_memory, stage_bytes
from lightning_pipedream.plan.profile import LayerProfile, Profile
from lightning_pipedream.plan.shards import can_shard, gathers_per_microbatch, gathers_per_step
from lightning_pipedream.plan.topology import Topology


def two_stages() -> list[StageBytes]:
    """Two stages of 3000 parameter bytes in units of 2000 and 1000, 400 bytes kept per batch, nothing on top."""
    stage = StageBytes(parameters=3000, input=0, layers=400, output=0, grad_working=0, grad_temps=0,
                       largest_parameter=2000, layer_parameters=(2000.0, 1000.0))
    return [stage, stage]


def test_every_flushed_schedule_shards_and_the_asynchronous_ones_do_not():
    assert all(can_shard(name, [2, 2]) for name in ("gpipe", "1f1b", "zb-h1", "interleaved"))
    assert not any(can_shard(name, [2, 2]) for name in ("pipedream", "2bw"))
    assert not can_shard("1f1b", [2, 1]) and not can_shard("zb-h1", [1, 1])


@pytest.mark.parametrize(("schedule", "shard"), [("1f1b", "full"), ("gpipe", "full"), ("gpipe", "grad_op")])
def test_a_recomputing_stage_holds_its_whole_stage_gathered(schedule, shard):
    # The replay inside the backward gathers every unit, and FSDP2 frees none after a forward that runs in a backward:
    # the whole stage (3000) and one unit's flat buffer (2000), where without recompute these gather two units (3000).
    plain, again = (predict_memory(two_stages(), schedule, 4, replicas=[2, 2], optimizer="momentum", shard=shard,
                                   recompute=rc)[1] for rc in (False, True))
    assert (plain.gathered, again.gathered) == (3000, 5000)
    assert again.whole_gradients == 3000 and again.recompute
    # the last stage keeps nothing between forward and backward (no output), and replays its 400 / 4
    assert (again.activations, again.replay) == (0, 100)
    assert again.predicted_peak_bytes == 4500 + 1500 + 5000 + 100


@pytest.mark.parametrize("shard", ["grad_op", "full"])
@pytest.mark.parametrize("chunks", [1, 4])
def test_zero_bubble_keeps_the_stage_gathered_and_its_gradients_whole_in_both_modes(shard, chunks):
    m = predict_memory(two_stages(), "zb-h1", chunks, replicas=[2, 2], optimizer="momentum", shard=shard)[0]
    # the whole stage and one unit's flat buffer, from the step's first forward to its last weight half; every weight
    # half adds into whole gradients, reduce-scattered once after the last (with one micro-batch too)
    assert (m.gathered, m.whole_gradients) == (5000, 3000)


def interleaved_chunks() -> list[StageBytes]:
    """Four model chunks (2 ranks x 2) of one 1000-byte unit each, 400 bytes kept per batch."""
    chunk = StageBytes(parameters=1000, input=0, layers=400, output=0, grad_working=0, grad_temps=0,
                       largest_parameter=1000, layer_parameters=(1000.0,))
    return [chunk] * 4


@pytest.mark.parametrize(("shard", "terms"), [
    # grad_op, rank 0 (F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 ...): in B0.0, chunk 0's first backward
    # (gathered since F0.0: its unit and the flat buffer, 2000; its gradients replace the unit as it is freed) beside
    # chunk 2, gathered again by F2.2 (1000) with its whole gradients from B2.0 (1000). Rank 1 reaches the same in
    # B3.1 (chunk 3 gathered by F3.1 with its whole gradients, chunk 1 gathered since F1.0).
    ("grad_op", (1000, 3000)),
    # full: each chunk gathers only while it computes: in B0.0 chunk 0's unit (1000) and gradients (1000) beside
    # chunk 2's whole gradients (1000), until chunk 2's last backward reduce-scatters them
    ("full", (2000, 1000)),
    # full, recomputing: the replay gathers the chunk with its flat buffer (2000); in B0.1 beside chunk 0's
    # gradients (whole since B0.0) and chunk 2's
    ("full-recompute", (2000, 2000)),
])
def test_interleaved_chunks_gather_and_reduce_scatter_each_on_their_own(shard, terms):
    shard, _, recompute = shard.partition("-")
    memory = predict_memory(interleaved_chunks(), "interleaved", 4, replicas=[2, 2], virtual_stages=2,
                            optimizer="momentum", shard=shard, recompute=bool(recompute))
    assert [(m.whole_gradients, m.gathered) for m in memory] == [terms, terms]
    m = memory[0]
    assert (m.parameters, m.gradients, m.optimizer_state) == (1000, 1000, 1000)  # the rank's 2000 over 2 replicas
    assert m.predicted_peak_bytes == 3000 + max(0, terms[0] - 1000) + terms[1] + m.activations + m.replay


def test_zero_bubble_gathers_once_per_step():
    assert [gathers_per_step("full", 4), gathers_per_step("grad_op", 4), gathers_per_step(None, 4)] == [8, 4, 0]
    assert gathers_per_step("full", 4, splits_backward=True) == gathers_per_step("grad_op", 8, True) == 1
    assert gathers_per_microbatch("full", splits_backward=True) == 0


# ---- the planner: 4 workers, Adam (two bytes of state per parameter byte), 1000 B/s links


def layers(count: int, activation: int, cuts: list[int]) -> Profile:
    """``count`` layers of 1000 parameter bytes and ``activation`` bytes kept each, cuts only after ``cuts``."""
    profile = [LayerProfile(f"l{i}", 1.0, 2.0, activation, 1000, grad_working_bytes=0, grad_temp_bytes=0,
                            pending_bytes=0, largest_parameter_bytes=1000) for i in range(count)]
    return Profile(profile, no_cut_after=[i for i in range(count - 1) if i not in cuts])


def plan(profile: Profile, limit: float | None, schedule: str, shard: str | None = "auto"):
    return auto_plan(profile, Topology.flat(4, 1000.0), limit, exact=True, optimizer="adam", max_chunks=4,
                     schedules=[schedule], shard=shard)


def test_sharded_stages_recompute_when_only_that_fits():
    # Two stages of 4 layers (4000 parameter bytes in units of 1000) on 2 replicas each, 1f1b, 4 micro-batches: stage
    # 0 holds 2 in flight of 8000 bytes kept per layer and batch. Sharded: 8000 of shards, the gradients whole (2000
    # more), and recomputing: the whole stage gathered with a unit's flat buffer (5000), 2 x 8000 / 4 of outputs kept
    # and (32000 - 8000) / 4 replayed (10000): 25000. Without recompute its activations take 2 x 32000 / 4 (full:
    # 28000, grad_op 31000); whole replicas hold 16000 of weights, gradients and state (26000 recomputing).
    profile = layers(8, 8000, cuts=[3])
    result = plan(profile, 25000, "1f1b")
    c = result.chosen
    assert (c.shard, c.replicas, c.chunks, c.recompute, c.peak_bytes) == ("grad_op", (2, 2), 4, (True, False), 25000)
    assert result.strategy_arguments() == {"schedule": "1f1b", "chunks": 4, "balance": [4, 4], "replicas": [2, 2],
                                           "recompute": [True, False], "shard": "grad_op"}
    assert result.shard_note == ("sharded (grad_op): with whole replicas this configuration needs 25.39 KiB on its "
                                 "fullest worker, over the limit of 24.41 KiB; sharded it needs 24.41 KiB")
    expected = predict_memory(stage_bytes(profile, [4, 4]), "1f1b", 4, replicas=[2, 2], recompute=[True, False],
                              shard="grad_op")
    assert list(c.memory) == expected  # the planner's tables allowed what the model predicts
    assert (expected[0].gathered, expected[0].replay) == (5000, 6000)
    full = plan(profile, 25000, "1f1b", shard="full").chosen
    assert (full.shard, full.recompute, full.peak_bytes) == ("full", (True, False), 25000)
    with pytest.raises(NoPlanFitsError, match=r"the least any needs is 26000 bytes .* recompute on stage 0\. .* or "
                                              r"shard the replicas"):
        plan(profile, 25000, "1f1b", shard=None)


def test_sharded_interleaved_chunks_when_only_they_fit():
    # Four 1-layer chunks of 1000 parameter bytes on 2 ranks x 2 replicas (no other layout has 4 chunks). Whole: 8000
    # of weights, gradients and state, and the all-reduce's copy (2000). Sharded (grad_op), 4 micro-batches: 4000 of
    # shards, 3000 of whole gradients and gathered chunks at worst, 1750 of activations.
    profile = layers(4, 1000, cuts=[0, 1, 2])
    whole = plan(profile, None, "interleaved", shard=None).chosen
    assert (whole.virtual_stages, whole.peak_bytes) == (2, 10000)
    result = plan(profile, 9000, "interleaved")
    c = result.chosen
    assert (c.schedule, c.virtual_stages, c.replicas, c.chunks, c.shard, c.peak_bytes) == (
        "interleaved", 2, (2, 2), 4, "grad_op", 8750)
    assert result.strategy_arguments() == {"schedule": "interleaved", "chunks": 4, "balance": [1, 1, 1, 1],
                                           "replicas": [2, 2], "virtual_stages": 2, "shard": "grad_op"}
    expected = predict_memory(stage_bytes(profile, [1, 1, 1, 1]), "interleaved", 4, replicas=[2, 2],
                              virtual_stages=2, shard="grad_op")
    assert list(c.memory) == expected
    assert (expected[0].whole_gradients, expected[0].gathered, expected[0].activations) == (1000, 3000, 1750)
    assert "1f1b" not in result.describe() and "sharded (grad_op) over 2 replicas" in result.describe()


def test_the_least_interleaved_plan_recomputes_only_where_it_lowers_the_peak():
    # Sharded, recompute gathers each chunk whole: the least memory is full without it (4000 + 2000 + 1750).
    with pytest.raises(NoPlanFitsError) as refused:
        plan(layers(4, 1000, cuts=[0, 1, 2]), 7000, "interleaved")
    assert refused.value.smallest_limit == 7750
    assert refused.value.candidate.label() == ("interleaved, 2 stages (2-2) x 2 chunks, 4 micro-batches, sharded "
                                               "(full) over 2 replicas")


def test_sharded_zero_bubble_when_only_it_fits_with_one_gather_per_step():
    # Two stages of 2 layers (2000 parameter bytes) on 2 replicas each, zb-h1, 4 micro-batches: 4000 of shards, the
    # gradients whole (1000 more) and the stage gathered through the step with a unit's flat buffer (3000), 1500 of
    # activations; whole replicas need 8000 and the all-reduce's copy (2000).
    profile = layers(4, 1000, cuts=[1])
    whole = plan(profile, None, "zb-h1", shard=None)
    assert whole.chosen.peak_bytes == 10000
    result = plan(profile, 9500, "zb-h1")
    c = result.chosen
    assert (c.schedule, c.replicas, c.chunks, c.recompute, c.peak_bytes) == ("zb-h1", (2, 2), 4, (False, False), 9500)
    assert c.shard == "grad_op"  # full is the same under a split backward (both keep the stage gathered): the tie
    assert list(c.memory) == predict_memory(stage_bytes(profile, [2, 2]), "zb-h1", 4, replicas=[2, 2], shard=c.shard)
    # One all-gather of the stage per step and one reduce-scatter, whatever the micro-batches: an all-reduce's
    # traffic, so each stage's sync and the step take what whole replicas take.
    assert [s.allreduce_s for s in result.plan.stages] == [s.allreduce_s for s in whole.plan.stages] == [1.0, 1.0]
    assert c.time_per_minibatch == pytest.approx(whole.chosen.time_per_minibatch)
    # 1f1b's grad_op gathers once per micro-batch: 1 s of reduce-scatter and 1 s per gather, per stage's 2 replicas
    one_f_one_b = plan(profile, 9500, "1f1b", shard="grad_op")
    assert one_f_one_b.plan.stages[0].allreduce_s == pytest.approx((1 + one_f_one_b.chosen.chunks) / 2)


@pytest.mark.parametrize("seed", range(12))
def test_the_planner_s_sharded_memory_is_the_model_s_on_random_profiles(seed):
    """shard='grad_op', 'full' or 'auto' on random chains and limits, every exact schedule: whatever the planner
    chooses (gpipe, 1f1b, zb-h1 or interleaved, recomputing or not), its memory is what predict_memory says, within the
    limit; a refusal's least fits."""
    import random

    rng = random.Random(seed)
    n = rng.randint(4, 9)
    profile = Profile([LayerProfile(f"l{i}", rng.uniform(0.1, 2), rng.uniform(0.1, 4), rng.randint(0, 8000),
                                    rng.randint(1, 5000)) for i in range(n)], extra={"input_bytes": rng.randint(0, 3000)})
    topology = Topology.flat(4, rng.choice([1e4, 1e6]))
    limit = rng.randint(4000, 40000)
    kwargs = {"exact": True, "optimizer": rng.choice(["sgd", "momentum", "adam"]), "max_chunks": 4,
              "shard": ("grad_op", "full", "auto")[seed % 3]}
    try:
        result = auto_plan(profile, topology, limit, **kwargs)
    except NoPlanFitsError as err:
        limit = err.smallest_limit
        result = auto_plan(profile, topology, limit, **kwargs)
    c = result.chosen
    expected = predict_memory(stage_bytes(profile, c.balance), c.schedule, c.chunks, replicas=c.replicas,
                              virtual_stages=c.virtual_stages, recompute=c.recompute, optimizer=kwargs["optimizer"],
                              shard=c.shard)
    assert list(c.memory) == expected
    assert c.peak_bytes <= limit
