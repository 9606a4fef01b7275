"""In one process: micro-batch weights for a loss that is a mean over counted items (given by mean_over=, or the
labelled tokens of the labels a step passes to its model), batches smaller than chunks,
and the refusal of a last batch that a 2bw step cannot run (the Trainer runs are in test_graph_path.py)."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipedream.runtime.execution.engine import PipelineEngine
from lightning_pipedream.runtime.execution.shares import BatchShares
from lightning_pipedream.schedule.builders import build_schedule, pipedream_drain
from lightning_pipedream.strategy.setup.calls import ForwardCall, SubmoduleCall, pipelined_call
from lightning_pipedream.strategy.setup.checks import check_last_batch_fits
from lightning_pipedream.strategy.setup.labels import labelled_token_counter, loss_shifts_labels


def lm_batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.arange(12).view(4, 3)
    labels = tokens.clone()
    labels[0, 1:] = -100  # sample 0 keeps 1 token, sample 1 all 3; samples 2, 3: 2 and 3
    labels[2, 2] = -100
    return tokens, labels


def test_mean_over_weighs_each_micro_batch_by_its_count_and_the_sum_is_the_batch_mean():
    tokens, labels = lm_batch()
    shares = BatchShares.of((tokens, labels), 2, mean_over=lambda batch: (batch[1] != -100).sum())
    assert shares.counts == (4.0, 5.0)
    assert [shares.weight(m) for m in range(2)] == [4 / 9, 5 / 9]
    assert [shares.log_weight(m) for m in range(2)] == [4.0, 5.0]
    # A token-mean loss per micro-batch, weighted so, is the whole batch's token mean.
    values = torch.randn(4, 3)

    def token_mean(part_values, part_labels):
        return part_values[part_labels != -100].mean()

    got = sum(shares.weight(m) * token_mean(values[2 * m:2 * m + 2], labels[2 * m:2 * m + 2]) for m in range(2))
    torch.testing.assert_close(got, token_mean(values, labels), rtol=0, atol=1e-7)
    # Without mean_over the samples decide, and the strategy can see the difference.
    plain = BatchShares.of((tokens, labels), 2)
    assert [plain.weight(m) for m in range(2)] == [0.5, 0.5]
    assert plain.unequal_labelled_tokens() == (4, 5)
    assert BatchShares.of((tokens, tokens), 2).unequal_labelled_tokens() is None  # no padding: nothing to say


class Labelled(L.LightningModule):
    """A step as Hugging Face users write it: the model (here a stand-in holding every parameter) takes labels=."""

    def __init__(self, model: torch.nn.Module, dict_batch: bool = False) -> None:
        super().__init__()
        self.model, self.dict_batch = model, dict_batch

    def training_step(self, batch, batch_idx):
        if self.dict_batch:
            return self.model(**batch).loss
        tokens, labels = batch
        return self.model(input_ids=tokens, labels=labels).loss


class Causal(torch.nn.Module):
    """Stands in for a Hugging Face causal LM: its ``loss_type`` makes its loss shift the labels."""

    loss_type = "ForCausalLM"

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(is_encoder_decoder=False)
        self.lin = torch.nn.Linear(2, 2)


def test_the_labels_a_step_passes_as_labels_weigh_its_micro_batches_as_the_model_s_loss_counts_them():
    """Without mean_over=: the labels= of the pipelined call (self.model(..., labels=...), a child holding every
    parameter) or a dict batch's "labels", counted unshifted for a model whose loss does not shift them and over
    labels[..., 1:] for a Hugging Face causal LM (as its Trainer counts num_items_in_batch)."""
    pytest.importorskip("transformers")
    tokens, labels = lm_batch()
    plain = Labelled(torch.nn.Linear(2, 2))
    call, (args, kwargs) = pipelined_call(plain, "training_step", (tokens, labels), 0)
    assert isinstance(call, SubmoduleCall) and call.name == "model" and torch.equal(kwargs["labels"], labels)
    counter = labelled_token_counter(plain, call, "training_step", (tokens, labels), 0)
    assert counter is not None and BatchShares.of((tokens, labels), 2, mean_over=counter).counts == (4.0, 5.0)
    assert not loss_shifts_labels(plain)
    causal = Labelled(Causal())
    assert loss_shifts_labels(causal)  # labels[..., 1:]: rows 0 and 1 hold 0 and 2 labelled, rows 2 and 3: 1 and 2
    counter = labelled_token_counter(causal, call, "training_step", (tokens, labels), 0)
    assert BatchShares.of((tokens, labels), 2, mean_over=counter).counts == (2.0, 3.0)
    as_dict = {"input_ids": tokens, "labels": labels}  # **batch: labels= too; the batch's "labels" alike
    for module in (Labelled(Causal(), dict_batch=True),):
        for found_by in (call, None):
            counter = labelled_token_counter(module, found_by, "training_step", as_dict, 0)
            assert BatchShares.of(as_dict, 2, mean_over=counter).counts == (2.0, 3.0)
    # Nowhere to be seen (a tuple batch the step uses itself): the samples' shares, and the warning.
    assert labelled_token_counter(plain, ForwardCall(), "training_step", (tokens, labels), 0) is None
    import transformers

    real = {"gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2,
                                                                          vocab_size=16)),
            "bert": transformers.BertForMaskedLM(transformers.BertConfig(num_hidden_layers=1, hidden_size=8,
                                                                         num_attention_heads=2, intermediate_size=8,
                                                                         vocab_size=16))}
    # GPT-2 has no loss_type; Hugging Face's default loss, the causal LM's, is its own. BERT's masked LM: unshifted.
    assert [loss_shifts_labels(Labelled(model)) for model in real.values()] == [True, False]


def test_a_step_that_calls_neither_self_nor_its_model_is_told_so():
    class Elsewhere(Labelled):
        def training_step(self, batch, batch_idx):
            return batch[0].float().sum()

    with pytest.raises(RuntimeError, match=r"^Elsewhere.training_step returned without calling self\(...\) or "
                                           r"self.model\(...\). Under PipeDreamStrategy every step must call the "
                                           r"model's forward exactly once, through self\(...\) \(or a child module "
                                           r"that holds all its parameters, such as self.model\(...\)\), with the "
                                           r"inputs to pipeline.$"):
        pipelined_call(Elsewhere(torch.nn.Linear(2, 2)), "training_step", lm_batch(), 0)


def test_mean_over_must_count():
    with pytest.raises(ValueError, match=r"mean_over must return a number \(what the loss averages over in a piece "
                                         r"of the batch, such as its labelled tokens\), got a tensor of shape \(2,\)"):
        BatchShares.of(torch.zeros(4, 2), 2, mean_over=lambda batch: batch.sum(0))


def test_a_batch_smaller_than_chunks_is_one_micro_batch_per_sample():
    shares = BatchShares.of(torch.arange(3.0).view(3, 1), 4, fewer_if_small=True)
    assert shares.sizes == (1, 1, 1) and [shares.weight(m) for m in range(3)] == [1 / 3] * 3
    with pytest.raises(ValueError, match="A batch of 3 samples cannot be split into chunks=4 micro-batches"):
        BatchShares.of(torch.zeros(3, 1), 4)  # Pipeline's contract: its caller chose chunks
    for name in ("gpipe", "1f1b", "zb-h1"):  # every synchronous schedule builds for the smaller count
        build_schedule(name, 2, 3)
    build_schedule("interleaved", 2, 3, virtual_stages=2)


def loader(samples: int, batch_size: int, drop_last: bool = False) -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(samples, 1)), batch_size=batch_size, drop_last=drop_last)


def test_a_last_batch_that_2bw_cannot_run_is_refused_before_training():
    with pytest.raises(ValueError) as info:
        check_last_batch_fits(loader(129, 16), 4, 1, "2bw")
    assert str(info.value) == (
        "schedule='2bw' admits chunks=4 micro-batches in every step, but the training data's last batch has 1 "
        "samples (129 samples in batches of 16), so the epoch would stop there. Pass DataLoader(..., drop_last=True), "
        "choose a batch size that leaves a last batch of at least 4 samples, or use a synchronous schedule (1f1b, "
        "gpipe, zb-h1, interleaved), which runs such a batch with one micro-batch per sample.")
    check_last_batch_fits(loader(129, 16, drop_last=True), 4, 1, "2bw")
    check_last_batch_fits(loader(132, 16), 4, 1, "2bw")  # a last batch of 4
    check_last_batch_fits(loader(128, 16), 4, 1, "2bw")  # no partial batch
    with pytest.raises(ValueError, match="last batch has 1 samples"):  # 2 pipelines: 65 samples each
        check_last_batch_fits(loader(129, 16), 4, 2, "2bw")
    check_last_batch_fits([torch.zeros(1)], 4, 1, "2bw")  # a plain iterable: nothing known before the epoch


def test_a_step_of_fewer_micro_batches_than_2bw_admits_is_refused():
    from torch import nn

    engine = PipelineEngine(nn.Linear(2, 2), 0, 2, None, schedule="2bw", chunks=2)  # refused before any transfer
    with pytest.raises(ValueError) as info:
        engine.step_actions(1)
    assert str(info.value) == (
        "schedule='2bw' keeps the pipeline full across steps, each admitting chunks=2 micro-batches, so a step of 1 "
        "(a batch with fewer samples) cannot run. Drop the smaller last batch (DataLoader(drop_last=True)), or use a "
        "synchronous schedule (1f1b, gpipe, zb-h1, interleaved).")
    flushed = PipelineEngine(nn.Linear(2, 2), 0, 2, None, schedule="1f1b", chunks=4)
    assert len(flushed.step_actions(1)) < len(flushed.step_actions()) == len(flushed.step_actions(4))


def test_weights_tied_across_stages_are_refused_where_they_cannot_run():
    import lightning as L
    from torch import nn

    from lightning_pipedream.strategy.setup.calls import shared_parameters
    from lightning_pipedream.strategy.setup.placement import Placement
    from lightning_pipedream.strategy.setup.stage_pipeline import layer_ties

    class Tied(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            embedding, decoder = nn.Embedding(5, 4), nn.Linear(4, 5)
            decoder.weight = embedding.weight
            self.layers = nn.Sequential(embedding, nn.Linear(4, 4), nn.Tanh(), decoder)

    module = Tied()
    shared = shared_parameters(module.layers)
    assert shared == {"0.weight": ["0.weight", "3.weight"]}
    placement = Placement.decide("interleaved", 2)
    with pytest.raises(ValueError) as info:
        layer_ties(module, shared, module.layers, placement, [1, 1, 1, 1], virtual_stages=2)
    assert str(info.value) == (
        "Layers {'0.weight': ['0', '3']} of Tied share parameters across stages (tied weights), which "
        "PipeDreamStrategy runs with one straight pipeline of real weights; not with interleaved model chunks, "
        "replicated stages, data-parallel pipelines or a model built on the meta device. Use one of those without "
        "ties, or balance= that keeps each tied parameter's layers in one stage.")
    assert layer_ties(module, shared, module.layers, Placement.decide("1f1b", 2), [2, 2], 1) == {"0.weight": [0, 1]}
    # both users on one stage: no tie to keep
    assert layer_ties(module, shared, module.layers, Placement.decide("1f1b", 1), [4], 1) == {}


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_a_step_of_several_minibatches_runs_the_one_minibatch_steps_in_turn(stages):
    """minibatches_per_batch: a step's actions on every rank are those of as many pipedream steps, one after another;
    a run of such steps then a drain is PipeDream's whole schedule (validated: every send received, every forward
    back-propagated once, updates after backwards)."""
    from torch import nn

    from lightning_pipedream.schedule.check import validate

    for per_step in (2, 3):
        engines = [PipelineEngine(nn.Linear(2, 2), s, stages, None, schedule="pipedream") for s in range(stages)]
        whole = build_schedule("pipedream", stages, 1, minibatches=3 * per_step)
        for s, engine in enumerate(engines):
            actions = []
            for _ in range(3):
                actions += engine.step_actions(minibatches=per_step)
                engine._admitted += per_step  # as train_step does after running them
            drain = pipedream_drain(stages, s, engine._admitted)
            assert actions + drain == list(whole.actions[s])
        validate(whole)


def test_several_minibatches_per_step_are_refused_where_a_step_is_one_update():
    from torch import nn

    for engine, where in [
        (PipelineEngine(nn.Linear(2, 2), 0, 2, None, schedule="1f1b", chunks=2), "schedule='1f1b'"),
        (PipelineEngine(nn.Linear(2, 2), 0, 2, None, schedule="2bw", chunks=2), "schedule='2bw'"),
    ]:
        with pytest.raises(ValueError) as info:
            engine.step_actions(minibatches=2)
        assert str(info.value) == (
            f"Several minibatches per step (minibatches=2) run under schedule='pipedream' on a straight pipeline only, "
            f"not with {where}: there a step is one update of chunks micro-batches (or the replicas' round). Give "
            "minibatches=1.")
