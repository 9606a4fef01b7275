"""One pure function per schedule: (stages, chunks) -> every rank's list of actions."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from lightning_pipedream.schedule.actions import Action, Layout, Link, Op, Schedule, v_rank

# The names and their properties live in the spec table; re-exported here, where they were first defined.
from lightning_pipedream.schedule.specs import (  # noqa: F401
    ASYNCHRONOUS,
    REPLICATED_SCHEDULES,
    SCHEDULES,
    V_CHUNKS,
    V_SCHEDULES,
    spec_of,
)
from lightning_pipedream.schedule.v_shape import dualpipe_v_order, zero_bubble_v_order

# A compute order for one stage: ("F" | "B" | "W", microbatch) pairs, and "O" for an optimizer step.
ComputeOrder = list[tuple[str, int] | str]



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


def _with_communication(
    stage: int, num_stages: int, order: Iterable, step: int = 0, num_ranks: int | None = None, v_shape: bool = False
) -> list[Action]:
    """Turn a stage's compute order into actions, adding the sends and receives around it.

    ``num_ranks`` (interleaved schedules): stage s lives on rank s % num_ranks; by default one stage per rank.
    ``v_shape``: the stages lie in a V over the ranks (:func:`v_rank`); the turn's message stays on its rank.
    """
    actions: list[Action] = []
    ranks = num_stages if num_ranks is None else num_ranks
    if v_shape:
        prev_rank, next_rank = v_rank(max(stage - 1, 0), ranks), v_rank(min(stage + 1, num_stages - 1), ranks)
    else:
        prev_rank, next_rank = (stage - 1) % ranks, (stage + 1) % ranks
    first, last = stage == 0, stage == num_stages - 1
    for item in order:
        if item == "O":
            actions.append(Action(Op.OPTIMIZER_STEP, stage, step=step))
            continue
        kind, mb = item
        if kind == "W":
            actions.append(Action(Op.BACKWARD_WEIGHT, stage, mb, step=step))
        elif kind == "F":
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


def gpipe(num_stages: int, chunks: int, replicas: Sequence[int] | None = None) -> Schedule:
    """GPipe: all forwards, then all backwards, then one optimizer step (flush)."""
    layout = _replicated(num_stages, replicas)
    if layout is not None:
        check_chunks(chunks)
        return _flushed_replicated("gpipe", layout, chunks, lambda rank, own: _gpipe_order(own))

    def order(stage: int) -> ComputeOrder:
        return [("F", m) for m in range(chunks)] + [("B", m) for m in range(chunks)] + ["O"]

    return _flushed("gpipe", num_stages, chunks, order)


def one_f_one_b(num_stages: int, chunks: int, replicas: Sequence[int] | None = None) -> Schedule:
    """1F1B with flush (PipeDream-Flush, DAPPLE): warm-up, one-forward-one-backward, cool-down."""
    layout = _replicated(num_stages, replicas)
    if layout is not None:
        check_chunks(chunks)

        def replicated_order(rank: int, own: list[int]) -> ComputeOrder:
            # Warm-up as PipeDream's: one forward fewer than the stage keeps in flight.
            return _one_f_one_b_order(own, layout.in_flight(layout.stage_of(rank)) - 1)

        return _flushed_replicated("1f1b", layout, chunks, replicated_order)

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


def pipedream(num_stages: int, minibatches: int, replicas: Sequence[int] | None = None) -> Schedule:
    """PipeDream's asynchronous 1F1B over ``minibatches`` steps followed by a drain, as one schedule.

    With ``replicas`` it is PipeDream's 1F1B-RR (see :func:`replicated_pipedream_step`).
    """
    _check_stages(num_stages)
    _check_minibatches(minibatches)
    layout = _replicated(num_stages, replicas)
    if layout is not None:
        actions = tuple(
            tuple(
                [a for t in range(minibatches) for a in replicated_pipedream_step(layout, r, t)]
                + replicated_pipedream_drain(layout, r, minibatches)
            )
            for r in range(layout.num_ranks)
        )
        return Schedule("pipedream", layout.num_ranks, num_stages, 1, actions, minibatches, layout.replicas)
    actions = tuple(
        tuple(
            [a for t in range(minibatches) for a in pipedream_step(num_stages, s, t)]
            + pipedream_drain(num_stages, s, minibatches)
        )
        for s in range(num_stages)
    )
    return Schedule("pipedream", num_stages, num_stages, 1, actions, minibatches=minibatches)


# --------------------------------------------------------------------------------------------
# Replicated stages (PipeDream's 1F1B-RR) and data-parallel pipelines.


def _replicated(num_stages: int, replicas: Sequence[int] | None) -> Layout | None:
    """The layout when some stage has several replicas; None keeps the one-rank-per-stage builders and their output."""
    _check_stages(num_stages)
    if replicas is None:
        return None
    layout = Layout.of(replicas, num_stages)
    return layout if layout.is_replicated else None


def _own_microbatches(layout: Layout, rank: int, microbatches: Iterable[int]) -> list[int]:
    stage = layout.stage_of(rank)
    return [m for m in microbatches if layout.owner(stage, m) == rank]


def _with_replicas(layout: Layout, rank: int, order: Iterable, step: int = 0) -> list[Action]:
    """A replica's compute order as actions: each message goes to (and comes from) the replica that
    owns the micro-batch on the neighbouring stage; ``"R"`` is a gradient all-reduce among the
    stage's replicas."""
    stage = layout.stage_of(rank)
    first, last = stage == 0, stage == layout.num_stages - 1
    actions: list[Action] = []
    for item in order:
        if item == "O":
            actions.append(Action(Op.OPTIMIZER_STEP, stage, step=step))
            continue
        if item == "R":
            actions.append(Action(Op.ALLREDUCE_GRAD, stage, step=step))
            continue
        kind, mb = item
        if kind == "F":
            if not first:
                actions.append(Action(Op.RECV_ACT, stage, mb, layout.owner(stage - 1, mb), step))
            actions.append(Action(Op.FORWARD, stage, mb, step=step))
            if not last:
                actions.append(Action(Op.SEND_ACT, stage, mb, layout.owner(stage + 1, mb), step))
        else:
            if not last:
                actions.append(Action(Op.RECV_GRAD, stage, mb, layout.owner(stage + 1, mb), step))
            actions.append(Action(Op.BACKWARD, stage, mb, step=step))
            if not first:
                actions.append(Action(Op.SEND_GRAD, stage, mb, layout.owner(stage - 1, mb), step))
    return actions


