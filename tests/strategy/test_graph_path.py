"""Trainer(strategy=PipeDreamStrategy) on models that are not one nn.Sequential: split from the traced forward graph.

Each family of tests/helpers/graph_models.py, wrapped in a LightningModule (tests/scripts/graph_trainer.py),
trains in a subprocess on 2, 3 or 4 processes; the consolidated checkpoint must equal one-device training
(every parameter and buffer, 1e-5) and carry exactly the module's own state_dict keys.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from graph_models import HF_MODELS, LSTMOutput, batches, loss_fn, make
from graph_trainer import FamilyModule, HFStyleModule, TiedSequentialLM
from pipedream_reference import Minibatch, PipeDreamRule
from script_runs import run_script
from torch import nn

from lightning_pipedream import PipeDreamStrategy

# Starts several processes: not in the fast suite. The module's launches are one fixture, set up within its first
# test: that test may take as long as the launches' own limits, not pytest's default 240 s.
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "graph_trainer.py"


def run(out: Path, options: dict, expect_ok: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_script(SCRIPT, out, options, timeout, expect_ok)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=False, map_location="cpu")["state_dict"]


def assert_trained_alike(out: Path, single: Path, tolerance: float, steps: int, logged: tuple[str, ...]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict]]:
    """The pipelined run in ``out`` ended as the one-device run in ``single``: the module's keys in its order, every
    tensor and each ``logged`` value to ``tolerance``, after ``steps`` steps. Returns both weights and metrics."""
    got, want = weights(out / "final.ckpt"), weights(single / "final.ckpt")
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=tolerance, atol=tolerance, msg=lambda m: f"{key}: {m}")
    metrics = [json.loads((d / "metrics.json").read_text()) for d in (out, single)]
    assert metrics[0]["global_step"] == metrics[1]["global_step"] == steps
    for name in logged:
        assert metrics[0][name] == pytest.approx(metrics[1][name], rel=tolerance), name
    return got, want, metrics


CASES = {
    # family: (processes, strategy, model options)
    "gpt": (3, {"schedule": "gpipe", "chunks": 2, "split_points": ["model.blocks.1", "model.blocks.3"]}, {}),
    "resnet": (2, {"schedule": "1f1b", "chunks": 1}, {"lr": 0.01}),  # split points from profiling; BatchNorm
    "transformer": (2, {"schedule": "gpipe", "chunks": 1}, {}),  # two inputs, masks, one shared embedding
    "lstm": (3, {"schedule": "1f1b", "chunks": 2}, {}),  # profiled split points; decoder tied to the embedding
    # A forward with a branch on a value cannot be traced; split points inside self.model make it train.
    "lstm_untraceable": (2, {"schedule": "1f1b", "chunks": 2, "split_points": ["model.rnn2"]}, {}),
    # Called as Hugging Face models are, `self(input_ids, labels=y).loss`: an output dataclass holding a cache.
    "hf": (2, {"schedule": "1f1b", "chunks": 2}, {}),
}


VALIDATED = ("resnet", "transformer", "hf")
CHUNKED = {
    "hf_zb_v": {"schedule": "zb-v", "chunks": 2},
    "hf_dualpipev": {"schedule": "dualpipev", "chunks": 4},
    "hf_interleaved": {"schedule": "interleaved", "virtual_stages": 2, "chunks": 2},
}

# Batches of 8: dualpipev on 4 processes needs 8 micro-batches (2 x processes); the same one-device runs serve both.
REAL_HF = {"module": "hf", "model": {"scheduler": True}, "epochs": 2, "limit_val_batches": 1, "clip": 0.5,
           "batch_size": 8}
REAL_CHUNKED = {
    # processes: {run: strategy}, each run cut into 2 x processes model chunks; on 2 processes every schedule takes 4
    # micro-batches of 2 and on 4 processes 8 of 1: one micro-batch shape per launch, so that each rank traces a model
    # once per mode and the later schedules' captures come from the cache
    2: {**CHUNKED, "hf_zb_v": {"schedule": "zb-v", "chunks": 4},
        "hf_interleaved": {"schedule": "interleaved", "virtual_stages": 2, "chunks": 4}},
    4: {"hf_zb_v": {"schedule": "zb-v", "chunks": 8}, "hf_dualpipev": {"schedule": "dualpipev", "chunks": 8},
        "hf_interleaved": {"schedule": "interleaved", "virtual_stages": 2, "chunks": 8}},
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Every family on one device and as a pipeline; the runs of one process count share one launch."""
    base = tmp_path_factory.mktemp("graph")
    # The 4-process launch before the 2-process one: a 4-process checkpoint resumes on 2 processes.
    runs: dict[int, list] = {1: [], 4: [], 2: [], 3: []}
    for case, (processes, strategy, model) in CASES.items():
        family, _, untraceable = case.partition("_")
        # Validation (an eval-mode capture) where eval mode changes the graph: BatchNorm, nn.Transformer's masks.
        validate = 1 if family in VALIDATED else 0
        common = {"family": family, "model": model, "limit_val_batches": validate, "untraceable": bool(untraceable),
                  **({"module": "hf"} if family == "hf" else {})}
        runs[1].append([str(base / case / "single"), common])
        runs[processes].append([str(base / case / "pipe"), {**common, "devices": processes, "strategy": strategy}])
    runs[2].append([str(base / "lstm_pipedream"), {"family": "lstm", "devices": 2, "strategy": {
        "schedule": "pipedream", "split_points": ["model.rnn2"]}}])
    # The same module structure as the "hf" run before it in this launch: its capture and profile come from the cache.
    runs[2].append([str(base / "hf_2bw"), {"family": "hf", "module": "hf", "devices": 2, "strategy": {
        "schedule": "2bw", "chunks": 2}}])
    # The "hf" pipeline's run again, its checkpoint sharded (each rank its stage, by name); then resumed from it at the
    # last step (nothing left to train): what it saves in one file is what it read back.
    hf_sharded = {"family": "hf", "module": "hf", "devices": 2, "strategy": {**CASES["hf"][1], "checkpoint": "sharded"}}
    runs[2].append([str(base / "hf_sharded"), hf_sharded])
    runs[2].append([str(base / "hf_sharded_resumed"), {**hf_sharded, "also_full": True,
                                                       "resume": str(base / "hf_sharded" / "final.ckpt")}])
    tied = {"family": "lstm", "module": "tied_sequential", "devices": 2}  # a Sequential tied across its stages
    runs[2].append([str(base / "tied_sequential"), {**tied, "strategy": {"schedule": "pipedream", "balance": [2, 2]}}])
    runs[2].append([str(base / "tied_sequential_2bw"), {**tied, "clip": 0.05, "strategy": {
        "schedule": "2bw", "chunks": 2, "balance": [2, 2]}}])
    # A padded LM batch (labels -100) with a token-mean loss, and last training and validation batches of one sample,
    # fewer than chunks=2: one epoch, with mean_over counting the labelled tokens; without it, the labels passed as
    # labels= (the strategy counts them itself); and (one step) a loss the step computes from labels it does not see.
    lm = {"family": "hf", "module": "hf", "padded": True, "sizes": [4, 4, 1], "val_sizes": [4, 1], "epochs": 1,
          "limit_val_batches": 2}
    runs[1].append([str(base / "hf_lm" / "single"), lm])
    runs[2].append([str(base / "hf_lm" / "pipe"), {**lm, "devices": 2, "strategy": {
        "schedule": "1f1b", "chunks": 2, "mean_over": "labelled_tokens"}}])
    runs[2].append([str(base / "hf_lm" / "labels"), {**lm, "devices": 2, "strategy": {"schedule": "1f1b",
                                                                                        "chunks": 2}}])
    runs[2].append([str(base / "hf_lm" / "unweighted"), {**lm, "epochs": None, "steps": 1, "limit_val_batches": 0,
                                                          "model": {"own_loss": True}, "devices": 2,
                                                          "strategy": {"schedule": "1f1b", "chunks": 2}}])
    # Model chunks of a traced model (issue 43), after the "hf" run (its capture comes from the cache): 2 processes x 2
    # chunks, the embedding tied to the output projection. In a V both ends sit on rank 0 (one shared parameter);
    # interleaved puts them on ranks 0 and 1 (their gradients summed).
    hf = {"family": "hf", "module": "hf", "model": {}, "limit_val_batches": 1, "untraceable": False, "devices": 2}
    for name, strategy in CHUNKED.items():
        runs[2].append([str(base / name), {**hf, "strategy": strategy}])
    # Real Hugging Face models (Llama; GPT-2, tied) cut into 4 chunks on 2 processes and 8 chunks on 4 under each
    # chunked schedule, and on one device: two epochs of 3 batches with validation, clipping by the norm (active: the
    # gradients' norms exceed it) and a per-step scheduler.
    for family in HF_MODELS:
        real = {**REAL_HF, "family": family}
        runs[1].append([str(base / family / "single"), real])
        for processes, strategies in REAL_CHUNKED.items():
            for name, strategy in strategies.items():
                runs[processes].append([str(base / family / f"{name}_on_{processes}"), {
                    **real, "devices": processes, "strategy": strategy}])
    # Llama's zb-v checkpoint (4 chunks in a V) resumes under 1f1b on 2 stages for a third epoch, and GPT-2's (8 chunks
    # in a V on 4 processes) under interleaved on 2 processes (4 chunks; the tied head on rank 1, no longer beside the
    # embedding): one device's 3 epochs. Micro-batches of 2, as the runs above: the captures come from the cache.
    for family, resumed, processes, strategy in (
            ("llama", "zb_v_resumed_under_1f1b", 2, {"schedule": "1f1b", "chunks": 4}),
            ("gpt2", "zb_v_on_4_resumed_under_interleaved", 4, {"schedule": "interleaved", "virtual_stages": 2,
                                                                "chunks": 4})):
        three = {**REAL_HF, "family": family, "epochs": 3}
        runs[1].append([str(base / family / "single_3"), three])
        runs[2].append([str(base / family / resumed), {
            **three, "devices": 2, "strategy": strategy,
            "resume": str(base / family / f"hf_zb_v_on_{processes}" / "final.ckpt")}])
    # Unequal replicas (1F1B-RR) of a traced model: Llama's first stage on 2 processes, its second on 1.
    runs[3].append([str(base / "llama" / "rr_on_3"), {**REAL_HF, "family": "llama", "devices": 3, "strategy": {
        "schedule": "1f1b", "chunks": 2, "replicas": [2, 1]}}])
    for processes, group in runs.items():
        if group:
            (base / f"runs{processes}.json").write_text(json.dumps(group))
            run(base, {"--runs": str(base / f"runs{processes}.json")})
    return base


