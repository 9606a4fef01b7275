"""Hugging Face models built on the meta device (configure_model) and loaded per stage with `pretrained=`, trained
by a Trainer: `python meta_trainer.py --runs RUNS.json`.

Each run writes, per rank, its stage's final tensors (``stage{rank}.pt``) and its resident-memory figures
(``memory{rank}.json``: the peak above the process's imports from setup to the first training step, and the
bytes of the whole model's weights; and what ran: the schedule, stages and pipelines ``schedule="auto"`` chose)
for the test to compare with one process that used ``from_pretrained``.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))  # the libraries the tests share
from script_runs import main_runs, refuse_unused, trainer_args, write_json  # noqa: E402

from lightning_pipedream import PipeDreamStrategy


def status_kb(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak() -> None:
    """VmHWM := VmRSS, so that the peak counts from here (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class TokenBatches:
    """``count`` batches of ``size`` random sequences (a plain iterable: Lightning leaves it as it is)."""

    def __init__(self, vocab: int, count: int, size: int, length: int) -> None:
        generator = torch.Generator().manual_seed(7)
        self.items = [(torch.randint(0, vocab, (size, length), generator=generator),) for _ in range(count)]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


class LabelledBatches(TokenBatches):
    """``count`` batches of ``(input_ids, labels)`` as Hugging Face's fine-tuning idioms make them: ``"ids"``, the
    labels are the tokens (a causal LM shifts them itself); ``"prompt"``, a prompt of 0 to length - 2 tokens per
    sequence left out of the loss (labels -100; where it is empty, the first label counts unshifted only); ``"masked"``, BERT's masked LM: tokens replaced by ``mask_id`` at
    random, the labels the original tokens there and -100 everywhere else (at least one masked token per sequence)."""

    def __init__(self, vocab: int, count: int, size: int, length: int, kind: str, mask_id: int = 1) -> None:
        generator = torch.Generator().manual_seed(11)
        self.items = []
        for _ in range(count):
            ids = torch.randint(2, vocab, (size, length), generator=generator)
            if kind == "ids":
                labels = ids.clone()
            elif kind == "prompt":
                prompt = torch.randint(0, length - 1, (size, 1), generator=generator)
                labels = ids.masked_fill(torch.arange(length) < prompt, -100)
            elif kind == "masked":
                masked = torch.rand(size, length, generator=generator) < 0.3
                masked[torch.arange(size), torch.randint(0, length, (size,), generator=generator)] = True
                labels = ids.masked_fill(~masked, -100)
                ids = ids.masked_fill(masked, mask_id)
            else:
                raise ValueError(kind)
            self.items.append((ids, labels))


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, a mean over the tokens predicted."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             input_ids[:, 1:].reshape(-1))


class MetaLM(L.LightningModule):
    """The model of ``config_dir`` built in configure_model (on the meta device under PipeDreamStrategy)."""

    def __init__(self, config_dir: str, lr: float = 0.05, optimizer: str = "sgd") -> None:
        super().__init__()
        self.config_dir, self.lr, self.optimizer = config_dir, lr, optimizer
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

            config = AutoConfig.from_pretrained(self.config_dir)
            auto = AutoModelForMaskedLM if config.model_type == "bert" else AutoModelForCausalLM
            self.model = auto.from_config(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, use_cache=False).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        return lm_loss(self(input_ids), input_ids)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class HFIdiomLM(MetaLM):
    """Hugging Face's fine-tuning idiom as its users write it: the model (its config's defaults: use_cache on) computes
    its own loss from ``labels=``, called directly from the step; no forward of the LightningModule's own."""

    forward = L.LightningModule.forward  # type: ignore[assignment]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, labels = batch
        return self.model(input_ids=input_ids, labels=labels).loss


def load_export() -> None:
    """Import what torch.export loads on its first trace (tens of MiB of code and tables): imports, not weights."""
    torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),), strict=False).run_decompositions({})


class PeakBeforeFirstStep(L.Callback):
    """The resident peak from setup (imports done, torch.export's included) to the first training step, above the
    resident size then."""

    def __init__(self) -> None:
        load_export()
        self.base_kb = status_kb("VmRSS")
        reset_peak()
        self.peak_kb: int | None = None

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.peak_kb is None:
            self.peak_kb = status_kb("VmHWM") - self.base_kb


