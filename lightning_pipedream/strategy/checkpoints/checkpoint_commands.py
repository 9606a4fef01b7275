"""`python -m lightning_pipedream checkpoint consolidate|export-hf`: a sharded checkpoint as one Lightning file, or
its weights in Hugging Face's safetensors layout, on one machine without a strategy.

``consolidate DIR OUT.ckpt`` writes what a one-device Trainer writes (``MyModule.load_from_checkpoint`` and
``Trainer.fit(ckpt_path=...)`` read it); it holds the whole model in memory once. ``export-hf DIR OUTDIR --prefix
model.`` writes the weights under ``prefix`` (stripped) as ``model.safetensors``, or as numbered files with
``model.safetensors.index.json`` above ``--max-shard-size``, reading one output file's tensors at a time, and copies
``config.json`` (and ``generation_config.json``) from ``--config`` so that ``from_pretrained(OUTDIR)`` reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

from lightning_pipedream.runtime.stages.named_tensors import empty_targets, read_named, saved_entries
from lightning_pipedream.strategy.checkpoints.sharded_checkpoint import MODEL, consolidate, read_meta

HF_FILES = ("config.json", "generation_config.json")


def consolidate_to_file(directory: str, out: str) -> str:
    """Write the single-device checkpoint of sharded ``directory`` to ``out``; returns what was written."""
    checkpoint = consolidate(directory)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    torch.save(checkpoint, out)
    return f"{out}: {len(checkpoint['state_dict'])} tensors, {len(checkpoint.get('optimizer_states', []))} optimizer(s)"


def export_hf(directory: str, out: str, prefix: str = "", config: str | None = None,
              max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write the weights under ``prefix`` of sharded checkpoint ``directory`` to ``out`` in safetensors' layout
    (the prefix stripped from their names); returns the files written."""
    read_meta(directory)  # refuses what PipeDreamStrategy did not write
    entries = saved_entries(directory)
    names = [n for n in entries if n.startswith(MODEL + prefix) and entries[n] is not None]
    if not names:
        found = sorted({n[len(MODEL):].split(".", 1)[0] + "." for n in entries if n.startswith(MODEL)})
        raise ValueError(f"No weights in {directory} begin with {prefix!r}; its names begin with {found[:6]}. "
                         "Give --prefix the submodule that holds the Hugging Face model (e.g. --prefix model.).")
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise ValueError("export-hf writes safetensors files, and the safetensors package is not installed: pip "
                         "install safetensors") from err
    sizes = {n: torch.Size(entries[n][0]).numel() * torch.empty((), dtype=entries[n][1]).element_size()
             for n in names}
    groups: list[list[str]] = [[]]
    for name in names:  # in the checkpoint's order, a new file when this one would pass the limit
        if groups[-1] and sum(sizes[n] for n in groups[-1]) + sizes[name] > max_shard_bytes:
            groups.append([])
        groups[-1].append(name)
    os.makedirs(out, exist_ok=True)
    files, weight_map = [], {}
    for i, group in enumerate(groups):
        file = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = read_named(empty_targets(entries, group), directory, collective=False)  # this file's tensors only
        save_file({n[len(MODEL + prefix):]: t for n, t in tensors.items()}, os.path.join(out, file),
                  metadata={"format": "pt"})
        weight_map.update({n[len(MODEL + prefix):]: file for n in group})
        files.append(file)
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
        files.append("model.safetensors.index.json")
    files += _copy_config(config, out)
    return files


def _copy_config(config: str | None, out: str) -> list[str]:
    if config is None:
        print("note: no --config: from_pretrained needs the model's config.json beside the weights "
              "(e.g. --config the directory the pretrained model came from, or model.config.save_pretrained(OUTDIR)).",
              file=sys.stderr)
        return []
    if os.path.isfile(config):
        shutil.copyfile(config, os.path.join(out, "config.json"))
        return ["config.json"]
    copied = [name for name in HF_FILES if os.path.isfile(os.path.join(config, name))]
    if "config.json" not in copied:
        raise FileNotFoundError(f"--config {config} holds no config.json: give the config file, or the directory "
                                "from_pretrained read the model from.")
    for name in copied:
        shutil.copyfile(os.path.join(config, name), os.path.join(out, name))
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_pipedream checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("consolidate", help="a sharded checkpoint directory as one Lightning checkpoint file")
    one.add_argument("directory")
    one.add_argument("out")
    hf = sub.add_parser("export-hf", help="the weights as Hugging Face safetensors (from_pretrained reads them)")
    hf.add_argument("directory")
    hf.add_argument("out")
    hf.add_argument("--prefix", default="", help="the LightningModule's attribute holding the HF model, e.g. 'model.'")
    hf.add_argument("--config", help="config.json, or the directory holding it (copied beside the weights)")
    hf.add_argument("--max-shard-size", type=float, default=5.0, help="GiB per safetensors file (default 5)")
    args = parser.parse_args(argv)
    try:
        if args.command == "consolidate":
            print(consolidate_to_file(args.directory, args.out))
        else:
            files = export_hf(args.directory, args.out, args.prefix, args.config, int(args.max_shard_size * 2**30))
            print(f"{args.out}: {', '.join(files)}")
    except (OSError, ValueError, MemoryError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return 0
