"""A plan made for another model says how many layers each has and which layer differs first."""

from __future__ import annotations

from lightning_pipedream.strategy.setup.planning import plan_mismatch_words


def test_a_plan_for_another_model_names_the_counts_and_the_first_differing_layer():
    assert plan_mismatch_words("plan.json", [str(i) for i in range(13)], [str(i) for i in range(7)], "layers") == (
        "The plan plan.json was made for another model: it plans 13 layers and the model's nn.Sequential (layers) "
        "has 7; the first that differs is layer 7: '7' in the plan, absent (the model ends at layer 6) in the model. "
        "Profile this model to make its plan (python -m lightning_pipedream plan), or drop plan= to plan at the first "
        "batch.")
    assert "the first that differs is layer 1: 'encoder' in the plan, 'embed' in the model." in plan_mismatch_words(
        "p.json", ["0", "encoder", "2"], ["0", "embed", "2"], "blocks")
    assert "layer 2: absent (the plan ends at layer 1) in the plan, '2' in the model." in plan_mismatch_words(
        "p.json", ["0", "1"], ["0", "1", "2"], "blocks")