@pytest.mark.parametrize("family", sorted(CASES))
def test_training_equals_one_device(trained, family):
    single, pipe = trained / family / "single", trained / family / "pipe"
    got, want = weights(pipe / "final.ckpt"), weights(single / "final.ckpt")
    assert list(got) == list(want)  # the module's own keys, in its order: tied names and BatchNorm buffers too
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    metrics = [json.loads((d / "metrics.json").read_text()) for d in (pipe, single)]
    if family in VALIDATED:
        assert metrics[0]["val_loss"] == pytest.approx(metrics[1]["val_loss"], rel=1e-5)  # an eval-mode capture
    if family == "gpt":  # the output projection tied to the embedding: one tensor under both names
        assert torch.equal(got["model.head.weight"], got["model.tok.weight"])
    if family == "hf":
        assert torch.equal(got["model.head.weight"], got["model.tok.weight"])
    # The checkpoint loads without the strategy.
    (HFStyleModule if family == "hf" else FamilyModule).load_from_checkpoint(pipe / "final.ckpt", map_location="cpu")


@pytest.mark.parametrize("name", sorted(CHUNKED))
def test_model_chunks_of_a_traced_model_equal_one_device(trained, name):
    """A traced HF-style LM cut into 4 model chunks on 2 processes (profiled split points) trains as one device, its
    validation loss is one device's and its tied embedding stays one tensor."""
    got, want = weights(trained / name / "final.ckpt"), weights(trained / "hf" / "single" / "final.ckpt")
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    assert torch.equal(got["model.head.weight"], got["model.tok.weight"])
    metrics = [json.loads((d / "metrics.json").read_text()) for d in (trained / name, trained / "hf" / "single")]
    assert metrics[0]["val_loss"] == pytest.approx(metrics[1]["val_loss"], rel=1e-5)
    assert len(metrics[0]["split_points"]) == 3  # 4 chunks


