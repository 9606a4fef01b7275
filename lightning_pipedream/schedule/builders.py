"""One pure function per schedule: (stages, chunks) -> every rank's list of actions."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from lightning_pipedream.schedule.actions import Action, Op, Schedule

# A compute order for one stage: ("F" | "B", microbatch) pairs, and "O" for an optimizer step.
ComputeOrder = list[tuple[str, int] | str]

SCHEDULES = ("gpipe", "1f1b", "pipedream")


def check_chunks(chunks: object) -> None:
    """The one check (and wording) of a ``chunks`` value, wherever a user gives one."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(
            f"chunks must be an integer >= 1, got {chunks!r}: it is the number of micro-batches "
            "one batch is split into (1 means no split)."
        )


def _check_stages(num_stages: object) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}.")


def _check_minibatches(minibatches: object) -> None:
    if not isinstance(minibatches, int) or minibatches < 1:
        raise ValueError(
            f"minibatches must be an integer >= 1, got {minibatches!r}: it is the number of PipeDream "
            "minibatches (training steps) run before the drain."
        )


def _with_communication(stage: int, num_stages: int, order: Iterable, step: int = 0) -> list[Action]:
    """Turn a stage's compute order into actions, adding the sends and receives around it."""
    actions: list[Action] = []
    prev_rank, next_rank = stage - 1, stage + 1
    first, last = stage == 0, stage == num_stages - 1
    for item in order:
        if item == "O":
            actions.append(Action(Op.OPTIMIZER_STEP, stage, step=step))
            continue
        kind, mb = item
        if kind == "F":
            if not first:
                actions.append(Action(Op.RECV_ACT, stage, mb, prev_rank, step))
            actions.append(Action(Op.FORWARD, stage, mb, step=step))
            if not last:
                actions.append(Action(Op.SEND_ACT, stage, mb, next_rank, step))
        else:
            if not last:
                actions.append(Action(Op.RECV_GRAD, stage, mb, next_rank, step))
            actions.append(Action(Op.BACKWARD, stage, mb, step=step))
            if not first:
                actions.append(Action(Op.SEND_GRAD, stage, mb, prev_rank, step))
    return actions


def _flushed(name: str, num_stages: int, chunks: int, order_of: Callable[[int], ComputeOrder]) -> Schedule:
    _check_stages(num_stages)
    check_chunks(chunks)
    actions = tuple(
        tuple(_with_communication(s, num_stages, order_of(s))) for s in range(num_stages)
    )
    return Schedule(name, num_stages, num_stages, chunks, actions)


def gpipe(num_stages: int, chunks: int) -> Schedule:
    """GPipe: all forwards, then all backwards, then one optimizer step (flush)."""

    def order(stage: int) -> ComputeOrder:
        return [("F", m) for m in range(chunks)] + [("B", m) for m in range(chunks)] + ["O"]

    return _flushed("gpipe", num_stages, chunks, order)


def one_f_one_b(num_stages: int, chunks: int) -> Schedule:
    """1F1B with flush (PipeDream-Flush, DAPPLE): warm-up, one-forward-one-backward, cool-down."""

    def order(stage: int) -> ComputeOrder:
        warmup = min(num_stages - stage - 1, chunks)
        out: ComputeOrder = [("F", m) for m in range(warmup)]
        for i in range(chunks - warmup):
            out += [("F", warmup + i), ("B", i)]
        out += [("B", m) for m in range(chunks - warmup, chunks)]
        return out + ["O"]

    return _flushed("1f1b", num_stages, chunks, order)


def in_flight(num_stages: int, stage: int) -> int:
    """How many minibatches PipeDream keeps in flight on a stage (the input stage: all stages)."""
    return num_stages - stage


