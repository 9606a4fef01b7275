"""Seeded kills under torchrun with restarts: does every run come back, end equal to a run nobody killed, lose no
more than the steps since its last complete checkpoint, and how long does the way back take?

``python -m benchmarks.faults.kills [--kills 20] [--seed 0] [--quick]`` (or ``python -m benchmarks.faults``): each
kill is one torchrun job of 4 processes (``--nproc-per-node 4 --max-restarts 1``, the static rendezvous or the c10d
one, drawn) training an 11-layer MLP split [3, 3, 3, 2] for 30 steps (1f1b or pipedream, drawn; one-file or sharded
checkpoints, drawn; ``ModelCheckpoint(every_n_train_steps=8, save_last=True)``, ``fit(ckpt_path="last")``, a torchdata
``StatefulDataLoader`` over 15 batches an epoch). One rank, drawn, is SIGKILLed at a drawn step: after the step,
in the middle of a point-to-point transfer, or in the middle of a checkpoint save (the kills are
lightning_pipedream.testing.faults'). torchrun restarts the 4 processes, which resume from ``last.ckpt``.

Per kill: whether the job finished (exit code 0, step 30 reached); whether its final weights, optimizer state and
global step are ``torch.equal`` to the uninterrupted run's (same schedule; one job runs both references); the steps
trained again (the step the kill interrupted minus the step the restart resumed at) against the steps since the
last complete checkpoint; and the way back, from the kill to the end of the first resumed step, split at the
moments the slowest rank reached them: **detection** (the kill until torchrun started the new processes: the agent
sees a process die, stops the others and starts all again), **start-up** (Python, torch and Lightning imported, the
Trainer built), **rendezvous** (the strategy's process group joined by every rank), **loading** (the stage built,
planned and the checkpoint read), **first step**. JSON to benchmarks/results/faults.json.

The worker side (``--worker OUT JSON``) is what torchrun runs.
"""

from __future__ import annotations

import time

STARTED = time.time()  # this process's start, before torch is imported: the restart's start-up begins here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "benchmarks" / "results" / "faults.json"
STEPS, EVERY, BATCHES = 30, 8, 15  # steps of a run, a checkpoint every EVERY steps, batches an epoch
PROCESSES = 4
JOB_LIMIT = 900.0  # seconds one torchrun job may take in all before it is called hung (a slow hour's several times)
SCHEDULES = ("1f1b", "pipedream")
# The split, fixed: left to the planner, each start profiles the layers and may split them otherwise, which changes
# an asynchronous schedule's staleness (pipedream's result) though never a flushed schedule's.
BALANCE = [3, 3, 3, 2]


# -- the worker: one rank of a torchrun job -------------------------------------------------------------------------
def _event(out: str, name: str, rank: int) -> None:
    """This attempt's rank ``rank`` reached ``name`` now (one JSON file per rank and attempt)."""
    path = os.path.join(out, f"timeline_rank{rank}_attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.json")
    events = json.loads(open(path).read()) if os.path.exists(path) else {"started": STARTED}
    events.setdefault(name, time.time())
    with open(path, "w") as f:
        json.dump(events, f)