@pytest.mark.parametrize(("processes", "name"), [(p, name) for p, runs in REAL_CHUNKED.items() for name in sorted(runs)])
@pytest.mark.parametrize("family", HF_MODELS)
def test_real_hugging_face_models_in_model_chunks_equal_one_device(trained, family, processes, name):
    """A tiny LlamaForCausalLM and GPT2LMHeadModel (tied head), traced and cut into 4 chunks on 2 processes and 8 on 4,
    under zb-v, dualpipev and interleaved: two epochs with validation, clipping and a scheduler end with one device's
    weights (1e-6; measured about 1e-8), its logged train_loss and val_loss (1e-6; logged on rank 0, which holds the
    last stage in a V and not in interleaved), and GPT-2's head still its embedding."""
    out, single = trained / family / f"{name}_on_{processes}", trained / family / "single"
    got, want, metrics = assert_trained_alike(out, single, 1e-6, 6, ("train_loss", "val_loss"))
    initial = {f"model.{k}": v for k, v in make(family)[0].state_dict().items()}
    assert max((want[k] - initial[k]).abs().max().item() for k in want) > 1e-2  # training moved the weights
    assert len(metrics[0]["split_points"]) == 2 * processes - 1  # 2 chunks per process
    if family == "gpt2":
        assert torch.equal(got["model.lm_head.weight"], got["model.transformer.wte.weight"])