def _gpipe_order(own: list[int]) -> ComputeOrder:
    order: ComputeOrder = [("F", m) for m in own]
    return order + [("B", m) for m in own]


def _one_f_one_b_order(own: list[int], warmup: int) -> ComputeOrder:
    warmup = min(warmup, len(own))
    out: ComputeOrder = [("F", m) for m in own[:warmup]]
    for i in range(len(own) - warmup):
        out += [("F", own[warmup + i]), ("B", own[i])]
    return out + [("B", m) for m in own[len(own) - warmup :]]


def _flushed_replicated(
    name: str, layout: Layout, chunks: int, order_of: Callable[[int, list[int]], ComputeOrder]
) -> Schedule:
    """A flushed step over ``chunks`` micro-batches per data shard: each replica runs the micro-batches
    it owns, then all-reduces its gradients with its stage's other replicas, then steps."""
    total = chunks * layout.input_replicas
    actions = []
    for rank in range(layout.num_ranks):
        order = order_of(rank, _own_microbatches(layout, rank, range(total)))
        reduce = ["R"] if layout.replicas[layout.stage_of(rank)] > 1 else []
        actions.append(tuple(_with_replicas(layout, rank, order + reduce + ["O"])))
    return Schedule(name, layout.num_ranks, layout.num_stages, chunks, tuple(actions), replicas=layout.replicas)


def _admitted(layout: Layout, step: int) -> range:
    """The minibatches step ``step`` admits: one per replica of the input stage."""
    d = layout.input_replicas
    return range(step * d, (step + 1) * d)


