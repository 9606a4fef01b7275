"""`python recipes/train.py [task=... model=... strategy.schedule=...]`: train one of the PipeDream paper's tasks."""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `recipes` importable
    sys.path.insert(0, str(ROOT))

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

# Problems the user fixes from the command line (bad name, bad path, missing package): one line, no traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, ImportError)


def build_strategy(cfg: DictConfig) -> Any:
    """`strategy.name=pipedream` -> PipeDreamStrategy(schedule, chunks, balance, plan, ...); others go to Lightning."""
    if cfg.name != "pipedream":
        return cfg.name
    try:
        from lightning_pipedream import PipeDreamStrategy
    except ImportError as err:
        raise ImportError(
            f"strategy=pipedream needs lightning_pipedream.PipeDreamStrategy, which failed to import "
            f"({err}); to train on one process use strategy=auto trainer.devices=1"
        ) from err
    options = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "name"}
    return PipeDreamStrategy(**options)


def world_size(devices: Any) -> int:
    """Processes the Trainer will start for `trainer.devices` (an int or a list of device ids)."""
    if isinstance(devices, int):
        return devices
    return len(devices) if isinstance(devices, (list, tuple)) else 1


def per_process_batch(strategy: str, batch_size: int, processes: int) -> dict[str, int]:
    """`data.batch_size` is the global batch of one update. Under DDP each process reads its share, so DDP and a
    pipeline (whose stages all read the whole batch) compare at the same batch and number of updates."""
    if not strategy.startswith("ddp") or processes == 1:
        return {}
    if batch_size % processes:
        raise ValueError(f"data.batch_size={batch_size} is the global batch, which strategy={strategy} splits over "
                         f"{processes} processes; choose a multiple of {processes}")
    return {"batch_size": batch_size // processes, "global_batch_size": batch_size}


def check_carried_state(model: dict[str, Any], data: dict[str, Any], strategy: str = "auto") -> None:
    """A model that carries its hidden state across batches needs batches that continue each other. (Tied weights
    keep the model a Sequential split between layers, whose stages carry their layers' state under every strategy.)"""
    if model.get("carry_state") and not data.get("streams"):
        raise ValueError("model.carry_state=true carries the hidden state from one batch to the next, which needs "
                         "batches that continue the same text streams: set data.streams=true, or "
                         "model.carry_state=false for independent shuffled windows")


def build(cfg: DictConfig, start: float) -> tuple[Any, Any, Any, Any]:
    """(trainer, task module, data module, results callback) from the composed config; times count from `start`."""
    import lightning as L
    import torch

    from recipes.data import build_datamodule
    from recipes.models import build_model
    from recipes.results import PlanPrinter, ResultsCallback
    from recipes.tasks import TASKS

    task = cfg.task.name
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}")
    # the ranks share the machine's cores: more intra-op threads than cores per process only adds contention
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // world_size(cfg.trainer.devices)))
    L.seed_everything(cfg.seed, verbose=False)  # every rank must build the same data and initial weights

    data_options = OmegaConf.to_container(cfg.data, resolve=True)
    model_options = OmegaConf.to_container(cfg.model, resolve=True)
    check_carried_state(model_options, data_options, cfg.strategy.name)
    data_options.update(per_process_batch(cfg.strategy.name, data_options["batch_size"],
                                          world_size(cfg.trainer.devices) * int(cfg.trainer.get("num_nodes") or 1)))
    datamodule = build_datamodule(data_options.pop("name"), task, seed=cfg.seed, **data_options)
    datamodule.setup("fit")
    layers = build_model(model_options.pop("name"), task, **{**model_options, **datamodule.model_kwargs()})
    # the task config's own options besides its name and target (the language model's `samples`)
    task_options = {k: v for k, v in OmegaConf.to_container(cfg.task, resolve=True).items()
                    if k not in ("name", "target")}
    module = TASKS[task].from_data(layers, OmegaConf.to_container(cfg.optim, resolve=True), datamodule,
                                   **task_options)

    results = ResultsCallback(target=cfg.task.target, start=start)
    # null in conf/trainer means "Lightning's default": leave those keys out
    trainer_options = {k: v for k, v in OmegaConf.to_container(cfg.trainer, resolve=True).items() if v is not None}
    trainer = L.Trainer(
        **trainer_options,
        strategy=build_strategy(cfg.strategy),
        callbacks=[results, PlanPrinter([type(layer).__name__ for layer in layers])],
    )
    return trainer, module, datamodule, results