def worker(out: str, options: dict[str, Any]) -> None:
    """One rank of a run: trains, with its kill armed (``options["kill"]``), and writes its end state."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import RandomSampler, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_pipedream import PipeDreamStrategy
    from lightning_pipedream.testing import faults

    os.makedirs(out, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            blocks = [m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())]
            self.layers = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), *blocks, nn.Linear(32, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

        def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
            return nn.functional.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:  # momentum: optimizer state that a resume must restore
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class Kill(faults.Kill, L.Callback):
        pass

    class TimedStrategy(PipeDreamStrategy):
        def setup_distributed(self) -> None:
            _event(out, "rendezvous_begin", rank)
            super().setup_distributed()
            _event(out, "rendezvous_end", rank)

    class Record(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            _event(out, "train_start", rank)
            with open(os.path.join(out, f"attempts_rank{rank}.txt"), "a") as f:
                f.write(f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} {trainer.global_step}\n")

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            _event(out, "first_step_end", rank)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            optimizer = trainer.optimizers[0]
            raw = getattr(optimizer, "_optimizer", optimizer)
            torch.save({"weights": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                        "optimizer": {name: {k: v.clone() if isinstance(v, torch.Tensor) else v
                                             for k, v in raw.state[p].items()}
                                      for name, p in pl_module.named_parameters() if p in raw.state},
                        "global_step": trainer.global_step}, os.path.join(out, f"final_rank{rank}.pt"))

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(BATCHES * 4, 8, generator=g)
    dataset = TensorDataset(x, x[:, :4].argmax(-1))
    loader = StatefulDataLoader(dataset, batch_size=4, sampler=RandomSampler(dataset))
    callbacks: list[L.Callback] = [
        L.pytorch.callbacks.ModelCheckpoint(dirpath=os.path.join(out, "checkpoints"), save_last=True,
                                            every_n_train_steps=EVERY), Record()]
    if options.get("kill"):
        callbacks.append(Kill(out, **options["kill"]))
    schedule = options["schedule"]
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", PROCESSES)),
                        max_steps=STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, strategy=TimedStrategy(
                            schedule=schedule, chunks=1 if schedule == "pipedream" else 2, balance=BALANCE,
                            checkpoint=options.get("checkpoint", "full")))
    trainer.fit(Model(), loader, ckpt_path="last")


# -- the driver ------------------------------------------------------------------------------------------------------
def draw(seed: int, count: int) -> list[dict[str, Any]]:
    """``count`` kills, drawn from ``seed``: rank, step, when (after a step, in a transfer, in a save), schedule,
    checkpoint form, rendezvous. A third of them in a save (at a save's step), a third in a transfer."""
    rng = random.Random(seed)
    kills = []
    for i in range(count):
        during = ("step", "transfer", "save")[i % 3]
        step = rng.choice(range(EVERY, STEPS, EVERY)) if during == "save" else rng.randint(2, STEPS - 3)
        rank, schedule, form = rng.randrange(PROCESSES), rng.choice(SCHEDULES), rng.choice(("full", "sharded"))
        if during == "save" and form == "full":
            rank = 0  # one file: rank 0 alone writes it
        kills.append({"kill": {"rank": rank, "step": step, "during": during}, "schedule": schedule,
                      "checkpoint": form, "rendezvous": rng.choice(("static", "c10d"))})
    return kills


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(out: Path, args: list[str], rendezvous: str, max_restarts: int) -> tuple[int | None, str]:
    """One torchrun job of PROCESSES processes running this module's worker; its exit code (None: hung, killed) and
    stderr."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1", LIGHTNING_PIPEDREAM_FLIGHT_RECORDER=str(out / "flight"))
    where = (["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=job-{port}"]
             if rendezvous == "c10d" else ["--master-addr=127.0.0.1", f"--master-port={port}"])
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={PROCESSES}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1", *where, "-m", "benchmarks.faults.kills",
            "--worker", *args]
    log = out / "torchrun.txt"
    with log.open("w") as err:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=JOB_LIMIT)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything left of the job (a hung rank)
            except ProcessLookupError:
                pass
            proc.wait()
    return code, log.read_text()


def final_state(out: Path) -> dict[str, Any] | None:
    """The run's end state, every rank's merged by name (weights, optimizer state, global step), or None."""
    import torch

    files = sorted(out.glob("final_rank*.pt"))
    if len(files) != PROCESSES:
        return None
    merged: dict[str, Any] = {"weights": {}, "optimizer": {}, "global_step": set()}
    for path in files:
        state = torch.load(path)
        merged["weights"].update(state["weights"])
        merged["optimizer"].update(state["optimizer"])
        merged["global_step"].add(state["global_step"])
    return merged


def equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Weights, optimizer state and global step, bit for bit."""
    import torch

    if a["global_step"] != b["global_step"] or a["weights"].keys() != b["weights"].keys() \
            or a["optimizer"].keys() != b["optimizer"].keys():
        return False
    return all(torch.equal(a["weights"][k], v) for k, v in b["weights"].items()) and all(
        torch.equal(torch.as_tensor(a["optimizer"][n][k]), torch.as_tensor(v))
        for n, state in b["optimizer"].items() for k, v in state.items())


def timeline(out: Path, killed_at: float) -> dict[str, float] | None:
    """The way back, in seconds, from the restarted ranks' events (the slowest rank's moment for each)."""
    events = [json.loads(p.read_text()) for p in out.glob("timeline_rank*_attempt1.json")]
    names = ("started", "rendezvous_begin", "rendezvous_end", "train_start", "first_step_end")
    if len(events) != PROCESSES or any(n not in e for e in events for n in names):
        return None
    at = {n: max(e[n] for e in events) for n in names}
    at["started"] = min(e["started"] for e in events)  # torchrun starts them together
    return {"detection_s": at["started"] - killed_at, "start_up_s": at["rendezvous_begin"] - at["started"],
            "rendezvous_s": at["rendezvous_end"] - at["rendezvous_begin"],
            "loading_s": at["train_start"] - at["rendezvous_end"],
            "first_step_s": at["first_step_end"] - at["train_start"], "total_s": at["first_step_end"] - killed_at}


def one_kill(out: Path, case: dict[str, Any], references: dict[str, Any]) -> dict[str, Any]:
    """A job with ``case``'s kill: what came of it."""
    options = {k: case[k] for k in ("kill", "schedule", "checkpoint")}
    code, text = torchrun(out, [str(out), json.dumps(options)], case["rendezvous"], max_restarts=1)
    return read_kill(out, case, references, code, text)


def read_kill(out: Path, case: dict[str, Any], references: dict[str, Any], code: int | None, text: str
              ) -> dict[str, Any]:
    """What came of ``case``'s job, read from its folder (``code``: its exit code, None if unknown)."""
    kill = case["kill"]
    row: dict[str, Any] = {**case, "exit_code": code}
    marker = out / "killed"
    if not marker.exists():
        return {**row, "finished": False, "why": "the kill did not happen", "stderr_tail": text[-2000:]}
    killed_at, _ = marker.read_text().split()
    attempts = (out / "attempts_rank0.txt").read_text().split("\n")[:-1]
    resumed = int(attempts[-1].split()[1]) if len(attempts) > 1 else None
    state = final_state(out)
    finished = code in (0, None) and state is not None and state["global_step"] == {STEPS}
    # The last checkpoint sure to be complete before the kill: a kill at a save's step may come before that save
    # (after the step: the kill's callback runs before ModelCheckpoint's; in a transfer: pipedream drains first)
    # or in it (a save kill).
    last_complete = (kill["step"] - 1) // EVERY * EVERY
    row.update(finished=finished, equal=bool(finished and state is not None
                                              and equal(state, references[case["schedule"]])),
               resumed_at=resumed, last_complete_checkpoint=last_complete,
               steps_lost=None if resumed is None else kill["step"] - resumed,
               steps_since_checkpoint=kill["step"] - last_complete,
               skipped_incomplete="did not finish and are skipped" in text,
               way_back=timeline(out, float(killed_at)))
    if not finished:
        row["stderr_tail"] = text[-3000:]
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from benchmarks.common.figures import spread

    backs = [r["way_back"] for r in rows if r.get("way_back")]
    bounded = sum(r.get("steps_lost") is not None and r["steps_lost"] <= r["steps_since_checkpoint"] for r in rows)
    return {
        "finished": f"{sum(r['finished'] for r in rows)}/{len(rows)}",
        "equal_to_uninterrupted": f"{sum(bool(r.get('equal')) for r in rows)}/{len(rows)}",
        "steps_lost_within_bound": f"{bounded}/{len(rows)}",
        "way_back_s": {k: spread([b[k] for b in backs]) for k in (backs[0] if backs else {})},
        "way_back_goal_s": 30.0,
        "within_goal": f"{sum(b['total_s'] <= 30.0 for b in backs)}/{len(rows)}",
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="3 kills (one after a step, in a transfer, in a save)")
    parser.add_argument("--json", "--out", dest="out", type=Path, default=None,
                        help=f"the JSON result (default {RESULT})")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' folders here")
    parser.add_argument("--from-runs", type=Path, default=None,
                        help="no new run: read the finished jobs of an earlier --keep folder (a run cut short)")
    args = parser.parse_args(argv)
    count = 3 if args.quick else args.kills
    out_json = args.out or (RESULT.with_name("faults_quick.json") if args.quick else RESULT)
    load_before = os.getloadavg()
    started = time.time()
    root = args.from_runs or args.keep or Path(tempfile.mkdtemp(prefix="faults_"))
    root.mkdir(parents=True, exist_ok=True)
    cases = draw(args.seed, count)
    runs = root / "runs.json"
    if args.from_runs is None:
        runs.write_text(json.dumps([[str(root / f"reference-{s}"), {"schedule": s}] for s in SCHEDULES]))
        code, text = torchrun(root / "references", ["--runs", str(runs)], "static", max_restarts=0)
    else:
        code, text = None, ""
    references = {s: final_state(root / f"reference-{s}") for s in SCHEDULES}
    if code not in (0, None) or any(r is None for r in references.values()):
        raise SystemExit(f"the uninterrupted runs failed ({code}):\n{text[-4000:]}")
    rows = []
    for i, case in enumerate(cases):
        out = root / f"kill-{i:02d}"
        if args.from_runs is None:
            row = one_kill(out, case, references)
        elif (out / "torchrun.txt").exists() and ((root / f"kill-{i + 1:02d}").exists() or i + 1 == count):
            row = read_kill(out, case, references, None, (out / "torchrun.txt").read_text())
        else:
            break
        rows.append(row)
        back = row.get("way_back") or {}
        print(f"kill {i + 1}/{count}: {case['kill']} {case['schedule']} {case['checkpoint']} {case['rendezvous']}: "
              f"finished={row['finished']} equal={row.get('equal')} resumed_at={row.get('resumed_at')} "
              f"back={back.get('total_s', float('nan')):.1f} s", flush=True)
        write(out_json, args, rows, count, load_before, started)  # after each kill: a run cut short keeps its figures
    return write(out_json, args, rows, count, load_before, started)


def write(out_json: Path, args: argparse.Namespace, rows: list[dict[str, Any]], count: int,
          load_before: tuple[float, ...], started: float) -> dict[str, Any]:
    """The JSON result of the kills so far (``complete`` once all ``count`` ran)."""
    from benchmarks.common.figures import write_result

    result = {
        "command": "python -m benchmarks.faults" + (" --quick" if args.quick else ""),
        "what": __doc__.split("\n\n")[0],
        "setup": {"processes": PROCESSES, "steps": STEPS, "checkpoint_every": EVERY, "batches_per_epoch": BATCHES,
                  "balance": BALANCE, "seed": args.seed, "cpus": os.cpu_count()},
        "complete": len(rows) == count, "summary": summarize(rows), "kills": rows, "load_before": load_before,
        "wall_s": time.time() - started,
    }
    write_result(out_json, result)
    if result["complete"]:
        print(json.dumps(result["summary"], indent=1))
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        if sys.argv[2] == "--runs":  # several runs one after the other in the same processes (the references)
            for run_out, run_options in json.loads(Path(sys.argv[3]).read_text()):
                worker(run_out, run_options)
        else:
            worker(sys.argv[2], json.loads(sys.argv[3]))
    else:
        main()
