"""Replicated stages (the planner's hybrid plan) against a straight pipeline and DDP under Lightning, VGG-like model.

Run from the repository root (``-m`` only, as ``benchmarks.speed.lightning``)::

    python -m benchmarks.paper.replication --four                          # 5 rounds, ~30 min: results/replication.json
    python -m benchmarks.paper.replication --quick --json /tmp/repl.json  # smoke run: small model, 3 processes, ~10 s
    python -m benchmarks.paper.replication --plot docs/img/replication.png  # the plot, from the JSON

The model is one ``nn.Sequential``: a convolutional feature block (as torchvision's VGG groups its
``features``: few parameters, most of the compute), then a wide classifier (``Linear``/``ReLU`` children:
most of the parameters). It is profiled with ``profile_module`` on one micro-batch and planned with the
PipeDream partitioner for 2, 3 and 4 processes, with replication and without (``straight=True``).

Every contender trains on the same samples in the same order with one update per batch of ``batch``
samples (SGD, cross-entropy, synthetic images and labels), ``OMP_NUM_THREADS=1`` and
``torch.set_num_threads(1)`` in every process:

* ``one_device``: ``Trainer(devices=1)``, the whole batch;
* ``hybrid3``: ``PipeDreamStrategy(schedule="1f1b", plan=<the planner's replicated plan for 3>)`` (1F1B-RR);
* ``straight3``: the same schedule with the planner's straight 3-stage plan;
* ``ddp3``: ``Trainer(devices=3, strategy="ddp")``, ``batch / 3`` per process;
* ``straight2`` and ``ddp2``: the same on 2 processes (the planner's choice on 2 is one of them);
* with ``--four``, ``hybrid4``, ``straight4`` and ``ddp4`` on 4 processes.

The pipelines' micro-batches all have ``micro`` samples, the profiled size (a replicated first stage
takes ``batch / replicas`` samples per shard, cut into ``chunks``). Each run is timed from
``on_train_batch_end`` of the last warm-up step to that of the last step (earliest rank to latest rank);
contenders run in interleaved rounds (order rotated each round), each run in fresh processes after a short
wait for other processes to calm down (``benchmarks.common.workload.wait_for_quiet``), with ``os.getloadavg()``
before and after and the cores other processes used during the run (``LoadMeter``); figures are medians
over rounds, and the JSON says in how many rounds the order within the round was the planner's. After each run
every parameter is compared with plain one-process training on the same batches (all of these contenders
compute the same update): a run that trained something else is flagged (``weights_agree`` false, DIFFER).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common.worker_process import run_worker
from benchmarks.common.workload import LoadMeter, wait_for_quiet

ROOT = Path(__file__).resolve().parents[2]
# the contenders compared with each other, per process count (4: only with --four)
GROUPS = {3: ("hybrid3", "straight3", "ddp3"), 2: ("straight2", "ddp2"), 4: ("hybrid4", "straight4", "ddp4")}
CONTENDERS = ("one_device",) + GROUPS[3] + GROUPS[2]
PROCESSES = {"one_device": 1} | {name: n for n, group in GROUPS.items() for name in group}
TOLERANCE = 1e-5  # max |difference| of any parameter from one-process training


@dataclass(frozen=True)
class Config:
    channels: int = 32  # the feature block: conv 3->c, c->c at full size, pool, conv c->2c, pool
    image: int = 32
    hidden: int = 512  # the classifier: Linear(2c * (image/4)^2, hidden), Linear(hidden, hidden), Linear(hidden, 10)
    classes: int = 10
    micro: int = 8  # samples per micro-batch (pipelines) and per profiled minibatch (planner)
    batch: int = 48  # samples per update, every contender
    lr: float = 0.01
    bandwidth: float = 1e9  # bytes/s between processes, the planner's topology
    seed: int = 0


def build_model(cfg: Config):
    """The VGG-like Sequential: children 0 (the convolutional features), 1 (Flatten), 2-6 (the classifier)."""
    import torch
    from torch import nn

    torch.manual_seed(cfg.seed)
    c = cfg.channels
    features = nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    )
    flat = 2 * c * (cfg.image // 4) ** 2
    return nn.Sequential(
        features, nn.Flatten(),
        nn.Linear(flat, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, cfg.hidden), nn.ReLU(),
        nn.Linear(cfg.hidden, cfg.classes),
    )


def make_data(cfg: Config, batches: int):
    """``batches`` batches of synthetic images and labels, generated locally from a fixed seed."""
    import torch

    g = torch.Generator().manual_seed(1)
    n = batches * cfg.batch
    return (torch.randn(n, 3, cfg.image, cfg.image, generator=g),
            torch.randint(0, cfg.classes, (n,), generator=g))


def reference_weights(cfg: Config, batches: int) -> dict:
    """Plain one-process SGD on the same batches, without Lightning: what every contender must end with."""
    import torch
    from torch import nn

    model = build_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    x, y = make_data(cfg, batches)
    for b in range(batches):
        rows = slice(b * cfg.batch, (b + 1) * cfg.batch)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
    return {f"layers.{k}": v.detach().clone() for k, v in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# Planning


def plan_all(cfg: Config, plan_dir: Path, workers=(2, 3, 4), repeats: int = 5) -> dict:
    """Profile one micro-batch, plan with and without replication for each process count, save the plans."""
    import torch

    from lightning_pipedream.plan import Topology, partition, profile_module

    torch.set_num_threads(1)
    model = build_model(cfg)
    x, _ = make_data(cfg, 1)
    profile = profile_module(model, x[: cfg.micro], repeats=repeats)
    plans: dict = {"profile": [{"name": l.name, "forward_ms": l.forward_s * 1e3, "backward_ms": l.backward_s * 1e3,
                                "activation_bytes": l.activation_bytes, "parameter_bytes": l.parameter_bytes}
                               for l in profile.layers]}
    for n in workers:
        topology = Topology.flat(n, cfg.bandwidth)
        entry = {}
        for kind, straight in (("replicated", False), ("straight", True)):
            plan = partition(profile, topology, "pipedream", straight=straight)
            plan.save(plan_dir / f"{kind}{n}.json")
            entry[kind] = {"configuration": "-".join(str(s.replicas) for s in plan.stages),
                           "balance": plan.balance, "time_per_minibatch_s": plan.time_per_minibatch,
                           "parameter_bytes": [s.parameter_bytes for s in plan.stages]}
            entry["data_parallel_time_per_minibatch_s"] = plan.data_parallel_time
            entry["one_worker_time_per_minibatch_s"] = plan.one_worker_time
        entry["planner_choice"] = _choice(entry)
        plans[str(n)] = entry
    profile.save(plan_dir / "profile.json")
    return plans


def _choice(entry: dict) -> str:
    """What the replicated planner chose, in words: data parallelism, a straight pipeline or a hybrid."""
    config = entry["replicated"]["configuration"].split("-")
    if len(config) == 1:
        return "data_parallel"
    return "straight" if all(r == "1" for r in config) else "hybrid"


def runnable_hybrid(entry: dict) -> bool:
    """A replicated plan PipeDreamStrategy runs under 1f1b: some stage replicated, the last one not."""
    config = entry["replicated"]["configuration"].split("-")
    return entry["planner_choice"] == "hybrid" and config[-1] == "1"


def fallback_hybrid(plan_dir: Path) -> None:
    """The 2-1 plan by hand (features on two replicas, the classifier on one), for a smoke run only."""
    from lightning_pipedream.plan import Plan

    stages = [{"layers": ["0", "1"], "replicas": 2}, {"layers": ["2", "3", "4", "5", "6"], "replicas": 1}]
    Plan.from_json({"stages": stages}).save(plan_dir / "replicated3.json")


def fallback_straight(plan_dir: Path) -> None:
    """A straight 3-stage plan by hand (features, first Linear, the rest), for a smoke run only."""
    from lightning_pipedream.plan import Plan

    stages = [{"layers": ["0", "1"]}, {"layers": ["2", "3"]}, {"layers": ["4", "5", "6"]}]
    Plan.from_json({"stages": stages}).save(plan_dir / "straight3.json")


def predictions(plans: dict, cfg: Config, plan_dir: Path) -> dict:
    """Two predictions per contender, both from the profile of one micro-batch:

    * the planner's time per minibatch (``micro`` samples; PipeDream's asynchronous steady state, an all-reduce
      per minibatch), as samples/s;
    * the schedule simulator's seconds per step of the run as benchmarked: 1F1B(-RR) with a flush every
      ``batch`` samples (DDP: one stage on n replicas, one all-reduce per batch), as samples/s.
    """
    from lightning_pipedream.plan import Plan, Profile

    profile = Profile.load(plan_dir / "profile.json")
    out = {}
    kinds = {"hybrid": "replicated", "straight": "straight", "ddp": None}
    for n, group in GROUPS.items():
        entry = plans[str(n)]
        for name in group:
            kind = kinds[name.rstrip("0123456789")]
            t = entry[kind]["time_per_minibatch_s"] if kind else entry["data_parallel_time_per_minibatch_s"]
            if kind:
                plan = Plan.load(plan_dir / f"{kind}{n}.json")
                stages = [[profile.names.index(x) for x in st.layers] for st in plan.stages]
                replicas = [st.replicas for st in plan.stages]
            else:
                stages, replicas = [list(range(len(profile.layers)))], [n]
            step = simulated_step(profile, stages, replicas, cfg)
            out[name] = {"time_per_minibatch_s": t, "samples_per_s": cfg.micro / t,
                         "simulated_seconds_per_step": step, "simulated_samples_per_s": cfg.batch / step}
    one = plans["3"]["one_worker_time_per_minibatch_s"]
    step = one * cfg.batch / cfg.micro
    out["one_device"] = {"time_per_minibatch_s": one, "samples_per_s": cfg.micro / one,
                         "simulated_seconds_per_step": step, "simulated_samples_per_s": cfg.batch / step}
    return out


def simulated_step(profile, stages: list[list[int]], replicas: list[int], cfg: Config) -> float:
    """The schedule simulator's step: 1F1B(-RR) over ``batch`` samples in micro-batches of ``micro``."""
    from lightning_pipedream.schedule.builders import build_schedule
    from lightning_pipedream.schedule.simulate import simulate

    layers = profile.layers
    chunks = cfg.batch // (replicas[0] * cfg.micro)  # micro-batches per replica of the first stage (per shard)
    result = simulate(
        build_schedule("1f1b", len(stages), chunks, replicas=replicas if max(replicas) > 1 else None),
        [sum(layers[i].forward_s for i in st) for st in stages],
        [sum(layers[i].backward_s for i in st) for st in stages],
        activation_bytes=[layers[st[-1]].activation_bytes for st in stages],
        parameter_bytes=[sum(layers[i].parameter_bytes for i in st) for st in stages],
        bandwidth=cfg.bandwidth,
    )
    return result.step_time


