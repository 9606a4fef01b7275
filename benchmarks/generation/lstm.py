"""An LSTM decoder's step with its states carried against recomputing the prefix: one process decoding the
recipes' GNMT-8 greedily, the same tokens both ways, seconds per generated word.

    python -m benchmarks.generation.lstm [--tokens 32] [--out benchmarks/results/generation_lstm.json]

``recompute``: the recipes' ``greedy_decode`` (the whole prefix through the model at every step, as before).
``carried``: ``generate_ids`` (what ``lightning_pipedream.generate`` runs), which keeps each LSTM's (h, c) and the
encoder's outputs per lane and feeds one word per step. CPU, one thread, a randomly initialised model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from lightning_pipedream.runtime.execution.decode import generate_ids
from recipes.models import build_model
from recipes.tasks.seq2seq import greedy_decode

ROOT = Path(__file__).resolve().parents[2]
BATCH, SOURCE, HIDDEN, VOCAB, REPEATS, BOS = 8, 16, 256, 1000, 3, 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "generation_lstm.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = build_model("gnmt8", "translation", hidden_size=HIDDEN, dropout=0.0, src_vocab_size=VOCAB,
                         tgt_vocab_size=VOCAB).eval()
    src = torch.randint(4, VOCAB, (BATCH, SOURCE), generator=torch.Generator().manual_seed(1))
    prompt = torch.full((BATCH, 1), BOS)

    def recompute() -> torch.Tensor:  # eos -1: every sequence makes all its words (the same work both ways)
        return greedy_decode(layers, (src,), BOS, -1, max_len=args.tokens)

    def carried() -> torch.Tensor:
        def call(ids, mask, positions, cache, rows):
            return layers((src[rows], ids))
        return generate_ids(layers, call, prompt, None, max_new_tokens=args.tokens, eos_token_id=None,
                            pad_token_id=0, micro_batches=1, blocks=layers)[:, 1:]

    rows = {}
    with torch.no_grad():
        want = recompute()
        assert torch.equal(carried(), want), "carrying the LSTM states changed the words"
        for name, run in (("recompute", recompute), ("carried", carried)):
            times = []
            for _ in range(REPEATS):
                began = time.perf_counter()
                run()
                times.append(time.perf_counter() - began)
            rows[name] = {"seconds": statistics.median(times),
                          "seconds_per_word": statistics.median(times) / args.tokens}
    result = {"model": f"GNMT-8, hidden {HIDDEN}, vocabulary {VOCAB}", "batch": BATCH, "source": SOURCE,
              "new_words": args.tokens, "device": "cpu, 1 thread", "cpus": os.cpu_count(),
              "load_average": os.getloadavg(), "same_words": True, "rows": rows,
              "speedup": rows["recompute"]["seconds"] / rows["carried"]["seconds"]}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, row in rows.items():
        print(f"{name:10s} {1000 * row['seconds_per_word']:7.2f} ms per word")
    print(f"speedup {result['speedup']:.2f}x -> {args.out}")


if __name__ == "__main__":
    main()