def pipedream_step(num_stages: int, stage: int, step: int) -> list[Action]:
    """One stage's actions in training step ``step`` of PipeDream's asynchronous 1F1B.

    Step t admits minibatch t: every stage runs its forward, then (once its warm-up of
    ``num_stages - stage - 1`` forwards is over) the backward of its oldest minibatch in flight,
    followed by an optimizer step. Minibatch numbers count from the last drain.
    """
    _check_stages(num_stages)
    order: ComputeOrder = [("F", step)]
    oldest = step - in_flight(num_stages, stage) + 1
    if oldest >= 0:
        order += [("B", oldest), "O"]
    return _with_communication(stage, num_stages, order, step)


def pipedream_drain(num_stages: int, stage: int, minibatches: int) -> list[Action]:
    """One stage's actions that empty the pipeline after ``minibatches`` steps (end of data, checkpoint)."""
    _check_stages(num_stages)
    if minibatches < 0:
        raise ValueError(f"minibatches must be >= 0, got {minibatches}.")
    first_pending = max(0, minibatches - in_flight(num_stages, stage) + 1)
    order: ComputeOrder = []
    for mb in range(first_pending, minibatches):
        order += [("B", mb), "O"]
    return _with_communication(stage, num_stages, order, minibatches)


def pipedream(num_stages: int, minibatches: int) -> Schedule:
    """PipeDream's asynchronous 1F1B over ``minibatches`` steps followed by a drain, as one schedule."""
    _check_stages(num_stages)
    _check_minibatches(minibatches)
    actions = tuple(
        tuple(
            [a for t in range(minibatches) for a in pipedream_step(num_stages, s, t)]
            + pipedream_drain(num_stages, s, minibatches)
        )
        for s in range(num_stages)
    )
    return Schedule("pipedream", num_stages, num_stages, 1, actions, minibatches=minibatches)


def inference(num_stages: int, chunks: int) -> Schedule:
    """Forward passes only, micro-batch by micro-batch (validation, test, predict)."""
    return _flushed("inference", num_stages, chunks, lambda stage: [("F", m) for m in range(chunks)])


_BUILDERS: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "pipedream": pipedream,
}


def check_schedule_name(name: str) -> str:
    """Return ``name`` if it is a known schedule, else raise an error that lists them."""
    if name not in _BUILDERS:
        raise ValueError(f"Unknown schedule {name!r}. Choose one of: {', '.join(SCHEDULES)}.")
    return name


def check_schedule_options(schedule: str, chunks: int, vertical_sync: bool = False) -> None:
    """Validate a training configuration (schedule, micro-batches, vertical sync) as a user gives it."""
    check_schedule_name(schedule)
    check_chunks(chunks)
    if schedule == "pipedream" and chunks != 1:
        raise ValueError(
            f"schedule='pipedream' runs each batch as one PipeDream minibatch; chunks={chunks} is not "
            "supported. Use chunks=1, or schedule='1f1b'/'gpipe' to split batches into micro-batches."
        )
    if vertical_sync and schedule != "pipedream":
        raise ValueError("vertical_sync=True only applies to schedule='pipedream'.")


def build_schedule(name: str, num_stages: int, chunks: int = 1, *, minibatches: int | None = None) -> Schedule:
    """Build a schedule by name.

    ``gpipe`` and ``1f1b`` cover one training step of ``chunks`` micro-batches. ``pipedream`` runs
    whole batches (``chunks`` must be 1) and covers ``minibatches`` training steps and the drain.
    """
    check_schedule_options(name, chunks)
    if name == "pipedream":
        if minibatches is None:
            raise ValueError(
                "build_schedule('pipedream', ...) needs minibatches=N: the number of minibatches "
                "(training steps) to run before the drain."
            )
        return pipedream(num_stages, minibatches)
    if minibatches is not None:
        raise ValueError(
            f"minibatches={minibatches} applies to schedule='pipedream' only; {name!r} covers one "
            "training step of `chunks` micro-batches."
        )
    return _BUILDERS[name](num_stages, chunks)