def replicated_pipedream_step(layout: Layout, rank: int, step: int) -> list[Action]:
    """One rank's actions in training step ``step`` of PipeDream's 1F1B-RR.

    Step t admits minibatches ``t*d .. t*d + d - 1`` (d = replicas of the input stage), minibatch
    m going to replica ``m % r`` of a stage with r replicas. Each replica runs 1F1B over the
    minibatches it owns, keeping :meth:`Layout.in_flight` of them in flight: after the forward of
    its k-th minibatch comes the backward of its (k - in_flight + 1)-th. A replicated stage
    all-reduces each backward's gradients with the other replicas' backwards of the same round (the
    n-th of each), then updates, so its replicas keep identical weights.
    """
    stage = layout.stage_of(rank)
    r, keep = layout.replicas[stage], layout.in_flight(stage)
    order: ComputeOrder = []
    for m in _own_microbatches(layout, rank, _admitted(layout, step)):
        order.append(("F", m))
        k = m // r  # this replica's k-th minibatch (it owns m = k*r + replica)
        if k - keep + 1 >= 0:
            order += [("B", (k - keep + 1) * r + (m % r))] + (["R"] if r > 1 else []) + ["O"]
    return _with_replicas(layout, rank, order, step)


def replicated_pipedream_drain(layout: Layout, rank: int, minibatches: int) -> list[Action]:
    """One rank's actions that empty a 1F1B-RR pipeline after ``minibatches`` steps.

    A replica that owns fewer of the admitted minibatches than another replica of its stage joins
    the last all-reduce round without a backward (contributing no gradient) and updates with the
    others, so that the replicas stay identical.
    """
    if minibatches < 0:
        raise ValueError(f"minibatches must be >= 0, got {minibatches}.")
    stage = layout.stage_of(rank)
    r, keep = layout.replicas[stage], layout.in_flight(stage)
    own = _own_microbatches(layout, rank, range(minibatches * layout.input_replicas))
    order: ComputeOrder = []
    for m in own[max(0, len(own) - keep + 1) :]:
        order += [("B", m)] + (["R"] if r > 1 else []) + ["O"]
    rounds = -(-minibatches * layout.input_replicas // r)  # backwards of the stage's busiest replica
    if r > 1 and len(own) < rounds:
        order += ["R", "O"]
    return _with_replicas(layout, rank, order, minibatches)

# --------------------------------------------------------------------------------------------
# Zero bubble, PipeDream-2BW and interleaved 1F1B.


def zero_bubble_h1(num_stages: int, chunks: int, replicas: Sequence[int] | None = None) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24): 1F1B with each backward split.

    B computes only the input gradient (what the previous stage waits for), W the weight gradient.
    Stage s runs 1F1B's forwards and B's, and defers each W by ``s`` micro-batches: the later stages,
    which finish their backwards first, fill their cool-down with W's while the B's race back to
    stage 0. Every stage keeps at most ``num_stages`` micro-batches' activations (1F1B's stage 0),
    and with W as long as B the bubble shrinks from 1F1B's ``(p-1)(F+B+W)`` to ``(p-1)(F+B-W)``.
    """
    if replicas is not None and _replicated(num_stages, replicas) is not None:
        raise ValueError("schedule='zb-h1' does not support replicated stages yet; use replicas=None.")

    def order(stage: int) -> ComputeOrder:
        warmup = min(num_stages - stage - 1, chunks)
        delay = stage  # W's this stage defers
        out: ComputeOrder = [("F", m) for m in range(warmup)]
        weights = 0  # W's issued so far
        backwards = 0
        for i in range(chunks):
            if warmup + i < chunks:
                out.append(("F", warmup + i))
            out.append(("B", i))
            backwards += 1
            if backwards - weights > delay:
                out.append(("W", weights))
                weights += 1
        out += [("W", m) for m in range(weights, chunks)]
        return out + ["O"]

    return _flushed("zb-h1", num_stages, chunks, order)


def _check_virtual_stages(virtual_stages: object) -> None:
    if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) or virtual_stages < 1:
        raise ValueError(
            f"virtual_stages must be an integer >= 1, got {virtual_stages!r}: it is the number of model "
            "chunks each rank holds in schedule='interleaved' (1 is plain 1F1B)."
        )


def interleaved(num_ranks: int, chunks: int, virtual_stages: int = 2) -> Schedule:
    """Megatron-LM's interleaved 1F1B: each rank holds ``virtual_stages`` (v) model chunks.

    The model is cut into ``num_ranks * v`` stages; rank r holds stages r, r + p, r + 2p, ... (p ranks).
    Micro-batches go in groups of p (the remainder of ``chunks / p`` joins the first group): a rank
    runs the forwards of a group on its chunk 0, then on chunk 1, ...; backwards run the chunks in
    reverse. Warm-up: ``2 (p - r - 1) + (v - 1) g`` forwards (g: the first group's size; all of them
    if fewer), then one forward, one backward, as Megatron-LM's schedule for m a multiple of p.
    Each forward is 1/v of a stage's, so the bubble is ``(p-1) / (v m)`` of a step's ideal time
    instead of 1F1B's ``(p-1) / m``; in exchange a rank keeps more micro-batch chunks in flight.
    With v = 1 it is exactly ``1f1b``.
    """
    _check_stages(num_ranks)
    check_chunks(chunks)
    _check_virtual_stages(virtual_stages)
    p, v = num_ranks, virtual_stages
    if v == 1:
        schedule = one_f_one_b(p, chunks)
        return Schedule("interleaved", p, p, chunks, schedule.actions)
    # Groups of p micro-batches, the remainder in the first group: a group of at least p keeps chunk
    # c's output of a micro-batch arriving before the rank needs it for chunk c + 1, and the warm-up,
    # sized by the first group, covers every later (no larger) group.
    first = p + chunks % p if chunks >= p else chunks
    groups = [list(range(first))] + [list(range(g, g + p)) for g in range(first, chunks, p)]
    total = chunks * v
    actions = [
        _interleaved_rank(rank, p, v, groups, min(total, 2 * (p - rank - 1) + (v - 1) * len(groups[0])))
        for rank in range(p)
    ]
    return Schedule("interleaved", p, p * v, chunks, _receive_in_send_order(actions))


def _interleaved_rank(rank: int, p: int, v: int, groups: list[list[int]], warmup: int) -> list[Action]:
    """One rank's actions of interleaved 1F1B with ``warmup`` forwards before the first backward."""
    forwards = [(c * p + rank, m) for group in groups for c in range(v) for m in group]
    backwards = [(c * p + rank, m) for group in groups for c in reversed(range(v)) for m in group]
    order: list[tuple[str, int, int]] = [("F", st, m) for st, m in forwards[:warmup]]
    for i in range(len(forwards) - warmup):
        order += [("F", *forwards[warmup + i]), ("B", *backwards[i])]
    order += [("B", *b) for b in backwards[len(forwards) - warmup :]]
    rank_actions: list[Action] = []
    for kind, stage, m in order:
        rank_actions += _with_communication(stage, p * v, [(kind, m)], num_ranks=p)
    return rank_actions + [Action(Op.OPTIMIZER_STEP, c * p + rank) for c in range(v)]