def test_unequal_replicas_of_a_traced_model_equal_one_device(trained):
    """replicas=[2, 1] on 3 processes (1F1B-RR: stage 0's replicas take micro-batches whole and all-reduce) on a
    traced LlamaForCausalLM, with validation, clipping and a scheduler: one device's weights and logged losses."""
    _, _, metrics = assert_trained_alike(trained / "llama" / "rr_on_3", trained / "llama" / "single", 1e-5, 6,
                                         ("train_loss", "val_loss"))
    assert len(metrics[0]["split_points"]) == 1  # 2 stages


@pytest.mark.parametrize(("family", "resumed"), [("llama", "zb_v_resumed_under_1f1b"),
                                               ("gpt2", "zb_v_on_4_resumed_under_interleaved")])
def test_a_zb_v_checkpoint_of_a_hugging_face_model_resumes_on_another_schedule(trained, family, resumed):
    """The V run's checkpoint (the last chunk on rank 0) holds the module's state whole: Llama's (4 chunks on 2
    processes) under 1f1b on 2 stages, GPT-2's (8 chunks on 4 processes) under interleaved on 2 processes, a third
    epoch ends with one device's weights after 3 epochs (optimizer momentum and scheduler restored)."""
    got, _, _ = assert_trained_alike(trained / family / resumed, trained / family / "single_3", 1e-6, 9,
                                     ("train_loss",))
    if family == "gpt2":
        assert torch.equal(got["model.lm_head.weight"], got["model.transformer.wte.weight"])


