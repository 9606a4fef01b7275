"""The recipes' real metrics and truncated BPTT: greedy decoding, carried LSTM state, stream batches, the DDP
batch split, and the reproduction table; all in one process."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from recipes.data.language_model import stream_windows
from recipes.models import build_model
from recipes.reproduction import table_rows, write_reproduction
from recipes.tasks.base import LanguageModelTask, reset_states, set_batch_rows
from recipes.tasks.seq2seq import greedy_decode
from recipes.train import check_carried_state, per_process_batch

BOS, EOS = 2, 3


@pytest.mark.parametrize("name, inputs", [("gnmt8", (torch.randint(4, 11, (5, 6)),)),
                                          ("s2vt", (torch.randn(5, 4, 12),))])
def test_greedy_decoding_is_what_a_teacher_forced_pass_predicts_on_its_own_words(name: str, inputs: tuple) -> None:
    """Fed back its own words (BOS + decoded) in one teacher-forced pass, the model predicts exactly the decoded
    words up to each row's EOS: each step's choice depends only on the prefix, as autoregressive decoding must."""
    torch.manual_seed(0)
    sizes = {"gnmt8": {"src_vocab_size": 11, "tgt_vocab_size": 11}, "s2vt": {"feature_size": 12, "vocab_size": 11}}
    model = build_model(name, "translation" if name == "gnmt8" else "video_captioning", hidden_size=8, dropout=0.0,
                        **sizes[name]).eval()
    with torch.no_grad():
        [m for m in model[-1].modules() if isinstance(m, nn.Linear)][-1].bias[EOS] += 0.3  # some rows end early
        decoded = greedy_decode(model, inputs, BOS, EOS, max_len=7)
        again = model((*inputs, torch.cat([torch.full((5, 1), BOS), decoded[:, :-1]], dim=1))).argmax(-1)
    assert decoded.shape[0] == 5 and 1 <= decoded.shape[1] <= 7
    for row, forced in zip(decoded.tolist(), again.tolist()):
        end = row.index(EOS) + 1 if EOS in row else len(row)
        assert forced[:end] == row[:end]
        assert all(word == 0 for word in row[end:])  # padding after EOS


def lstm_model(carry: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return build_model("awd_lstm", "language_model", vocab_size=17, embedding_size=6, hidden_size=8, dropoute=0.0,
                       dropouti=0.0, dropouth=0.0, dropout=0.0, wdrop=0.0, carry_state=carry)


def test_carried_state_continues_each_micro_batch_stream() -> None:
    """Two batches of 4 streams in 2 micro-batches each (as a pipeline stage runs them: mb 0, mb 1, mb 0, mb 1) give
    the logits of one pass over the whole text of each stream; a new epoch (reset) starts from zeros again."""
    text = torch.randint(0, 17, (4, 10))
    whole = lstm_model(carry=False)(text)
    model = lstm_model(carry=True)
    first, second = text[:, :5], text[:, 5:]
    outputs = []
    for batch in (first, second):
        set_batch_rows(model, 4)  # what LanguageModelTask.on_train_batch_start does on every rank
        outputs += [model(batch[:2]), model(batch[2:])]
    torch.testing.assert_close(torch.cat(outputs[:2]), whole[:, :5])
    torch.testing.assert_close(torch.cat(outputs[2:]), whole[:, 5:])
    assert not torch.allclose(lstm_model(carry=False)(second), whole[:, 5:])  # the state matters
    reset_states(model)
    set_batch_rows(model, 4)
    torch.testing.assert_close(torch.cat([model(first[:2]), model(first[2:])]), whole[:, :5])
    model.eval()  # Lightning's validation in eval mode neither reads nor advances the training state
    torch.testing.assert_close(model(second), lstm_model(carry=False).eval()(second))


def test_stream_windows_make_batches_that_continue_row_by_row() -> None:
    """Batch k of a sequential loader (batch = streams) holds window k of every stream; DDP's rank r, which reads
    positions r, r+2, ... of that order, always gets the same streams."""
    ids = list(range(103))
    data = stream_windows(ids, bptt=4, streams=4)  # 4 streams of 25 tokens: 6 windows each
    x, y = data.tensors
    assert x.shape == (24, 4) and torch.equal(y[:, :-1], x[:, 1:])
    batches = x.view(6, 4, 4)  # (window, stream, token)
    for stream in range(4):
        assert torch.cat(list(batches[:, stream])).tolist() == list(range(25 * stream, 25 * stream + 24))
    rank1 = x[1::2].view(6, 2, 4)
    assert torch.equal(rank1, batches[:, 1::2])
    with pytest.raises(ValueError, match=r"too few for 40 streams \(data.batch_size\) of one window of data.bptt=4; "
                                         "lower data.batch_size or data.bptt"):
        stream_windows(ids, bptt=4, streams=40)


def test_held_out_perplexity_carries_the_state_over_the_validation_text() -> None:
    """Perplexity of the held-out text as 10 streams equals exp(mean cross-entropy) of one pass over each stream."""

    class Data:
        pass

    data = Data()
    data.val_set = stream_windows(torch.randint(0, 17, (401,)).tolist(), bptt=8, streams=1)  # 50 windows in order
    model = lstm_model(carry=True).eval()
    task = LanguageModelTask(model, {"name": "adam"})
    got = task.held_out_metric(model, data)
    stream = torch.cat([data.val_set.tensors[0].flatten(), data.val_set.tensors[1][-1, -1:]])
    x, y = stream[:400].view(10, 40), stream[1:401].view(10, 40)
    with torch.no_grad():
        want = math.exp(nn.functional.cross_entropy(lstm_model(carry=False)(x).flatten(0, 1), y.flatten()))
    assert got == pytest.approx(want, rel=1e-5)
    assert model[1].carry_in_eval is False and model[1]._state is None  # left as it was


class HeldOutText:
    """A language-model data module's held-out windows and vocabulary (characters)."""

    def __init__(self) -> None:
        self.val_set = stream_windows(torch.randint(0, 17, (161,), generator=torch.Generator().manual_seed(5)).tolist(),
                                      bptt=8, streams=1)
        self.vocab = type("Vocab", (), {"itos": [chr(ord("a") + i) for i in range(17)]})()
        self.level = "char"