def _receive_in_send_order(actions: list[list[Action]]) -> tuple[tuple[Action, ...], ...]:
    """Reorder receives so that each link's messages are received in the order they were sent.

    With several stages per rank, one link carries both activations and gradients, and a rank may
    need a later message first. Links are FIFO, so where a rank receives message X it first receives
    every message sent before X on that link (they are kept until used). This never waits longer:
    those messages left before X did.
    """
    sent: dict[Link, list[Action]] = {}
    for rank, rank_actions in enumerate(actions):
        for a in rank_actions:
            if a.op is Op.SEND_ACT or a.op is Op.SEND_GRAD:
                sent.setdefault((rank, a.peer), []).append(a)
    out = []
    for rank, rank_actions in enumerate(actions):
        taken: dict[int | None, int] = {}  # peer -> messages received from it so far
        received: set[tuple] = set()
        new: list[Action] = []
        for a in rank_actions:
            if a.op is not Op.RECV_ACT and a.op is not Op.RECV_GRAD:
                new.append(a)
                continue
            key = (a.op is Op.RECV_ACT, a.stage, a.microbatch)
            if key in received:
                continue
            queue = sent[(a.peer, rank)]
            while key not in received:
                message = queue[taken.get(a.peer, 0)]
                taken[a.peer] = taken.get(a.peer, 0) + 1
                is_act = message.op is Op.SEND_ACT
                stage = message.stage + 1 if is_act else message.stage - 1
                op = Op.RECV_ACT if is_act else Op.RECV_GRAD
                new.append(Action(op, stage, message.microbatch, a.peer, message.step))
                received.add((is_act, stage, message.microbatch))
        out.append(tuple(new))
    return tuple(out)


def _check_v(name: str, num_ranks: int, chunks: int, virtual_stages: int) -> None:
    _check_stages(num_ranks)
    check_schedule_options(name, chunks, virtual_stages=virtual_stages)
    if chunks < least_chunks(name, num_ranks):
        raise ValueError(
            f"schedule='dualpipev' needs at least 2 x ranks = {2 * num_ranks} micro-batches per step, got "
            f"chunks={chunks}: raise chunks to {2 * num_ranks} or more, or use schedule='zb-v'."
        )