# ---------------------------------------------------------------------------------------------
# The worker: each Lightning run in processes of its own (Lightning starts the other ranks by re-running
# this module with the same arguments).


def _strategy(name: str, cfg: Config, plan_dir: Path):
    """(devices, strategy, samples per process and batch) of a contender."""
    from lightning_pipedream import PipeDreamStrategy
    from lightning_pipedream.plan import Plan

    n = PROCESSES[name]
    if name == "one_device":
        return 1, "auto", cfg.batch
    if name.startswith("ddp"):
        return n, "ddp", cfg.batch // n
    path = plan_dir / f"{'replicated' if name.startswith('hybrid') else 'straight'}{n}.json"
    shards = Plan.load(path).stages[0].replicas  # 1F1B-RR cuts the batch into one shard per first-stage replica
    chunks, rest = divmod(cfg.batch, shards * cfg.micro)  # so that every micro-batch has `micro` samples
    if rest or not chunks:
        raise ValueError(f"{name}: a batch of {cfg.batch} does not split into {shards} shards of micro-batches of "
                         f"{cfg.micro}; change Config.batch")
    return n, PipeDreamStrategy(schedule="1f1b", chunks=chunks, plan=str(path)), cfg.batch


def _worker(spec: dict) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.set_num_threads(1)
    cfg = Config(**spec["cfg"])
    batches = spec["warmup"] + spec["steps"]

    class VGGLike(L.LightningModule):
        def __init__(self, per_process: int) -> None:
            super().__init__()
            self.layers = build_model(cfg)
            self.updates, self.per_process = 0, per_process

        def forward(self, x):
            return self.layers(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.log("train_loss", loss)
            return loss

        def train_dataloader(self):
            # Lightning's own sampler shuffles under every multi-process strategy; an unshuffled one with the
            # strategy's replica count (DDP: 3 shards, a pipeline: 1) keeps every contender on the same batches.
            shards = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None)
            sampler = DistributedSampler(data, shuffle=False, **shards) if shards else None
            return DataLoader(data, batch_size=self.per_process, shuffle=False, sampler=sampler)

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=cfg.lr)
            opt.register_step_post_hook(lambda *_: setattr(self, "updates", self.updates + 1))
            return opt

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())

    data = TensorDataset(*make_data(cfg, batches))
    # Several contenders may share the processes (--quick): later Trainers reuse the ranks and process group.
    for name in spec["names"]:
        out = Path(spec["out"]) / name
        out.mkdir(parents=True, exist_ok=True)
        devices, strategy, per_process = _strategy(name, cfg, Path(spec["plans"]))
        timer, model = Timer(), VGGLike(per_process)
        trainer = L.Trainer(
            accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[timer], num_sanity_val_steps=0, use_distributed_sampler=False,
        )
        trainer.fit(model)
        rank = trainer.global_rank
        # only this rank's parameters: a pipeline stage holds its own layers, placeholders hold none
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / f"params{rank}.pt")
        usage = resource.getrusage(resource.RUSAGE_SELF)
        result = {"rank": rank, "ends": timer.ends, "updates": model.updates, "threads": torch.get_num_threads(),
                  "per_process_batch": per_process, "cpu_s": usage.ru_utime + usage.ru_stime}
        (out / f"rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# The parent: runs contenders in fresh processes, checks their weights and summarises.


def run_many(names: list[str], spec: dict, reference: dict, timeout: float) -> dict[str, dict]:
    """Run ``names`` one after the other in the same processes (all need the same process count)."""
    with tempfile.TemporaryDirectory(prefix="bench_replication_") as tmp:
        spec = dict(spec, names=names, out=tmp)
        proc = run_worker("benchmarks.paper.replication", spec, tmp, timeout)
        if proc.returncode != 0:  # the first rank's error, not only the peers' "connection closed" after it
            errors = [line for line in proc.stderr.splitlines() if "Error" in line and "closed by peer" not in line]
            raise RuntimeError(f"{names} failed (rc {proc.returncode}): {errors[:3]}\n{proc.stderr[-3000:]}")
        return {n: collect(Path(tmp) / n, spec["warmup"], spec["steps"], reference) for n in names}


def collect(out: Path, warmup: int, steps: int, reference: dict) -> dict:
    """A run's seconds per step (earliest rank's start to latest rank's end), its weights' distance to the reference."""
    import torch

    ranks = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    t0 = min(r["ends"][warmup - 1] for r in ranks)
    t1 = max(r["ends"][-1] for r in ranks)
    held: dict[str, list] = {}
    for r in ranks:
        for k, v in torch.load(out / f"params{r['rank']}.pt").items():
            held.setdefault(k, []).append(v)
    missing = sorted(set(reference) - set(held))
    # replicas (of a stage, or DDP's) must agree with each other and with one-process training
    diffs = {k: max(float((v - reference[k]).abs().max()) for v in vs) for k, vs in held.items()}
    worst = max(diffs, key=diffs.get) if diffs else None
    diff = diffs[worst] if worst is not None else float("inf")
    return {
        "seconds_per_step": (t1 - t0) / steps,
        "timed_steps": steps,
        "updates_per_rank": [r["updates"] for r in ranks],
        "batches_per_rank": [len(r["ends"]) for r in ranks],
        "per_process_batch": ranks[0]["per_process_batch"],
        "threads": [r["threads"] for r in ranks],
        # Lightning's launcher does not wait for ranks 1.., so their CPU is not in the parent's children's usage
        "unwaited_cpu_s": sum(r["cpu_s"] for r in ranks if r["rank"] > 0),
        "max_abs_diff_vs_one_process": diff if not missing else None,
        "worst_parameter": worst,
        "weights_agree": not missing and diff <= TOLERANCE,
    }


def _inf_if_none(value: float | None) -> float:
    return float("inf") if value is None else value


def summarize(runs: dict[str, list[dict]], cfg: Config, predicted: dict) -> dict:
    out: dict[str, dict] = {}
    for name, rs in runs.items():
        sps = [r["seconds_per_step"] for r in rs]
        med = statistics.median(sps)
        out[name] = {
            "processes": PROCESSES[name],
            "seconds_per_step": med,
            "runs": sps,
            "samples_per_s": cfg.batch / med,
            "samples_per_step": cfg.batch,
            "per_process_batch": rs[0]["per_process_batch"],
            "updates_per_rank": rs[0]["updates_per_rank"],
            "max_abs_diff_vs_one_process": max(_inf_if_none(r["max_abs_diff_vs_one_process"]) for r in rs),
            "worst_parameter": rs[0]["worst_parameter"],
            "weights_agree": all(r["weights_agree"] for r in rs),
            "loadavg_1m": [[r["loadavg_before"][0], r["loadavg_after"][0]] for r in rs],
            "foreign_cores": [r.get("foreign_cores") for r in rs],
            "predicted_samples_per_s": predicted.get(name, {}).get("samples_per_s"),
            "simulated_samples_per_s": predicted.get(name, {}).get("simulated_samples_per_s"),
        }
    if "one_device" in out:
        for c in out.values():
            c["speedup_vs_one_device"] = out["one_device"]["seconds_per_step"] / c["seconds_per_step"]
    return out


def rankings(contenders: dict, predicted: dict, runs: dict[str, list[dict]]) -> dict:
    """Fastest first, measured (medians) and predicted, per process count; whether they agree; and in how many
    rounds the order measured within the round equals the planner's."""
    result = {}
    for n, group in GROUPS.items():
        names = [g for g in group if g in contenders]
        if len(names) < 2:
            continue
        measured = sorted(names, key=lambda g: -contenders[g]["samples_per_s"])
        planned = sorted(names, key=lambda g: -predicted[g]["samples_per_s"])
        simulated = sorted(names, key=lambda g: -predicted[g]["simulated_samples_per_s"])
        rounds = min(len(runs[g]) for g in names)
        per_round = [sorted(names, key=lambda g: runs[g][r]["seconds_per_step"]) for r in range(rounds)]
        result[str(n)] = {"measured": measured, "predicted": planned, "agree": measured == planned,
                          "best_agrees": measured[0] == planned[0],
                          "simulated": simulated, "simulated_agrees": measured == simulated,
                          "rounds_agreeing_with_planner": sum(order == planned for order in per_round),
                          "rounds": rounds}
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/replication.json")
    parser.add_argument("--quick", action="store_true",
                        help="small model, 1 warm-up and 1 timed step, the 3-process contenders in shared processes")
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (quick: 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed batches per run (default 8; quick 1)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up batches per run, >= 1 (default 2; quick 1)")
    parser.add_argument("--only", default="", help="comma-separated contenders (default all)")
    parser.add_argument("--four", action="store_true", help="also the 4-process contenders (hybrid4, straight4, ddp4)")
    parser.add_argument("--max-wait", type=float, default=None,
                        help="before each run, wait up to this many seconds for other processes to calm down "
                        "(default 20; quick 0)")
    parser.add_argument("--wait-budget", type=float, default=600.0, help="total seconds of such waits")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--plot", type=Path, default=None, help="only draw --json's results into this PNG")
    args = parser.parse_args(argv)
    if args.plot:
        plot(json.loads((args.json or Path("benchmarks/results/replication.json")).read_text()), args.plot)
        return {}
    if args.worker:
        _worker(json.loads(args.worker))
        return {}

    import torch

    torch.set_num_threads(1)  # the parent profiles and computes the reference on one thread, as the workers run
    # a smoke run: a small model (its plan may be a fallback) and only the 3-process contenders, in shared processes
    cfg = Config(channels=8, image=16, hidden=128, micro=2, batch=12) if args.quick else Config()
    rounds = args.rounds or (1 if args.quick else 5)
    steps = args.steps or (1 if args.quick else 8)
    warmup = args.warmup or (1 if args.quick else 2)
    everyone = GROUPS[3] if args.quick else CONTENDERS + (GROUPS[4] if args.four else ())
    names = [n for n in everyone if not args.only or n in args.only.split(",")]
    max_wait = args.max_wait if args.max_wait is not None else (0.0 if args.quick else 20.0)
    json_path = args.json or Path("benchmarks/results/replication.json")

    started = time.time()
    load0 = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="replication_plans_") as plan_dir:
        plans = plan_all(cfg, Path(plan_dir), repeats=3 if args.quick else 5)
        for n in ("2", "3", "4"):
            e = plans[n]
            print(f"{n} processes: replicated {e['replicated']['configuration']} {e['replicated']['balance']} "
                  f"{e['replicated']['time_per_minibatch_s'] * 1e3:.2f} ms, straight "
                  f"{e['straight']['time_per_minibatch_s'] * 1e3:.2f} ms, data parallel "
                  f"{e['data_parallel_time_per_minibatch_s'] * 1e3:.2f} ms per minibatch of {cfg.micro}", flush=True)
        if "hybrid3" in names and not runnable_hybrid(plans["3"]):
            if not args.quick:
                raise SystemExit(f"the planner chose {plans['3']['replicated']['configuration']} on 3 processes, not a "
                                 "hybrid with one replica on the last stage: nothing to compare (rerun when quieter)")
            fallback_hybrid(Path(plan_dir))  # a smoke run still exercises the 2-1 path on a noisy profile
            plans["3"]["hybrid_run"] = "fallback 2-1 after the features (the planner chose otherwise)"
        if "hybrid4" in names and not runnable_hybrid(plans["4"]):
            names.remove("hybrid4")
            plans["4"]["hybrid_run"] = "not run: the planner chose no hybrid with one replica on the last stage"
        for n in (3, 4):
            stages = plans[str(n)]["straight"]["parameter_bytes"]
            if args.quick and n == 3 and not all(stages):  # a smoke run still runs a straight pipeline
                fallback_straight(Path(plan_dir))
                plans["3"]["straight_run"] = "fallback [2, 2, 3] (the planner's has a stage without parameters)"
            elif f"straight{n}" in names and not all(stages):
                # the planner may end a stage on a ReLU alone; PipeDreamStrategy needs parameters on every stage
                names.remove(f"straight{n}")
                plans[str(n)]["straight_run"] = f"not run: a stage without parameters ({stages} bytes per stage)"
                print(f"straight{n}: {plans[str(n)]['straight_run']}", flush=True)
        predicted = predictions(plans, cfg, Path(plan_dir))
        reference = reference_weights(cfg, warmup + steps)
        spec = {"cfg": asdict(cfg), "plans": plan_dir, "warmup": warmup, "steps": steps}
        runs: dict[str, list[dict]] = {n: [] for n in names}
        waited = 0.0
        if args.quick:  # a smoke run: the contenders with the same process count share their processes
            before, done = os.getloadavg(), {}
            for p in sorted({PROCESSES[n] for n in names}):
                done |= run_many([n for n in names if PROCESSES[n] == p], spec, reference, args.timeout)
            for n in names:
                done[n]["loadavg_before"], done[n]["loadavg_after"] = before, os.getloadavg()
                runs[n].append(done[n])
        else:
            for rnd in range(rounds):
                for name in names[rnd % len(names):] + names[: rnd % len(names)]:
                    # other engineers' tests come in bursts: wait a little for a quieter moment, within a budget
                    waited += wait_for_quiet(min(max_wait, max(0.0, args.wait_budget - waited)))
                    before = os.getloadavg()
                    with LoadMeter() as meter:
                        run = run_many([name], spec, reference, args.timeout)[name]
                    run["loadavg_before"], run["loadavg_after"] = before, os.getloadavg()
                    # CPU other processes used during the run (LoadMeter counts our unwaited ranks as others)
                    run["foreign_cores"] = max(0.0, meter.foreign_cores - run["unwaited_cpu_s"] / meter.wall)
                    runs[name].append(run)
                    print(f"round {rnd + 1}/{rounds} {name:10s} {run['seconds_per_step']:.4f} s/step, weights "
                          f"{'agree' if run['weights_agree'] else 'DIFFER'} "
                          f"({run['max_abs_diff_vs_one_process']:.1e}); load {before[0]:.2f} -> "
                          f"{run['loadavg_after'][0]:.2f}, others used {meter.foreign_cores:.2f} cores", flush=True)
    contenders = summarize(runs, cfg, predicted)
    loads = [x for rs in runs.values() for r in rs for x in (r["loadavg_before"][0], r["loadavg_after"][0])]
    doc = {
        "config": {**asdict(cfg), "threads_per_process": 1, "rounds": 1 if args.quick else rounds,
                   "warmup_batches": warmup, "timed_batches": steps, "quick": args.quick,
                   "shared_processes": args.quick},
        "machine": {"cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                    "loadavg_1m_during": {"median": statistics.median(loads), "min": min(loads), "max": max(loads)}},
        "plans": plans,
        "predicted": predicted,
        "contenders": contenders,
        "ranking": rankings(contenders, predicted, runs),
        "seconds": time.time() - started,
        "seconds_waiting_for_quiet": waited,
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=1))
    _print_table(doc)
    return doc


def _print_table(doc: dict) -> None:
    c = doc["contenders"]
    print("| contender | processes | s/step (median) | samples/s | planner's samples/s | simulated samples/s | "
          "vs one device | weights |")
    print("|---|---|---|---|---|---|---|---|")
    for name in CONTENDERS + GROUPS[4]:
        if name in c:
            r = c[name]
            speedup = r.get("speedup_vs_one_device", float("nan"))
            print(f"| {name} | {r['processes']} | {r['seconds_per_step']:.4f} | {r['samples_per_s']:.0f} | "
                  f"{r['predicted_samples_per_s']:.0f} | {r['simulated_samples_per_s']:.0f} | {speedup:.2f} | "
                  f"{'agree' if r['weights_agree'] else 'DIFFER'} ({r['max_abs_diff_vs_one_process']:.1e}) |")
    for n, rk in doc["ranking"].items():
        print(f"{n} processes: the planner's order in {rk['rounds_agreeing_with_planner']} of {rk['rounds']} rounds; "
              f"measured {' > '.join(rk['measured'])}; planner {' > '.join(rk['predicted'])} "
              f"({'agree' if rk['agree'] else 'disagree'}); simulator {' > '.join(rk['simulated'])} "
              f"({'agree' if rk['simulated_agrees'] else 'disagree'})")
    m = doc["machine"]["loadavg_1m_during"]
    print(f"load average (1 min) during the runs: median {m['median']:.2f}, {m['min']:.2f} - {m['max']:.2f}")


def plot(doc: dict, path: Path) -> None:
    """Measured samples per second per contender (bars: median, dots: rounds) beside the planner's prediction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = doc["contenders"]
    order = [n for n in CONTENDERS + GROUPS[4] if n in c]
    batch = doc["config"]["batch"]
    fig, ax = plt.subplots(figsize=(8, 4))
    colors = {"one": "tab:gray", "ddp": "tab:red", "hybrid": "tab:blue", "straight": "tab:green"}
    ax.bar(range(len(order)), [c[n]["samples_per_s"] for n in order],
           color=[colors[n.rstrip("0123456789").removesuffix("_device")] for n in order], alpha=0.8,
           label="measured (median)")
    for i, n in enumerate(order):
        ax.scatter([i] * len(c[n]["runs"]), [batch / r for r in c[n]["runs"]], color="k", s=8, zorder=3)
    ax.scatter(range(len(order)), [c[n]["predicted_samples_per_s"] for n in order], marker="_", s=400,
               color="tab:orange", zorder=4, label="planner's prediction (per minibatch, asynchronous)")
    ax.scatter(range(len(order)), [c[n]["simulated_samples_per_s"] for n in order], marker="x", s=40,
               color="tab:purple", zorder=4, label="schedule simulator (flush per batch)")
    ax.set_xticks(range(len(order)), [f"{n}\n({c[n]['processes']} proc.)" for n in order])
    ax.set_ylabel("samples / s")
    load = doc["machine"]["loadavg_1m_during"]
    ax.set_title(f"VGG-like model under Lightning, 1 thread per process; load average {load['min']:.1f}-"
                 f"{load['max']:.1f} on {doc['machine']['cpus']} CPUs", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