class StepMemory(L.Callback):
    """The live tensor bytes of one training step (``LiveTensorBytes``, every storage an operator returns; the stage's
    parameters, gradients and optimizer state counted from the start), the memory model's quantity, with the terms
    it sums: this rank's parameters, their gradients before the update, the optimizer's state after it."""

    def __init__(self, step: int) -> None:
        self.step, self.meter, self.result = step, None, None  # type: ignore[var-annotated]
        self.gradients = 0

    def _stage_tensors(self, trainer: L.Trainer) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        params = list(trainer.strategy._pipeline.stage.parameters())
        state = [t for s in trainer.optimizers[0].state.values() for t in s.values() if isinstance(t, torch.Tensor)
                 and t.dim() > 0]  # Adam's step count is a 0-d tensor: not a term of the model
        return params, [p.grad for p in params if p.grad is not None], state

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step or self.meter is not None:
            return
        from lightning_pipedream.plan.live_bytes import LiveTensorBytes

        self.meter = LiveTensorBytes()
        params, grads, state = self._stage_tensors(trainer)
        self.meter.add_all([*params, *trainer.strategy._pipeline.stage.buffers(), *grads, *state, *batch])
        engine = trainer.strategy._pipeline.engine
        for stage in engine.stages.values():  # what ran at the peak
            for name in ("forward", "backward", "backward_input", "backward_weight"):
                setattr(stage, name, self.meter.labelled(name, getattr(stage, name)))
        train_step, meter = engine.train_step, self.meter

        def labelled_loss(inputs: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:  # the user's loss
            return train_step(inputs, meter.labelled("loss", loss), *args, **kwargs)

        engine.train_step = labelled_loss
        self.meter.__enter__()

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if self.meter is not None and self.result is None:
            self.gradients = sum(nbytes(g) for g in self._stage_tensors(trainer)[1])

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.meter is None or self.result is not None:
            return
        self.meter.__exit__(None, None, None)
        params, _, state = self._stage_tensors(trainer)
        self.result = {"peak_tensor_bytes": self.meter.peak, "peak_phase": self.meter.peak_phase,
                       "peak_phase_base_bytes": self.meter.peak_phase_base, "transient": dict(self.meter.transient),
                       "parameters": sum(nbytes(p) for p in params), "gradients": self.gradients,
                       "optimizer_state": sum(nbytes(t) for t in state)}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def train(out: str, options: dict[str, Any]) -> None:
    os.makedirs(out, exist_ok=True)
    started = time.process_time()
    torch.set_num_threads(1)
    config_dir = options.pop("config_dir")
    labels = options.pop("labels", None)  # LabelledBatches' kind: the HF idiom's step (HFIdiomLM)
    module = (HFIdiomLM if labels else MetaLM)(config_dir, options.pop("lr", 0.05), options.pop("optimizer", "sgd"))
    peak = PeakBeforeFirstStep()
    step = StepMemory(options.pop("measure_step")) if "measure_step" in options else None
    sizes = options.pop("data")  # [vocab, batches, batch size, sequence length]
    data = LabelledBatches(*sizes, labels) if labels else TokenBatches(*sizes)
    trainer = L.Trainer(**trainer_args(devices=options.pop("devices"), max_epochs=options.pop("epochs", 2),
                                       use_distributed_sampler=False,
                                       callbacks=[peak] + ([step] if step is not None else []),
                                       strategy=PipeDreamStrategy(**options.pop("strategy"))))
    refuse_unused(options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    rank = trainer.global_rank
    stage = trainer.strategy._pipeline.stage  # this rank's stage module: its tensors under the model's names
    torch.save({k: v.detach().clone() for k, v in stage.state_dict().items()}, f"{out}/stage{rank}.pt")
    chose = trainer.strategy.options  # what ran (schedule="auto": the planner's choice, as this rank received it)
    write_json(f"{out}/memory{rank}.json", {
        "ran": {"schedule": chose.schedule, "chunks": chose.chunks, "stages": trainer.strategy.num_stages,
                "pipelines": trainer.strategy.num_pipelines, "stage": trainer.strategy.stage_index,
                "split_points": list(chose.split_points or [])},
        "peak_before_first_step_bytes": (peak.peak_kb or 0) * 1024,
        # the strategy's prediction of every rank's peak (plan.memory.StageMemory terms) and this rank's measured step
        "predicted": trainer.strategy._pipeline.graph.predicted_memory, "step": step.result if step else None,
        "cpu_s": time.process_time() - started,  # this rank's CPU time for the run (what it adds to the suite)
        "warnings": sorted({str(w.message) for w in caught if "PipeDreamStrategy" in str(w.message)})})


if __name__ == "__main__":
    main_runs(train)