def test_a_traced_graphs_sharded_checkpoint_holds_and_restores_the_full_ones_state(trained):
    from lightning_pipedream.strategy.checkpoints.sharded_checkpoint import consolidate

    full = torch.load(trained / "hf" / "pipe" / "final.ckpt", weights_only=False, map_location="cpu")
    sharded = consolidate(str(trained / "hf_sharded" / "final.ckpt"))
    restored = torch.load(trained / "hf_sharded_resumed" / "final-full.ckpt", weights_only=False, map_location="cpu")
    for got in (sharded, restored):
        assert list(got["state_dict"]) == list(full["state_dict"])  # tied names and all, in the module's order
        for key, want in full["state_dict"].items():
            assert torch.equal(got["state_dict"][key], want), key
        (opt,), (want_opt,) = got["optimizer_states"], full["optimizer_states"]
        assert sorted(opt["state"]) == sorted(want_opt["state"]) and opt["param_groups"] == want_opt["param_groups"]
        for index, state in want_opt["state"].items():
            assert all(torch.equal(opt["state"][index][k], v) for k, v in state.items()), index


def test_an_output_dataclass_with_a_cache_trains_and_the_cache_is_named(trained):
    # test_training_equals_one_device["hf"] checks the weights and the validation loss; here, what the user is told.
    metrics = json.loads((trained / "hf" / "pipe" / "metrics.json").read_text())
    assert any("HFStyleModule's output holds a KeyValueCache at `output.past_key_values`" in w and
               "pass use_cache=False to the model (Hugging Face models)" in w for w in metrics["warnings"])
    assert metrics["capture_cached"] is False and metrics["capture_s"] > 0


def two_bw_rule(family: str, steps: int = 3, size: int = 4) -> dict[str, torch.Tensor]:
    """PipeDream-2BW's rule in one process, W(t+1) = W(t) - lr * grad f_t(W(t-1)), on the module itself: a tied
    parameter is one tensor, its gradient the sum over its uses."""
    module = HFStyleModule(family)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    names = [name for name, _ in module.named_parameters()]
    before = {k: p.detach().clone() for k, p in module.named_parameters()}
    for (input_ids,), labels in batches(family, steps, size):
        params = {k: w.clone().requires_grad_() for k, w in before.items()}
        loss = torch.func.functional_call(module, params, (input_ids,), {"labels": labels}, tie_weights=True).loss
        grads = torch.autograd.grad(loss, [params[k] for k in names])
        before = {k: p.detach().clone() for k, p in module.named_parameters()}
        for p, g in zip(module.parameters(), grads):
            p.grad = g
        optimizer.step()
    return module.state_dict()


def test_two_bw_with_weights_tied_across_stages_follows_its_rule(trained):
    # The HF-style LM's head (last stage) is tied to its token embedding (stage 0): each stage keeps its copy and
    # its two versions, and the copies' gradients are summed at every update.
    got = weights(trained / "hf_2bw" / "final.ckpt")
    want = two_bw_rule("hf")
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    assert torch.equal(got["model.head.weight"], got["model.tok.weight"])
    synchronous = weights(trained / "hf" / "single" / "final.ckpt")
    assert max((synchronous[k] - v).abs().max().item() for k, v in want.items()) > 1e-4  # not the synchronous rule


def test_a_second_run_of_the_same_model_captures_from_the_cache(trained):
    first = json.loads((trained / "hf" / "pipe" / "metrics.json").read_text())
    again = json.loads((trained / "hf_2bw" / "metrics.json").read_text())
    assert again["capture_cached"] is True and again["capture_s"] == 0.0
    assert again["split_points"] == first["split_points"]  # the profile came from the cache too