def least_chunks(schedule: str, num_ranks: int) -> int:
    """The fewest micro-batches per step ``schedule`` runs on ``num_ranks`` ranks: 2 per rank for dualpipev, else 1."""
    return 2 * num_ranks if schedule == "dualpipev" else 1


def step_schedule(schedule: str, num_ranks: int, chunks: int) -> str:
    """The schedule a step of ``chunks`` micro-batches runs as under ``schedule``: a dualpipev step of fewer than 2 per
    rank (a smaller last batch) runs zb-v's order, on the same V of chunks and with the same result; else itself."""
    return "zb-v" if spec_of(schedule).v_shape and chunks < least_chunks(schedule, num_ranks) else schedule


def _v_schedule(name: str, num_ranks: int, chunks: int, order_of: Callable[[int, int, int], list]) -> Schedule:
    """A V-shape schedule from its per-rank compute orders: messages around each compute, the turn's
    kept on its rank, receives in send order, and one optimizer step per chunk at the end."""
    p = num_ranks
    actions = []
    for rank in range(p):
        rank_actions: list[Action] = []
        for kind, stage, mb in order_of(p, chunks, rank):
            rank_actions += _with_communication(stage, 2 * p, [(kind, mb)], num_ranks=p, v_shape=True)
        actions.append(rank_actions + [Action(Op.OPTIMIZER_STEP, st) for st in (rank, 2 * p - 1 - rank)])
    return Schedule(name, p, 2 * p, chunks, _receive_in_send_order(actions), v_shape=True)


def zero_bubble_v(num_ranks: int, chunks: int, virtual_stages: int = V_CHUNKS) -> Schedule:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24, section 6): two chunks per rank in a V.

    Rank r holds stages r and ``2P-1-r``; each backward is split into input and weight gradients, as
    ``zb-h1``'s. With F, B and W of equal length its bubble is about half ZB-H1's, at the activation
    memory of 1F1B's first stage (see :func:`~lightning_pipedream.schedule.v_shape.zero_bubble_v_order`).
    """
    _check_v("zb-v", num_ranks, chunks, virtual_stages)
    return _v_schedule("zb-v", num_ranks, chunks, zero_bubble_v_order)


def dualpipe_v(num_ranks: int, chunks: int, virtual_stages: int = V_CHUNKS) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe, folded to P ranks): two chunks per rank in a V, ``chunks >= 2P``.

    In its main phase a forward of one chunk pairs with a whole backward of the other; on a GPU the pair
    overlaps to hide communication, here they run one after the other (see
    :func:`~lightning_pipedream.schedule.v_shape.dualpipe_v_order`).
    """
    _check_v("dualpipev", num_ranks, chunks, virtual_stages)
    return _v_schedule("dualpipev", num_ranks, chunks, dualpipe_v_order)


def v_virtual_stages(schedule: str, virtual_stages: int) -> int:
    """The model chunks per rank ``schedule`` runs with ``virtual_stages`` as given: a V schedule's default
    (1, as for every schedule) means its two chunks; any other value passes through to be checked."""
    return V_CHUNKS if spec_of(schedule).v_shape and virtual_stages == 1 else virtual_stages


def rank_stages(schedule: str, num_ranks: int, rank: int, virtual_stages: int = 1) -> list[int]:
    """The model stages ``rank`` holds under ``schedule``, its chunk 0 first: ``rank`` (one chunk), ``rank, rank + P,
    ...`` (interleaved) or ``rank, 2P-1-rank`` (a V schedule)."""
    if spec_of(schedule).v_shape:
        return [rank, 2 * num_ranks - 1 - rank]
    return [c * num_ranks + rank for c in range(virtual_stages)]


def stage_rank(schedule: str, num_ranks: int, stage: int) -> int:
    """The rank that holds model stage ``stage`` under ``schedule`` (see :func:`rank_stages`)."""
    return v_rank(stage, num_ranks) if spec_of(schedule).v_shape else stage % num_ranks


def _two_bw_warmup(num_stages: int, stage: int, chunks: int) -> int:
    # At most one minibatch of forwards ahead, so that minibatch t's forwards find version t-1 made.
    return min(num_stages - stage - 1, chunks)


