"""Each recipe data loader reads a small fixture in its real on-disk format, written here."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from recipes.data import build_datamodule  # noqa: E402
from recipes.data.translation import number_to_words  # noqa: E402
from recipes.data.vocab import EOS  # noqa: E402


def test_imagefolder_reads_imagenet_layout(tmp_path: Path) -> None:
    from PIL import Image

    for split, per_class in (("train", 3), ("val", 2)):
        for label, colour in (("n01440764", (255, 0, 0)), ("n01443537", (0, 0, 255))):
            folder = tmp_path / split / label
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (40, 30), colour).save(folder / f"{label}_{i}.JPEG")
    dm = build_datamodule("imagefolder", "image", path=str(tmp_path), batch_size=2, image_size=16, num_workers=0)
    assert dm.model_kwargs() == {"num_classes": 2, "in_channels": 3, "image_size": 16}
    assert (len(dm.train_set), len(dm.val_set)) == (6, 4)
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (2, 3, 16, 16) and y.tolist() == [0, 0]
    # red images: after ImageNet normalisation the red channel is high, blue low
    assert x[0, 0].mean() > 2 and x[0, 2].mean() < -1


def test_wmt16_parallel_text(tmp_path: Path) -> None:
    en = ["the house is small", "hello world", "a very long sentence " + "x " * 60]
    de = ["das Haus ist klein", "hallo Welt", "ein sehr langer Satz"]
    for prefix in ("train.tok.clean.bpe.32000", "newstest2014.tok.bpe.32000"):
        (tmp_path / f"{prefix}.en").write_text("\n".join(en) + "\n")
        (tmp_path / f"{prefix}.de").write_text("\n".join(de) + "\n")
    dm = build_datamodule("wmt16", "translation", path=str(tmp_path), batch_size=2)
    dm.setup()
    assert len(dm.train_set) == 2  # the 64-token sentence is over max_len=50
    src, tgt_in, tgt_out = dm.collate([dm.train_set[0], dm.train_set[1]])
    assert dm.vocab.decode(src[0].tolist()) == "the house is small".split()
    assert dm.vocab.decode(tgt_in[1].tolist()) == ["hallo", "Welt"]
    assert dm.vocab.itos[tgt_out[0, 4]] == EOS and tgt_out[1, 3] == 0  # EOS then padding


def test_wmt16_uses_the_shared_vocab_file_and_rejects_misaligned_files(tmp_path: Path) -> None:
    (tmp_path / "train.en").write_text("a b\n")
    (tmp_path / "train.de").write_text("c d\n")
    (tmp_path / "valid.en").write_text("a\nb\n")
    (tmp_path / "valid.de").write_text("c\n")
    (tmp_path / "vocab.bpe.32000").write_text("a\nb\nc\nd\ne\n")
    dm = build_datamodule("wmt16", "translation", path=str(tmp_path), train_prefix="train", val_prefix="valid")
    with pytest.raises(ValueError, match="valid.en has 2 lines but valid.de has 1"):
        dm.setup()
    (tmp_path / "valid.de").write_text("c\nd\n")
    dm = build_datamodule("wmt16", "translation", path=str(tmp_path), train_prefix="train", val_prefix="valid")
    assert dm.model_kwargs()["tgt_vocab_size"] == 4 + 5  # specials + the file's tokens


@pytest.mark.parametrize("layout", [("wiki.train.tokens", "wiki.valid.tokens"), ("ptb.train.txt", "ptb.valid.txt")])
def test_wikitext_and_ptb_token_files(tmp_path: Path, layout: tuple[str, str]) -> None:
    (tmp_path / layout[0]).write_text(" = Title = \n\n the cat sat on the mat \n the <unk> ran \n" * 3)
    (tmp_path / layout[1]).write_text(" the cat ran \n" * 4)
    dm = build_datamodule("wikitext", "language_model", path=str(tmp_path), batch_size=2, bptt=4)
    dm.setup()
    itos = dm.vocab.itos
    x, y = dm.train_set[0]
    assert [itos[i] for i in x] == ["=", "Title", "=", EOS]  # blank line skipped, <eos> at each line end
    assert torch.equal(dm.train_set[0][1][:-1], dm.train_set[0][0][1:])  # the target is the input shifted by one
    assert "<unk>" in itos and len(dm.val_set) == (4 * 4 - 1) // 4


def test_msvd_features_and_captions(tmp_path: Path) -> None:
    (tmp_path / "features").mkdir()
    rows = [("vid1", 1, 5, "English", "A man is playing a guitar."), ("vid1", 1, 5, "English", "someone plays guitar"),
            ("vid1", 1, 5, "German", "Ein Mann spielt Gitarre"), ("vid2", 0, 3, "English", "A cat eats."),
            ("vid3", 2, 9, "English", "a dog runs")]
    with (tmp_path / "MSR Video Description Corpus.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["VideoID", "Start", "End", "WorkerID", "Source", "AnnotationTime", "Language", "Description"])
        for vid, start, end, lang, text in rows:
            writer.writerow([vid, start, end, 1, "clean", 10, lang, text])
    for clip, frames in (("vid1_1_5", 5), ("vid2_0_3", 3), ("vid3_2_9", 7)):
        np.save(tmp_path / "features" / f"{clip}.npy", np.full((frames, 6), 0.5, dtype=np.float32))
    dm = build_datamodule("msvd", "video_captioning", path=str(tmp_path), batch_size=2)
    assert dm.model_kwargs()["feature_size"] == 6
    # 3 clips: the first 90% (2 clips) train with their 3 English captions, the last one validates
    assert (len(dm.train_set), len(dm.val_set)) == (3, 1)
    feats, _, cap_out = dm.collate([dm.train_set[0], dm.train_set[2]])
    assert feats.shape == (2, 5, 6) and feats[1, 3:].abs().sum() == 0  # shorter clip padded at the end
    assert dm.vocab.decode(cap_out[0].tolist()) == "a man is playing a guitar".split()
    (tmp_path / "features" / "vid3_2_9.npy").unlink()
    with pytest.raises(FileNotFoundError, match="vid3_2_9.npy"):
        build_datamodule("msvd", "video_captioning", path=str(tmp_path)).setup()


def test_offline_defaults_are_deterministic_and_well_formed() -> None:
    assert number_to_words(45012) == ["forty", "five", "thousand", "twelve"]
    assert number_to_words(100) == ["one", "hundred"] and number_to_words(0) == ["zero"]
    a = build_datamodule("numbers", "translation", num_train=50, num_val=10, seed=3)
    b = build_datamodule("numbers", "translation", num_train=50, num_val=10, seed=3)
    a.setup(), b.setup()
    assert a.vocab.itos == b.vocab.itos and a.train_set[7] == b.train_set[7]  # every rank builds the same data
    src, _, tgt_out = a.train_set[0]
    number = int("".join(a.vocab.itos[i] for i in src))
    assert a.vocab.decode(tgt_out) == number_to_words(number)
    shapes = build_datamodule("shapes", "video_captioning", num_train=8, num_val=4, frames=4, size=8)
    shapes.setup()
    feats, _, cap_out = shapes.collate([shapes.train_set[0], shapes.train_set[1]])
    assert feats.shape == (2, 4, 8 * 8 * 3) and shapes.vocab.decode(cap_out[0].tolist())[0] == "a"
    digits = build_datamodule("digits", "image")
    digits.setup()
    assert (len(digits.train_set), len(digits.val_set)) == (1438, 359)
    lm = build_datamodule("shakespeare", "language_model", bptt=32)
    lm.setup()
    assert "".join(lm.vocab.itos[i] for i in lm.train_set[0][0][:10]) == "THE SONNET"


def test_loaders_pin_memory_when_asked_or_when_training_on_a_gpu():
    from types import SimpleNamespace

    from recipes.data.image import DigitsDataModule

    data = DigitsDataModule(batch_size=4)
    assert data.pinned is False  # no Trainer yet: nothing to copy to
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    assert data.pinned is True  # a GPU: page-locked batches, which Lightning copies with non_blocking=True
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    assert data.pinned is False
    assert DigitsDataModule(batch_size=4, pin_memory=True).pinned is True