def test_language_model_samples_continue_held_out_prompts_greedily_or_seeded() -> None:
    """Greedy samples are the argmax continuation of evenly spaced held-out prompts (recomputing the prefix here;
    the task decodes carrying the LSTM states); the module, or a whole copy given as `layers`, gives the same text;
    sampling with one seed gives one text, another seed another."""
    data = HeldOutText()
    model = lstm_model(carry=True)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 1)  # spread: rows continue differently
    task = LanguageModelTask.from_data(model, {"name": "adam"}, data, samples={"count": 3, "prompt": 5, "length": 6})
    prompts = task.sample_prompts(data)
    stream = torch.cat([data.val_set.tensors[0].flatten(), data.val_set.tensors[1][-1, -1:]])
    assert prompts.tolist() == [stream[s:s + 5].tolist() for s in (0, 78, 156)]  # the first, middle and last
    ids = prompts
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, model.eval()(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    model.train()  # as after a training step: the samples decode in evaluation mode and leave the mode alone
    want = [("".join(chr(ord("a") + i) for i in row[:5]), "".join(chr(ord("a") + i) for i in row[5:]))
            for row in ids.tolist()]
    assert len({c for _, c in want}) > 1
    assert task.held_out_samples(data) == want and model.training
    assert task.held_out_samples(data, copy.deepcopy(model)) == want
    sampled = [LanguageModelTask.from_data(model, {}, data, samples={"count": 3, "prompt": 5, "length": 6,
                                                                      "temperature": 1.0, "seed": seed})
               .held_out_samples(data) for seed in (0, 0, 1)]
    assert sampled[0] == sampled[1] != sampled[2] and sampled[0] != want
    assert LanguageModelTask.from_data(model, {}, data).held_out_samples(data) == []  # count 0: none


@pytest.mark.parametrize(("options", "words"), [
    ({"count": -1}, r"task.samples.count must be an integer >= 0 \(0: no samples\), got -1"),
    ({"count": 2, "length": 0}, r"task.samples.length must be an integer >= 1, got 0"),
    ({"count": 2, "temperature": -0.5}, r"task.samples.temperature must be >= 0 \(0: greedy\), got -0.5"),
    ({"count": 2, "colour": 1}, r"unexpected keyword argument 'colour'"),
])
def test_bad_sample_options_are_refused_in_words(options, words) -> None:
    with pytest.raises((ValueError, TypeError), match=words):
        LanguageModelTask(lstm_model(carry=False), {}, samples=options)


def test_task_options_another_task_does_not_know_are_refused() -> None:
    from recipes.tasks.base import ClassificationTask

    with pytest.raises(ValueError, match=r"task options \['samples'\] are not known to ClassificationTask; remove "
                                         "them from the task config"):
        ClassificationTask.from_data(nn.Sequential(nn.Linear(2, 2)), {}, None, samples={"count": 1})


def test_samples_are_printed_and_appended_to_the_run_directory(tmp_path: Path) -> None:
    from recipes.results import ResultsCallback

    lines: list[str] = []
    callback = ResultsCallback(None, 0.0, echo=lines.append)
    callback.samples_file = tmp_path / "samples.txt"
    trainer = type("Trainer", (), {"current_epoch": 1, "global_step": 8, "logger": None})()
    for _ in range(2):
        callback.report_samples(trainer, [("ab", "cd\n"), ("x", "y")], "on one device")
    block = ["samples after epoch 1 (step 8), decoded on one device:", "  0: 'ab' -> 'cd\\n'", "  1: 'x' -> 'y'"]
    assert lines == ["\n".join(block)] * 2
    assert callback.samples_file.read_text().splitlines() == block * 2


def test_tied_awd_lstm_shares_embedding_and_decoder() -> None:
    model = build_model("awd_lstm", "language_model", vocab_size=17, embedding_size=6, hidden_size=8,
                        tie_weights=True)
    assert model[-1].weight is model[0].embed.weight
    assert len(list(model.parameters())) == len(list(lstm_model(carry=False).parameters())) - 1


def test_ddp_reads_its_share_of_the_global_batch() -> None:
    assert per_process_batch("ddp", 64, 2) == {"batch_size": 32, "global_batch_size": 64}
    assert per_process_batch("pipedream", 64, 2) == {} and per_process_batch("ddp", 64, 1) == {}
    with pytest.raises(ValueError, match="data.batch_size=63 is the global batch, which strategy=ddp splits over 2 "
                                         "processes; choose a multiple of 2"):
        per_process_batch("ddp", 63, 2)
    with pytest.raises(ValueError, match="model.carry_state=true carries the hidden state from one batch to the next, "
                                         "which needs batches that continue the same text streams: set "
                                         "data.streams=true, or model.carry_state=false"):
        check_carried_state({"carry_state": True}, {"streams": False})
    # Tied weights with the carried state run under every strategy (the tie no longer sends the model to tracing).
    for strategy in ("pipedream", "ddp"):
        check_carried_state({"carry_state": True, "tie_weights": True}, {"streams": True}, strategy)


def write_job(sweep: Path, contender: str, seed: int, metrics: list[float], target_epoch: int | None) -> None:
    history = [{"epoch": e, "step": 10 * (e + 1), "metric": m, "seconds": 2.0 * (e + 1) + seed,
                "train_seconds": 1.0 * (e + 1), "samples": 640 * (e + 1)} for e, m in enumerate(metrics)]
    job = {"task": "image", "model": "digits_cnn", "metric_name": "val_acc", "metric": metrics[-1],
           "contender": contender, "seed": seed, "error": None, "history": history,
           "time_to_target_s": None if target_epoch is None else history[target_epoch]["seconds"]}
    (sweep / f"{contender}_seed{seed}").mkdir(parents=True)
    (sweep / f"{contender}_seed{seed}" / "results.json").write_text(json.dumps(job))


def test_reproduction_table_means_over_seeds(tmp_path: Path) -> None:
    write_job(tmp_path, "pipedream", 0, [0.5, 0.9, 0.96], target_epoch=2)
    write_job(tmp_path, "pipedream", 1, [0.6, 0.8, 0.90], target_epoch=None)
    write_job(tmp_path, "ddp", 0, [0.7, 0.95, 0.97], target_epoch=1)
    rows = table_rows(json.loads((d / "results.json").read_text()) for d in sorted(tmp_path.iterdir()))
    assert [row["contender"] for row in rows] == ["ddp", "pipedream"]
    ddp, pipedream = rows
    assert (ddp["seeds"], ddp["epochs_to_target"], ddp["seconds_to_target"]) == ("1/1", 2, 4.0)
    assert (pipedream["seeds"], pipedream["epochs_to_target"], pipedream["seconds_to_target"]) == ("1/2", 3, 6.0)
    assert pipedream["final_metric"] == pytest.approx(0.93)
    assert (pipedream["final_metric_min"], pipedream["final_metric_max"]) == (0.90, 0.96)
    assert pipedream["train_seconds_per_epoch"] == 1.0 and pipedream["seconds_total"] == pytest.approx(6.5)
    table = write_reproduction(tmp_path)
    assert "| pipedream | 1/2 | 3 | 0.93 | 0.9 | 0.96 | 3 | 6 | 1 | 6.5 |" in table
    assert (tmp_path / "reproduction.png").stat().st_size > 1000


def test_stream_batches_stay_in_order_under_a_multi_process_strategy() -> None:
    """Lightning shuffles every training loader under a multi-process strategy unless its sampler is already a
    DistributedSampler; the stream loader brings its own, unshuffled: DDP's rank 1 of 2 reads streams 1, 3, ...
    of window 0, then of window 1; a pipeline (1 replica) reads every stream in order."""
    from types import SimpleNamespace

    from torch.utils.data import DistributedSampler

    from recipes.data import build_datamodule

    def batches(replicas: dict | None, batch_size: int, global_batch_size: int) -> list[torch.Tensor]:
        dm = build_datamodule("shakespeare", "language_model", batch_size=batch_size, bptt=8, streams=True,
                              global_batch_size=global_batch_size)
        dm.setup()
        dm.trainer = SimpleNamespace(distributed_sampler_kwargs=replicas,
                                     _accelerator_connector=SimpleNamespace(use_distributed_sampler=True),
                                     strategy=SimpleNamespace(root_device=torch.device("cpu")))
        loader = dm.train_dataloader()
        assert isinstance(loader.sampler, DistributedSampler) == (replicas is not None)
        return list(loader)

    whole = batches(None, 4, 4)
    pipeline = batches({"num_replicas": 1, "rank": 0}, 4, 4)
    rank1 = batches({"num_replicas": 2, "rank": 1}, 2, 4)
    assert len(whole) == len(pipeline) == len(rank1) > 100
    for (x, y), (px, py), (rx, ry) in zip(whole, pipeline, rank1):
        assert torch.equal(x, px) and torch.equal(y, py) and torch.equal(rx, x[1::2]) and torch.equal(ry, y[1::2])
    # each row continues the text of the same row: the next input starts where the last target ended
    for (_, y), (x_next, _) in zip(whole, whole[1:]):
        assert torch.equal(y[:, -1], x_next[:, 0])