def train(cfg: DictConfig, output_dir: Path) -> dict[str, Any] | None:
    """Train; on rank 0 return the results and write them to `output_dir`/results.json."""
    from recipes.results import write_results

    start = time.perf_counter()  # the job's clock: data, model, process start, profiling and training
    try:
        trainer, module, datamodule, results = build(cfg, start)
        results.samples_file = output_dir / "samples.txt"  # the language model's samples, after each validation
        _hand_this_job_to_child_processes(output_dir)
        trainer.fit(module, datamodule=datamodule)
    except Exception as err:  # reported in results.json; the sweep summary names the job
        if not _in_multirun():
            if isinstance(err, USER_ERRORS):
                print(f"error: {err}", file=sys.stderr, flush=True)
                sys.exit(2)
            raise
        # In a sweep one bad job (e.g. pipedream with chunks=4) must not stop the others.
        error = f"{type(err).__name__}: {err}"
        print(f"error: job failed, the sweep goes on: {error}", file=sys.stderr, flush=True)
        write_results(output_dir / "results.json", {**_job_keys(cfg), "error": error})
        return None
    if not trainer.is_global_zero:
        return None

    plan = getattr(trainer.strategy, "plan", None)
    balance = getattr(trainer.strategy, "balance", None)
    summary = {
        **_job_keys(cfg),
        "stages": len(balance) if balance else 1,
        "metric_name": module.metric_name,
        "metric": results.metric,
        "throughput_samples_per_s": results.throughput,
        "time_to_target_s": results.time_to_target,
        "history": results.history,
    }
    explanation = getattr(trainer.strategy, "explanation", None)
    if explanation is not None:  # the plan's prediction against every stage's measured steps, the gap split
        print(explanation.table(), flush=True)
        summary["explanation"] = explanation.to_json()
    elif plan is not None and results.steps:
        print(
            f"time per minibatch: predicted {plan.time_per_minibatch * 1e3:.1f} ms, "
            f"measured {results.train_seconds / results.steps * 1e3:.1f} ms",
            flush=True,
        )
    write_results(output_dir / "results.json", summary)
    print(
        f"done: {module.metric_name}={_fmt(results.metric)}  throughput={_fmt(results.throughput)} samples/s  "
        f"time_to_target={_fmt(results.time_to_target)} s  wall={time.perf_counter() - start:.1f} s  "
        f"-> {output_dir / 'results.json'}",
        flush=True,
    )
    return summary


def _job_keys(cfg: DictConfig) -> dict[str, Any]:
    """What the job was asked to run: task, model, schedule, chunks (known even when it fails)."""
    from hydra.core.hydra_config import HydraConfig

    pipelined = cfg.strategy.name == "pipedream"
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    return {
        "task": cfg.task.name,
        "model": cfg.model.name,
        "schedule": cfg.strategy.schedule if pipelined else cfg.strategy.name,
        "chunks": cfg.strategy.chunks if pipelined else 1,
        "contender": choices.get("contender"),
        "seed": cfg.seed,
    }


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _hand_this_job_to_child_processes(output_dir: Path) -> None:
    """Lightning starts ranks > 0 by re-running sys.argv plus hydra.run.dir=<run dir>. In a -m sweep that
    would re-run the whole sweep, so hand it this job's own overrides and output dir instead."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return
    sys.argv = [sys.argv[0], *hydra_cfg.overrides.task]
    OmegaConf.set_readonly(hydra_cfg, False)
    hydra_cfg.run.dir = str(output_dir)


def _reset_distributed(env_before: dict[str, str]) -> None:
    """Let the next job of a sweep start its own process group on a fresh port."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env_before)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    # in-memory data sets need no loader workers; smoke runs are shorter than the logging interval; the
    # pipeline replays the last stage's logs on every rank, so Lightning's sync_dist advice does not apply
    for message in (
        ".*does not have many workers.*",
        ".*smaller than the logging interval.*",
        ".*sync_dist=True.*",
        ".*isinstance\\(treespec, LeafSpec\\).*",
    ):
        warnings.filterwarnings("ignore", message=message)
    env_before = dict(os.environ)
    try:
        train(cfg, Path(HydraConfig.get().runtime.output_dir))
    finally:
        _reset_distributed(env_before)


if __name__ == "__main__":
    main()