def tied_lstm_rule() -> tuple[PipeDreamRule, dict[str, torch.Tensor]]:
    """PipeDream's rule for the LSTM LM on 2 stages (embedding and rnn1 | rnn2 and the decoder tied to the
    embedding): each stage updates its copy at its own step for minibatch t with the sum of both copies' gradients
    for t, each at its own stage's stashed weights (tests/helpers/pipedream_reference.py, untied copies + ties).
    Returns the rule and its final weights under the Sequential's names (layers 0..3)."""
    model, _ = make("lstm")
    decoder = nn.Linear(16, 31)
    decoder.weight, decoder.bias = nn.Parameter(model.emb.weight.detach().clone()), model.dec.bias
    stages = nn.Sequential(model.emb, LSTMOutput(model.rnn1), LSTMOutput(model.rnn2), decoder)
    rule = PipeDreamRule(stages, [2, 2], lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), loss_fn,
                         lambda index: {"lr": 0.1}, ties=[[(0, "0.weight"), (1, "1.weight")]])
    rule.segment([Minibatch(i, args[0], targets) for i, (args, targets) in enumerate(batches("lstm", 3, 4))])
    return rule, {k: v.detach() for k, v in stages.state_dict().items()}


def test_pipedream_with_weights_tied_across_stages_follows_its_rule(trained):
    # The LSTM LM's traced graph split before rnn2: the embedding on stage 0, the decoder tied to it on stage 1.
    got = weights(trained / "lstm_pipedream" / "final.ckpt")
    rule, final = tied_lstm_rule()
    want = {"model.emb.weight": final["0.weight"], "model.dec.weight": final["3.weight"],
            "model.dec.bias": final["3.bias"],
            **{f"model.rnn{i}.{k[len(f'{i}.lstm.'):]}": v for i in (1, 2) for k, v in final.items()
               if k.startswith(f"{i}.")}}
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    # The copies (the embedding on stage 0, the decoder on stage 1) stay bit-identical.
    assert torch.equal(got["model.emb.weight"], got["model.dec.weight"])
    # A minibatch's loss is logged on every rank once it has finished (after the drain: the last one).
    assert json.loads((trained / "lstm_pipedream" / "metrics.json").read_text())["train_loss"] == pytest.approx(
        rule.losses[-1], rel=1e-5)


def test_a_sequential_with_weights_tied_across_stages_follows_the_same_rule(trained):
    # The same LM as one nn.Sequential (AWD-LSTM's shape), split between layers by balance=[2, 2]: layer 0 (the
    # embedding) and layer 3 (the decoder) share their weight across the two stages.
    got = weights(trained / "tied_sequential" / "final.ckpt")
    want = {f"layers.{k}": v for k, v in tied_lstm_rule()[1].items()}
    assert list(got) == list(want)  # both names of the tied weight, as the module's own state_dict
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    assert torch.equal(got["layers.0.weight"], got["layers.3.weight"])
    # Under 2bw with gradient clipping by norm (each stage by its own norm, a tied parameter by its own) the copies
    # stay identical too.
    clipped = torch.load(trained / "tied_sequential_2bw" / "final.ckpt", weights_only=False, map_location="cpu")
    assert torch.equal(clipped["state_dict"]["layers.0.weight"], clipped["state_dict"]["layers.3.weight"])
    assert all(v.isfinite().all() for v in clipped["state_dict"].values())
    # The optimizer state is in single-device form: the tied weight is one parameter.
    assert len(clipped["optimizer_states"][0]["state"]) == len(list(TiedSequentialLM().parameters())) == 10


