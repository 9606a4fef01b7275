"""Greedy decoding through the pipeline's ring: tokens per second with one lane per stage (M = P) against one lane
(M = 1) and against one process decoding the whole model, on the same prompts, in one run; and the simulator's
prediction for the ring from the measured time of one decode step.

    python -m benchmarks.generation.ring [--stages 2] [--tokens 32] [--out benchmarks/results/generation.json]

A tiny Llama (Hugging Face ``LlamaForCausalLM`` built from a config: no download) on the CPU, one thread per
process, ranks over gloo with the pipeline's own transport (``kind="directional"``). Each rank caches its own
layers' keys and values per lane. The prediction: one process's decode step for a lane's sequences, split evenly
over the stages, on :func:`~lightning_pipedream.schedule.generation.simulate_ring` with free links (so the gap to it
is the cost of the messages and of the ranks sharing the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_pipedream.runtime.communication.transport import Transport
from lightning_pipedream.runtime.execution.decode import generate_ids
from lightning_pipedream.schedule.generation import ring_bubble, simulate_ring

ROOT = Path(__file__).resolve().parents[2]
BATCH, PROMPT, REPEATS = 8, 16, 3


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, pad_token_id=0,
                         eos_token_id=1, bos_token_id=2)
    return LlamaForCausalLM(config).eval()


def prompts() -> torch.Tensor:
    return torch.randint(3, 512, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))


def _call(net):
    def call(ids, mask, positions, cache, rows):
        return net(input_ids=ids, attention_mask=mask, position_ids=positions, **cache)
    return call


def decode(net, stage: int, stages: int, lanes: int, tokens: int, transport=None) -> torch.Tensor:
    # eos_token_id None: every sequence makes all its tokens (the same work in every configuration)
    return generate_ids(net, _call(net), prompts(), None, max_new_tokens=tokens, eos_token_id=None, pad_token_id=0,
                        micro_batches=lanes, stage=stage, num_stages=stages, transport=transport)


def _rank(rank: int, stages: int, tokens: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=stages)
    transport = Transport(kind="directional", reverse_group=dist.new_group(list(range(stages))))
    net = model()
    results = {}
    for lanes in (1, stages):
        decode(net, rank, stages, lanes, 4, transport)  # warm-up
        times = []
        for _ in range(REPEATS):
            dist.barrier()
            began = time.perf_counter()
            ids = decode(net, rank, stages, lanes, tokens, transport)
            times.append(time.perf_counter() - began)
        results[lanes] = {"seconds": statistics.median(times), "ids": ids.tolist()}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def step_seconds(net, lane_batch: int) -> float:
    """One process's time for one decode step of ``lane_batch`` sequences (median of a 16-token decode)."""
    ids = prompts()[:lane_batch]
    times = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        generate_ids(net, _call(net), ids, None, max_new_tokens=16, eos_token_id=None, pad_token_id=0, micro_batches=1)
        times.append((time.perf_counter() - began) / 16)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "generation.json"))
    args = parser.parse_args()
    p, t = args.stages, args.tokens
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    net = model()
    decode(net, 0, 1, 1, 4)  # warm-up
    one = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        want = decode(net, 0, 1, 1, t)
        one.append(time.perf_counter() - began)
    one_s = statistics.median(one)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ring.json")
        mp.spawn(_rank, args=(p, t, f"file://{tmp}/rendezvous", out), nprocs=p, join=True)
        ring = json.loads(Path(out).read_text())
    generated = BATCH * t
    rows = {"one process": {"seconds": one_s, "tokens_per_s": generated / one_s}}
    for lanes in (1, p):
        r = ring[str(lanes)]
        assert torch.equal(torch.tensor(r["ids"]), want), f"the ring with {lanes} lanes decoded other tokens"
        per_stage = step_seconds(net, BATCH // lanes) / p
        sim = simulate_ring(p, lanes, t, per_stage)
        rows[f"ring M={lanes}"] = {
            "seconds": r["seconds"], "tokens_per_s": generated / r["seconds"],
            "predicted_tokens_per_s": sim["steps_per_s"] * (BATCH // lanes),
            "predicted_bubble": sim["bubble_fraction"], "closed_form_bubble": ring_bubble(p, lanes, t),
            "stage_step_s": per_stage,
        }
    result = {"stages": p, "batch": BATCH, "prompt": PROMPT, "new_tokens": t, "model": "Llama 6x256 (HF, tiny)",
              "device": "cpu, 1 thread per process", "cpus": os.cpu_count(), "load_average": os.getloadavg(),
              "same_tokens_as_one_process": True, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, row in rows.items():
        pred = f"  predicted {row['predicted_tokens_per_s']:.0f}" if "predicted_tokens_per_s" in row else ""
        print(f"{name:12s} {row['tokens_per_s']:8.0f} tokens/s{pred}")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