def two_bw_step(num_stages: int, stage: int, chunks: int, step: int) -> list[Action]:
    """One stage's actions in training step ``step`` of PipeDream-2BW.

    The stage runs one endless 1F1B stream over micro-batches (no flush): step t admits micro-batches
    ``t*chunks .. t*chunks + chunks - 1`` (minibatch t); after each forward comes the backward of the
    micro-batch ``warmup`` before it, and after the backward of a minibatch's last micro-batch, the
    update that coalesces that minibatch's gradients.
    """
    _check_stages(num_stages)
    check_chunks(chunks)
    warmup = _two_bw_warmup(num_stages, stage, chunks)
    order: ComputeOrder = []
    for n in range(step * chunks, (step + 1) * chunks):
        order.append(("F", n))
        if n - warmup >= 0:
            order.append(("B", n - warmup))
            if (n - warmup) % chunks == chunks - 1:
                order.append("O")
    return _with_communication(stage, num_stages, order, step)


def two_bw_drain(num_stages: int, stage: int, chunks: int, minibatches: int) -> list[Action]:
    """One stage's actions that finish the micro-batches in flight after ``minibatches`` steps of 2BW."""
    _check_stages(num_stages)
    if minibatches < 0:
        raise ValueError(f"minibatches must be >= 0, got {minibatches}.")
    warmup = _two_bw_warmup(num_stages, stage, chunks)
    end = minibatches * chunks
    order: ComputeOrder = []
    for n in range(max(0, end - warmup), end):
        order.append(("B", n))
        if n % chunks == chunks - 1:
            order.append("O")
    return _with_communication(stage, num_stages, order, minibatches)


def two_bw(num_stages: int, chunks: int, minibatches: int) -> Schedule:
    """PipeDream-2BW (Narayanan et al., ICML'21) over ``minibatches`` steps of ``chunks`` micro-batches, then the drain.

    The weight rule it serves: W(t+1) = W(t) - lr * grad f_t(W(t-1)): every micro-batch of minibatch
    t runs forward and backward on its stage's version t-1, and each stage keeps two versions.
    """
    _check_stages(num_stages)
    check_chunks(chunks)
    _check_minibatches(minibatches)
    actions = tuple(
        tuple(
            [a for t in range(minibatches) for a in two_bw_step(num_stages, s, chunks, t)]
            + two_bw_drain(num_stages, s, chunks, minibatches)
        )
        for s in range(num_stages)
    )
    return Schedule("2bw", num_stages, num_stages, chunks, actions, minibatches=minibatches)


def inference(num_stages: int, chunks: int, virtual_stages: int = 1, v_shape: bool = False) -> Schedule:
    """Forward passes only, micro-batch by micro-batch (validation, test, predict).

    ``virtual_stages`` > 1: ``num_stages`` ranks each hold that many model chunks (as ``interleaved``
    lays them out); a rank runs every micro-batch through its chunk 0, then its chunk 1, ...
    ``v_shape``: two chunks per rank in a V (zb-v, dualpipev), the same order over those stages.
    """
    if v_shape:
        _check_stages(num_stages)
        check_chunks(chunks)
        p = num_stages
        actions = [
            [a for st in (r, 2 * p - 1 - r)
             for a in _with_communication(st, 2 * p, [("F", m) for m in range(chunks)], num_ranks=p, v_shape=True)]
            for r in range(p)
        ]
        return Schedule("inference", p, 2 * p, chunks, _receive_in_send_order(actions), v_shape=True)
    if virtual_stages == 1:
        return _flushed("inference", num_stages, chunks, lambda stage: [("F", m) for m in range(chunks)])
    _check_stages(num_stages)
    check_chunks(chunks)
    _check_virtual_stages(virtual_stages)
    p, v = num_stages, virtual_stages
    forwards = [("F", m) for m in range(chunks)]
    actions = [
        [a for c in range(v) for a in _with_communication(c * p + r, p * v, forwards, num_ranks=p)] for r in range(p)
    ]
    return Schedule("inference", p, p * v, chunks, _receive_in_send_order(actions))


_BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "pipedream": pipedream,
    "2bw": two_bw,
    "interleaved": interleaved,
    "zb-h1": zero_bubble_h1,
    "zb-v": zero_bubble_v,
    "dualpipev": dualpipe_v,
}

def check_schedule_name(name: str) -> str:
    """Return ``name`` if it is a known schedule, else raise an error that lists them."""
    return spec_of(name).name