@pytest.mark.parametrize("run", ["pipe", "labels"])
def test_a_token_mean_loss_over_padded_batches_with_mean_over_or_labels_equals_one_device(trained, run):
    """With mean_over= counting the labelled tokens, or without it when the step passes the labels as labels= (the
    strategy counts their tokens that are not -100 itself, strategy/setup/labels.py): one device's weights, and its
    logged train_loss and val_loss (each micro-batch's token mean weighed by its tokens)."""
    single, pipe = trained / "hf_lm" / "single", trained / "hf_lm" / run
    got, want = weights(pipe / "final.ckpt"), weights(single / "final.ckpt")
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    metrics = [json.loads((d / "metrics.json").read_text()) for d in (pipe, single)]
    assert metrics[0]["global_step"] == metrics[1]["global_step"] == 3  # the last batch (1 sample) trained too
    for name in ("train_loss", "val_loss"):  # the last batches of 1 sample, fewer than chunks=2, ran
        assert metrics[0][name] == pytest.approx(metrics[1][name], rel=1e-5), name
    assert not [w for w in metrics[0]["warnings"] if "unevenly" in w]


def test_a_token_mean_loss_whose_labels_the_strategy_cannot_see_is_warned_about(trained):
    metrics = json.loads((trained / "hf_lm" / "unweighted" / "metrics.json").read_text())
    assert ["PipeDreamStrategy: this batch's labels leave out padding (-100) unevenly: its micro-batches hold [4, 6] "
            "labelled tokens for [2, 2] samples. A loss that is a mean over each micro-batch's tokens (cross_entropy "
            "with ignore_index=-100, Hugging Face models) then weighs tokens unequally and differs from one device. "
            "PipeDreamStrategy weighs each micro-batch by its labelled tokens itself when it sees the labels: passed "
            "to the model as labels= (self.model(input_ids=..., labels=...)), or a dict batch's 'labels'; here it "
            "sees neither. Pass the labels so, or pass PipeDreamStrategy(mean_over=...) a function counting a batch's "
            "labelled tokens, e.g. mean_over=lambda batch: (batch[1] != -100).sum(), to weigh each micro-batch by its "
            "tokens (exact). A loss that is a mean over samples needs nothing."] == [
        w for w in metrics["warnings"] if "unevenly" in w]


def test_a_skipped_batch_is_refused_with_the_reason_on_every_rank(tmp_path):
    proc = run(tmp_path, {"family": "hf", "module": "hf", "model": {"skip_batch": 1}, "devices": 2,
                          "strategy": {"schedule": "1f1b", "chunks": 2}}, expect_ok=False)
    assert proc.returncode != 0
    reason = ("training_step returned None, which Lightning takes as 'skip this batch'. PipeDreamStrategy cannot skip "
              "a batch from the last stage's training_step: the other stages have already run its forward (and, "
              "asynchronously, later batches). Leave such batches out before they reach the Trainer (filter them in "
              "the dataset, sampler or collate_fn), or return the loss.")
    assert f"TypeError: {reason}" in proc.stderr  # the last stage (rank 1)
    assert f"PeerFailedError: Pipeline stage 1 failed with TypeError: {reason}" in proc.stderr  # rank 0


def test_an_untraceable_model_gets_the_way_out(tmp_path):
    proc = run(tmp_path, {"family": "lstm", "untraceable": True, "devices": 2, "strategy": {"schedule": "1f1b"}},
               expect_ok=False)
    assert proc.returncode != 0
    assert "GraphCaptureError" in proc.stderr and "graph_trainer.py" in proc.stderr  # names the user's line
    # Rank 0 captures and profiles alone; rank 1 learns why it failed rather than "connection closed".
    assert "Rank 0 could not split DataDependent into stages, so this rank stops too. Rank 0's error: " in proc.stderr
    assert ("Move the branch out of forward (into training_step, say); or name where stages begin, "
            "PipeDreamStrategy(split_points=['model.layers.4', ...]): then only the innermost module holding them "
            "that the step calls is traced") in proc.stderr


def test_layers_and_split_points_are_exclusive():
    with pytest.raises(ValueError, match="takes layers= .* or split_points= .*, not both"):
        PipeDreamStrategy(layers="layers", split_points=["layers.2"])
