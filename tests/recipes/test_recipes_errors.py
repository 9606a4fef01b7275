"""Bad input gives a clear error that says what was wrong and how to fix it: unknown task or model names,
a model or data set of another task, a dataset path that does not exist."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from script_runs import run_killable

ROOT = Path(__file__).resolve().parents[2]

from recipes.data import build_datamodule  # noqa: E402

pytestmark = pytest.mark.multiprocess  # starts several processes: not in the fast suite

TRAIN = ROOT / "recipes" / "train.py"


def train(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python recipes/train.py ARGS`` (a fork of this worker's warm zygote, as the recipe runs' tests start it)."""
    return run_killable([sys.executable, str(TRAIN), *args, f"hydra.run.dir={cwd / 'run'}"], cwd, 120)


@pytest.mark.parametrize("group, name, listed", [("task", "imagenet", "language_model"), ("model", "gnmt4", "gnmt16"),
                                                 ("experiment", "vgg19_imagenet", "vgg16_imagenet")])
def test_unknown_config_name_lists_the_choices(tmp_path: Path, group: str, name: str, listed: str) -> None:
    proc = train([f"{group}={name}"], tmp_path)
    assert proc.returncode != 0
    assert f"Could not find '{group}/{name}'" in proc.stderr and listed in proc.stderr
    assert not (tmp_path / "run" / "results.json").exists()


def test_model_of_another_task_and_missing_dataset_path(tmp_path: Path) -> None:
    """Both checks in one run each; they stop before any training (one torch import apiece)."""
    proc = train(["task=image", "model=gnmt8", "strategy=auto", "trainer.devices=1"], tmp_path)
    assert proc.returncode == 2
    assert "error: model 'gnmt8' is a translation model, but task=image; for task=image choose one of: digits_cnn" \
        in proc.stderr
    assert "Traceback" not in proc.stderr

    proc = train(["task=image", "data=imagefolder", f"data.path={tmp_path / 'no-such-imagenet'}", "strategy=auto",
                  "trainer.devices=1"], tmp_path)
    assert proc.returncode == 2
    assert f"error: data.path={tmp_path / 'no-such-imagenet'} does not exist: point data.path at the image folder" \
        in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name, task", [("imagefolder", "image"), ("wmt16", "translation"),
                                        ("wikitext", "language_model"), ("msvd", "video_captioning")])
def test_path_datasets_need_an_existing_folder(tmp_path: Path, name: str, task: str) -> None:
    with pytest.raises(ValueError, match=r"needs data.path: set data.path=/path/to/dataset"):
        build_datamodule(name, task).setup()
    with pytest.raises(FileNotFoundError, match=r"data.path=.*missing does not exist: point data.path at"):
        build_datamodule(name, task, path=str(tmp_path / "missing")).setup()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(NotADirectoryError, match=r"is a file, not a folder"):
        build_datamodule(name, task, path=str(tmp_path / "a-file")).setup()
    with pytest.raises(FileNotFoundError, match=r"(no .* in|is missing)"):  # an empty folder: says which files
        build_datamodule(name, task, path=str(tmp_path)).setup()


def test_data_of_another_task_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"data 'numbers' is for task=translation, but task=image; .*digits, imagefolder"):
        build_datamodule("numbers", "image")
