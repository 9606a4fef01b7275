"""Every config composes: the defaults, each task, and each experiment (the paper's settings) pair a model
and a data set of the same task, and the strategy group builds what the Trainer gets."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]

from recipes.data import DATA  # noqa: E402
from recipes.models import MODELS  # noqa: E402
from recipes.train import build_strategy  # noqa: E402

EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_defaults_are_the_main_job() -> None:
    cfg = composed()
    assert (cfg.task.name, cfg.model.name, cfg.data.name) == ("image", "digits_cnn", "digits")
    assert (cfg.strategy.name, cfg.strategy.schedule, cfg.trainer.devices, cfg.trainer.accelerator) == \
        ("pipedream", "pipedream", 2, "cpu")


@pytest.mark.parametrize("overrides", [[f"task={t}"] for t in ("image", "translation", "language_model",
                                                               "video_captioning")]
                         + [[f"experiment={e}"] for e in EXPERIMENTS])
def test_config_pairs_model_and_data_of_its_task(overrides: list[str]) -> None:
    cfg = composed(*overrides)
    assert MODELS[cfg.model.name][0] == cfg.task.name
    assert DATA[cfg.data.name][0] == cfg.task.name
    assert cfg.optim.name in ("sgd", "adam", "adamw") and cfg.optim.lr > 0


def test_command_line_model_wins_over_the_task_default() -> None:
    cfg = composed("task=translation", "model=gnmt16")
    assert (cfg.model.name, cfg.model.num_layers, cfg.model.hidden_size) == ("gnmt16", 8, 64)
    cfg = composed("experiment=gnmt16_wmt16", "strategy.schedule=1f1b", "strategy.chunks=4")
    assert (cfg.model.hidden_size, cfg.strategy.schedule, cfg.strategy.chunks) == (1024, "1f1b", 4)


def test_strategy_group_builds_the_strategy() -> None:
    from lightning_pipedream import PipeDreamStrategy

    strategy = build_strategy(composed("strategy.schedule=gpipe", "strategy.chunks=4", "strategy.balance=[4,6]").strategy)
    assert isinstance(strategy, PipeDreamStrategy)
    assert (strategy.schedule, strategy.chunks, strategy.options.balance) == ("gpipe", 4, (4, 6))
    assert build_strategy(composed("strategy=auto").strategy) == "auto"
    sharded = build_strategy(composed("strategy.schedule=1f1b", "strategy.stages=2", "strategy.shard=full").strategy)
    assert (sharded.options.stages, sharded.options.shard) == (2, "full")  # 2 x d processes, each stage sharded


def test_trainer_keys_override_from_the_command_line() -> None:
    """`trainer.max_steps=2` (any key of conf/trainer) reaches the Trainer the recipe builds, as in any Lightning +
    Hydra project; the smoke sweep in test_recipes_runs.py stops at conf/trainer/smoke's max_steps end to end."""
    import torch

    from recipes.train import build

    threads = torch.get_num_threads()  # build() sets the process's threads for its ranks
    try:
        trainer, *_ = build(composed("trainer.max_steps=2", "trainer.limit_val_batches=1",
                                     "trainer.val_check_interval=2"), 0.0)
    finally:
        torch.set_num_threads(threads)
    assert (trainer.max_steps, trainer.limit_val_batches, trainer.val_check_interval) == (2, 1, 2)