def check_schedule_options(
    schedule: str, chunks: int, vertical_sync: bool = False, *, virtual_stages: int = 1,
    recompute: bool | Sequence[bool] = False,
) -> None:
    """Validate a training configuration (schedule, micro-batches, vertical sync, model chunks per rank,
    recomputation) as a user gives it."""
    spec = spec_of(schedule)
    check_chunks(chunks)
    if not spec.microbatches and chunks != 1:
        raise ValueError(
            f"schedule='pipedream' runs each batch as one PipeDream minibatch; chunks={chunks} is not "
            "supported. Use chunks=1, or schedule='1f1b'/'gpipe' to split batches into micro-batches."
        )
    if vertical_sync and spec.weight_versions is not None:  # only weight stashing keeps every version
        raise ValueError("vertical_sync=True only applies to schedule='pipedream'.")
    _check_virtual_stages(virtual_stages)
    if spec.v_shape:
        virtual_stages = v_virtual_stages(schedule, virtual_stages)
        if virtual_stages != V_CHUNKS:
            raise ValueError(
                f"schedule={schedule!r} runs exactly {V_CHUNKS} model chunks per rank (one down the ranks, one "
                f"back up), got virtual_stages={virtual_stages}: drop virtual_stages (it defaults to {V_CHUNKS}) "
                f"or give virtual_stages={V_CHUNKS}."
            )
    if virtual_stages != 1 and not spec.virtual_stages:
        raise ValueError(
            f"virtual_stages={virtual_stages} applies to schedule='interleaved' only (model chunks per rank); "
            f"schedule={schedule!r} runs one chunk per rank: drop virtual_stages or use schedule='interleaved'."
        )
    flags = recompute if isinstance(recompute, (list, tuple)) else [recompute]
    if not flags or not all(isinstance(flag, bool) for flag in flags):
        raise ValueError(f"recompute must be True, False or one of them per model stage (e.g. [True, False]: "
                         f"stage 0 only), got {recompute!r}.")


def build_schedule(
    name: str,
    num_stages: int,
    chunks: int = 1,
    *,
    minibatches: int | None = None,
    replicas: Sequence[int] | None = None,
    virtual_stages: int = 1,
) -> Schedule:
    """Build a schedule by name.

    ``gpipe``, ``1f1b``, ``zb-h1`` and ``interleaved`` cover one training step of ``chunks``
    micro-batches. ``pipedream`` runs whole batches (``chunks`` must be 1) and covers ``minibatches``
    training steps and the drain; ``2bw`` covers ``minibatches`` steps of ``chunks`` micro-batches
    and the drain. ``replicas`` (one count per stage, e.g. ``[2, 1]``) replicates stages (see
    :class:`Layout`): ``chunks`` then counts micro-batches per replica of the input stage (per data
    shard). ``interleaved``: ``num_stages`` is the number of ranks, each holding ``virtual_stages``
    model chunks (``num_stages * virtual_stages`` stages in all).
    """
    check_schedule_options(name, chunks, virtual_stages=virtual_stages)
    spec = spec_of(name)
    if spec.asynchronous:
        if minibatches is None:
            raise ValueError(
                f"build_schedule({name!r}, ...) needs minibatches=N: the number of minibatches "
                "(training steps) to run before the drain."
            )
        if spec.two_weight_versions:
            if replicas is not None and _replicated(num_stages, replicas) is not None:
                raise ValueError("schedule='2bw' does not support replicated stages yet; use replicas=None.")
            return two_bw(num_stages, chunks, minibatches)
        return pipedream(num_stages, minibatches, replicas)
    if minibatches is not None:
        raise ValueError(
            f"minibatches={minibatches} applies to schedule='pipedream' or '2bw' only; {name!r} covers one "
            "training step of `chunks` micro-batches."
        )
    if spec.virtual_stages:
        if replicas is not None and _replicated(num_stages, replicas) is not None:
            raise ValueError(f"schedule={name!r} does not support replicated stages yet; use replicas=None.")
        if spec.v_shape:
            builder = zero_bubble_v if name == "zb-v" else dualpipe_v
            return builder(num_stages, chunks, v_virtual_stages(name, virtual_stages))
        return interleaved(num_stages, chunks, virtual_stages)
    return _BUILDERS[name](num_stages, chunks, replicas)
