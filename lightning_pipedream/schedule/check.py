"""Schedule validator (every receive matched, compute in order, no rank waits forever) and its text grid."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_pipedream.schedule.actions import Action, Link, Op, Schedule


class ScheduleError(ValueError):
    """A schedule is unsound: it would compute the wrong thing, or some rank would wait forever."""


# How each schedule updates weights. "per_step": every stage steps once per training step, after
# all of that step's backwards (a flush). "per_backward": every backward is followed by its own
# update before the stage computes anything else (PipeDream). "per_minibatch": a stage updates after
# the backwards of each minibatch of ``chunks`` micro-batches, while the pipeline stays full, and
# minibatch t's forwards run after its (t-1)-th update and before its (t+1)-th (PipeDream-2BW: two
# weight versions). "none": forwards only, no backward and no update (evaluation). Unlisted
# schedules are "per_step".
OPTIMIZER_POLICY: dict[str, str] = {"pipedream": "per_backward", "2bw": "per_minibatch", "inference": "none"}

# Schedules with rules of their own, registered by the module that builds them: name -> validator. (The decode
# ring of schedule/generation.py: forwards only, around a ring, with a step index.)
OWN_RULES: dict[str, Callable[[Schedule], None]] = {}

_RECV, _SEND = (Op.RECV_ACT, Op.RECV_GRAD), (Op.SEND_ACT, Op.SEND_GRAD)
_COMPUTE = frozenset((Op.FORWARD, Op.BACKWARD, Op.BACKWARD_WEIGHT))  # a set: the hot loops below test it often


# --------------------------------------------------------------------------------------------
# The blocking simulation shared by the deadlock check and the grid.


@dataclass
class Placement:
    """Where the unit-time blocking simulation put every action.

    ``slot[rank][i]`` is the time slot in which action ``i`` of ``rank`` ran (-1: never, the rank
    got stuck before it). ``stuck[rank]`` is the index of the receive the rank waits on forever,
    or None when the rank finished. Every compute action takes one slot; sends, receives and
    optimizer steps take none; a message sent in slot t can be received from slot t + 1 on.
    """

    slot: list[list[int]]
    slots: int
    stuck: list[int | None]
    collectives: Any = None  # who reached each all-reduce (for the deadlock message)


def place(schedule: Schedule) -> Placement:
    """Run every rank in lock step: a rank advances unless its next action is a receive with nothing to
    receive, or a gradient all-reduce that not all of its stage's replicas have reached."""
    ranks = schedule.actions
    pos = [0] * len(ranks)
    slot = [[-1] * len(actions) for actions in ranks]
    sent: Counter[Link] = Counter()  # (src, dst) -> messages visible to the receiver
    taken: Counter = Counter()  # (src, dst) -> messages already received
    collective = _Collectives(schedule)
    tick = 0
    while True:
        progressed = False
        new_messages: list[Link] = []
        computed = [False] * len(ranks)
        passes = True
        while passes:  # again while an all-reduce completed: its members pass it in this slot too
            passes = False
            for rank, actions in enumerate(ranks):
                i, end, row = pos[rank], len(actions), slot[rank]
                while i < end:
                    action = actions[i]
                    op = action.op
                    if op in _COMPUTE:
                        if computed[rank]:
                            break
                        computed[rank] = True
                    elif op in _RECV:
                        link: Link = (action.peer, rank)
                        if sent[link] <= taken[link]:
                            break
                        taken[link] += 1
                    elif op in _SEND:
                        new_messages.append((rank, action.peer))
                    elif op is Op.ALLREDUCE_GRAD:
                        done, released = collective.arrive(rank, i)
                        passes = passes or released
                        if not done:
                            break
                    row[i] = tick
                    i += 1
                if i != pos[rank]:
                    pos[rank] = i
                    progressed = True
        for link in new_messages:  # visible from the next slot on: data takes time to travel
            sent[link] += 1
        if not progressed:
            break
        tick += 1
    stuck = [p if p < len(actions) else None for p, actions in zip(pos, ranks)]
    placement = Placement(slot, tick, stuck)
    placement.collectives = collective
    return placement


class _Collectives:
    """Which ranks reached each gradient all-reduce: a replica's n-th ALLREDUCE_GRAD of a stage meets
    the n-th of every other replica of that stage."""

    def __init__(self, schedule: Schedule) -> None:
        layout = schedule.layout
        self.members = {s: len(layout.ranks_of(s)) for s in range(schedule.num_stages)} if layout else {}
        self.round: dict[tuple[int, int], int] = {}  # (rank, action index) -> round number
        counts: Counter = Counter()
        for rank, actions in enumerate(schedule.actions):
            for i, a in enumerate(actions):
                if a.op is Op.ALLREDUCE_GRAD:
                    self.round[(rank, i)] = counts[(rank, a.stage)]
                    counts[(rank, a.stage)] += 1
        self.arrived: dict[tuple[int, int], set[int]] = {}  # (stage, round) -> ranks there
        self._actions = schedule.actions

    def arrive(self, rank: int, index: int) -> tuple[bool, bool]:
        """Record that ``rank`` reached its all-reduce at ``index``. Returns (every member is there,
        this arrival completed the round for members already waiting)."""
        stage = self._stage_of(rank, index)
        here = self.arrived.setdefault((stage, self.round[(rank, index)]), set())
        new = rank not in here
        here.add(rank)
        done = len(here) >= self.members.get(stage, 1)
        return done, done and new and len(here) > 1

    def missing(self, schedule: Schedule, rank: int, index: int) -> list[int]:
        """The members that never reach the all-reduce ``rank`` waits on at ``index``."""
        stage = self._stage_of(rank, index)
        here = self.arrived.get((stage, self.round[(rank, index)]), set())
        layout = schedule.layout
        return [r for r in (layout.ranks_of(stage) if layout else [rank]) if r not in here]

    def _stage_of(self, rank: int, index: int) -> int:
        return self._actions[rank][index].stage


# --------------------------------------------------------------------------------------------
# The text grid.


def _label(action: Action, stage_suffix: bool) -> str:
    text = str(action)
    shown = stage_suffix and action.op not in (Op.OPTIMIZER_STEP, Op.ALLREDUCE_GRAD)
    return f"{text}s{action.stage}" if shown else text


def render_grid(
    schedule: Schedule,
    *,
    mark: tuple[int, int] | None = None,
    rows: tuple[int, int] | None = None,
    placement: Placement | None = None,
) -> str:
    """The schedule as a text grid: one column per rank, one row per time slot, ``.`` where a rank idles.

    Cells show compute actions (``F3``: forward of micro-batch 3, ``B3``: backward, ``W3``: the weight
    gradient half of a split backward) and ``O`` for an
    optimizer step (``B3+O`` when it follows a backward in the same slot), ``AR`` for a gradient
    all-reduce among a replicated stage's replicas; with several stages per rank the stage is
    appended (``F3s5``); replicated schedules name each rank's stage in the header.
    ``mark=(rank, index)`` brackets that action's cell (``>F3<``); a rank that waits forever gets a
    last ``wait`` row with the receive it waits on.
    ``rows=(first, last)`` prints only those slots.
    """
    placement = placement or place(schedule)
    suffix = schedule.num_stages != schedule.num_ranks and schedule.replicas is None
    n, slots = schedule.num_ranks, placement.slots
    cells = [["" for _ in range(n)] for _ in range(slots)]
    for rank, actions in enumerate(schedule.actions):
        for action, tick in zip(actions, placement.slot[rank]):
            if tick < 0 or not (action.op.is_compute or action.op in (Op.OPTIMIZER_STEP, Op.ALLREDUCE_GRAD)):
                continue
            text = _label(action, suffix)
            cells[tick][rank] = f"{cells[tick][rank]}+{text}" if cells[tick][rank] else text
    wait = [""] * n
    for rank, index in enumerate(placement.stuck):
        if index is not None:
            wait[rank] = "?" + str(schedule.actions[rank][index])
    if mark is not None:
        rank, index = mark
        tick = placement.slot[rank][index] if index < len(schedule.actions[rank]) else -1
        if tick >= 0:
            action = schedule.actions[rank][index]
            parts, text = [p for p in cells[tick][rank].split("+") if p], _label(action, suffix)
            if text in parts:  # a compute or an optimizer step: bracket it where it is shown
                parts[len(parts) - 1 - parts[::-1].index(text)] = f">{text}<"
            else:  # a send or receive: shown in front of the slot's compute
                parts.insert(0, f">{action}<")
            cells[tick][rank] = "+".join(parts)
        elif wait[rank]:
            wait[rank] = f">{wait[rank]}<"
    first, last = rows if rows is not None else (0, slots - 1)
    first, last = max(first, 0), min(last, slots - 1)
    table = [[str(t)] + [c or "." for c in cells[t]] for t in range(first, last + 1)]
    if any(wait):
        table.append(["wait"] + [c or "." for c in wait])
    layout = schedule.layout
    header = ["slot"] + [f"rank {r}" + (f" s{layout.stage_of(r)}" if layout else "") for r in range(n)]
    widths = [max(len(row[i]) for row in table + [header]) for i in range(n + 1)]
    lines = [
        "  ".join(c.rjust(widths[0]) if i == 0 else c.ljust(widths[i]) for i, c in enumerate(row)).rstrip()
        for row in [header] + table
    ]
    if first > 0:
        lines.insert(1, "...")
    if last < slots - 1:
        lines.insert(len(lines) - (1 if any(wait) else 0), "...")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The validator.


class _Failer:
    """Builds error messages that name the rank, the action's index in its list and the action,
    with the grid around it."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self._placement: Placement | None = None

    @property
    def placement(self) -> Placement:
        if self._placement is None:
            self._placement = place(self.schedule)
        return self._placement

    def __call__(self, rank: int, index: int, problem: str) -> ScheduleError:
        s = self.schedule
        actions = s.actions[rank] if 0 <= rank < len(s.actions) else ()
        what = f"({actions[index]})" if index < len(actions) else "(end of its list)"
        head = f"{s.name} schedule, {s.size()}: rank {rank}, action {index} {what}: {problem}"
        if not 0 <= rank < len(s.actions):
            return ScheduleError(head)
        placement = self.placement
        tick = placement.slot[rank][index] if index < len(actions) else -1
        around = (tick - 4, tick + 4) if tick >= 0 else (placement.slots - 8, placement.slots)
        grid = render_grid(s, mark=(rank, index), rows=around, placement=placement)
        return ScheduleError(f"{head}\n{grid}")


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is sound.

    Sound means: every action belongs to its rank and names the right peer; each stage runs the
    forward and the backward of every micro-batch exactly once, the forward first, each only
    after receiving its input; every receive has exactly one matching send, and messages between
    two ranks are received in the order they are sent (point-to-point links are FIFO); optimizer
    steps are where the schedule's policy puts them; and the blocking simulation finishes, so no
    rank waits forever.

    Replicated schedules (``schedule.replicas``) also need: each micro-batch runs on the replica
    that owns it (round robin) and talks to the owners on the neighbouring stages; every update of
    a replicated stage follows a gradient all-reduce, and all replicas of a stage run the same
    number of all-reduces (each has all its members).
    """
    if schedule.name in OWN_RULES:  # generation's decode ring (schedule/generation.py registers it)
        OWN_RULES[schedule.name](schedule)
        return
    fail = _Failer(schedule)
    _check_layout(schedule, fail)
    for rank in range(schedule.num_ranks):
        _check_rank_order(schedule, rank, fail)
        _check_updates(schedule, rank, fail)
    _check_links(schedule, fail)
    _check_collectives(schedule, fail)
    _check_progress(schedule, fail)


def _check_layout(s: Schedule, fail: _Failer) -> None:
    """Sizes agree, every action sits on the rank of its stage, names a valid micro-batch and the right peer."""
    if s.num_ranks < 1 or s.num_stages < 1 or s.chunks < 1 or s.minibatches < 1:
        raise ScheduleError(
            f"{s.name} schedule has {s.num_ranks} ranks, {s.num_stages} stages, {s.chunks} chunks and "
            f"{s.minibatches} minibatches; all must be >= 1."
        )
    if len(s.actions) != s.num_ranks:
        raise ScheduleError(
            f"{s.name} schedule lists actions for {len(s.actions)} ranks but declares "
            f"num_ranks={s.num_ranks}; give one action list per rank."
        )
    last = s.num_stages - 1
    layout = s.layout
    if layout is not None and (layout.num_stages != s.num_stages or layout.num_ranks != s.num_ranks):
        raise ScheduleError(
            f"{s.name} schedule declares {s.num_stages} stages on {s.num_ranks} ranks but replicas "
            f"{list(layout.replicas)} place {layout.num_stages} stages on {layout.num_ranks} ranks."
        )
    count = s.microbatch_count
    owner = s.owner if layout is not None else (lambda stage, microbatch: s.rank_of(stage))
    for rank, actions in enumerate(s.actions):
        own = set(s.stages_of(rank))
        for i, a in enumerate(actions):
            if a.stage not in own:
                where = (
                    f"stages are 0..{last}, rank r holds stages r and {last} - r (a V)"
                    if s.v_shape
                    else f"stages are 0..{last}, stage s lives on rank s % {s.num_ranks}"
                    if layout is None
                    else f"replicas {list(layout.replicas)} put stage {layout.stage_of(rank)} there"
                )
                raise fail(rank, i, f"stage {a.stage} does not live on rank {rank} ({where}).")
            if a.op is Op.OPTIMIZER_STEP:
                continue
            if a.op is Op.ALLREDUCE_GRAD:
                if layout is None or layout.replicas[a.stage] < 2:
                    raise fail(rank, i, f"gradient all-reduce on stage {a.stage}, which has one replica; remove it.")
                continue
            if not isinstance(a.microbatch, int) or not 0 <= a.microbatch < count:
                raise fail(rank, i, f"micro-batch {a.microbatch!r} is out of range 0..{count - 1}.")
            if layout is not None and s.owner(a.stage, a.microbatch) != rank:
                holder = s.owner(a.stage, a.microbatch)
                raise fail(
                    rank,
                    i,
                    f"micro-batch {a.microbatch} of stage {a.stage} belongs to rank {holder} (replicas take "
                    f"micro-batches round robin: replica m % {layout.replicas[a.stage]}).",
                )
            if a.op in _COMPUTE:
                continue
            to_next = a.op is Op.SEND_ACT or a.op is Op.RECV_GRAD  # talks to the next stage, else the previous
            other = a.stage + 1 if to_next else a.stage - 1
            if not 0 <= other <= last:
                side = "next" if to_next else "previous"
                raise fail(rank, i, f"stage {a.stage} has no {side} stage to talk to.")
            right = owner(other, a.microbatch)
            if a.peer != right:
                raise fail(rank, i, f"peer should be rank {right} (where stage {other} lives), not {a.peer}.")


# What has happened to one (stage, micro-batch) on its rank, as bit flags, and how to say it.
_FLAG = {
    Op.RECV_ACT: 1, Op.FORWARD: 2, Op.SEND_ACT: 4, Op.RECV_GRAD: 8, Op.BACKWARD: 16, Op.SEND_GRAD: 32,
    Op.BACKWARD_WEIGHT: 64,
}
_NAME = {
    Op.BACKWARD_WEIGHT: "weight gradient",
    Op.RECV_ACT: "input",
    Op.FORWARD: "forward",
    Op.SEND_ACT: "output",
    Op.RECV_GRAD: "output gradient",
    Op.BACKWARD: "backward",
    Op.SEND_GRAD: "input gradient",
}
# op -> (flag that must be set before it, what is wrong otherwise); forward/backward checked apart.
_NEEDS = {
    Op.SEND_ACT: (2, "sends the output of micro-batch {mb} before its forward ran."),
    Op.SEND_GRAD: (16, "sends the input gradient of micro-batch {mb} before its backward ran."),
    Op.RECV_GRAD: (2, "receives the gradient of micro-batch {mb} before its forward ran; it can never come."),
    Op.BACKWARD_WEIGHT: (16, "computes the weight gradient of micro-batch {mb} before its backward (B{mb}) ran."),
}


def _check_rank_order(s: Schedule, rank: int, fail: _Failer) -> None:
    """Each forward and backward exactly once, in order, each after the message it consumes."""
    last = s.num_stages - 1
    actions = s.actions[rank]
    done: dict[tuple[int, int | None], int] = {}
    for i, a in enumerate(actions):
        op, stage, mb = a.op, a.stage, a.microbatch
        if op is Op.OPTIMIZER_STEP or op is Op.ALLREDUCE_GRAD:
            continue
        flags, bit = done.get((stage, mb), 0), _FLAG[op]
        if flags & bit:
            before = next(j for j, b in enumerate(actions) if (b.op, b.stage, b.microbatch) == (op, stage, mb))
            raise fail(
                rank, i, f"duplicated {_NAME[op]} of micro-batch {mb} on stage {stage} (already at action {before})."
            )
        if op is Op.FORWARD:
            if stage > 0 and not flags & 1:
                raise fail(rank, i, f"forward of micro-batch {mb} before its input was received (no RA{mb} before it).")
        elif op is Op.BACKWARD:
            if not flags & 2:
                raise fail(rank, i, f"backward of micro-batch {mb} before its forward on stage {stage}.")
            if stage < last and not flags & 8:
                raise fail(
                    rank,
                    i,
                    f"backward of micro-batch {mb} before its output gradient was received (no RG{mb} before it).",
                )
        elif op in _NEEDS and not flags & _NEEDS[op][0]:
            raise fail(rank, i, _NEEDS[op][1].format(mb=mb))
        done[(stage, mb)] = flags | bit
    required: tuple[Op, ...] = (Op.FORWARD,) if OPTIMIZER_POLICY.get(s.name) == "none" else (Op.FORWARD, Op.BACKWARD)
    if s.splits_backward:
        required += (Op.BACKWARD_WEIGHT,)
    for stage in s.stages_of(rank):
        for mb in range(s.microbatch_count):
            if s.owner(stage, mb) != rank:
                continue
            for op in required:
                if not done.get((stage, mb), 0) & _FLAG[op]:
                    raise fail(rank, len(actions), f"never runs the {_NAME[op]} of micro-batch {mb} on stage {stage}.")


def _check_updates(s: Schedule, rank: int, fail: _Failer) -> None:
    """Optimizer steps where the schedule's policy (:data:`OPTIMIZER_POLICY`) puts them."""
    actions = s.actions[rank]
    policy = OPTIMIZER_POLICY.get(s.name, "per_step")
    if policy == "none":
        for i, a in enumerate(actions):
            if a.op in (Op.BACKWARD, Op.RECV_GRAD, Op.SEND_GRAD, Op.OPTIMIZER_STEP):
                raise fail(rank, i, f"{s.name} runs forwards only; remove this {a.op.name.lower()}.")
        return
    layout = s.layout
    replicated = {st for st in s.stages_of(rank) if layout is not None and layout.replicas[st] > 1}
    if policy == "per_backward":
        # Per stage: after a backward, a replicated stage all-reduces, then updates, before computing
        # again. A replica that ran out of minibatches joins the last round with an all-reduce and an
        # update and no backward (it contributes no gradient).
        state: dict[int, str] = {}  # stage -> "backward" | "reduced" (then the update is due)
        last_mb: dict[int, int | None] = {}
        for i, a in enumerate(actions):
            now = state.get(a.stage)
            if a.op is Op.ALLREDUCE_GRAD:
                if now == "reduced":
                    raise fail(rank, i, f"second all-reduce on stage {a.stage} before its optimizer step.")
                state[a.stage] = "reduced"
            elif a.op is Op.OPTIMIZER_STEP:
                if now is None:
                    why = f"{s.name} updates once after every backward"
                    raise fail(rank, i, f"optimizer step on stage {a.stage} without a backward before it; {why}.")
                if now == "backward" and a.stage in replicated:
                    raise fail(
                        rank, i, f"optimizer step on replicated stage {a.stage} before the all-reduce of its gradients."
                    )
                del state[a.stage]
            elif a.op.is_compute and now is not None:
                mb = last_mb.get(a.stage)
                raise fail(
                    rank, i, f"stage {a.stage} computes before the optimizer step that must follow backward {mb}."
                )
            if a.op is Op.BACKWARD:
                state[a.stage], last_mb[a.stage] = "backward", a.microbatch
        for stage in state:
            mb = last_mb.get(stage)
            raise fail(
                rank, len(actions), f"backward of micro-batch {mb} on stage {stage} has no optimizer step after it."
            )
        return
    if policy == "per_minibatch":
        _check_minibatch_updates(s, rank, fail)
        return
    # per_step: one update per stage and training step, after all of that step's backwards (the flush),
    # both halves of each when they are split; on a replicated stage an all-reduce comes between the
    # last backward and the update.
    gradient_ops = (Op.BACKWARD, Op.BACKWARD_WEIGHT) if s.splits_backward else (Op.BACKWARD,)
    backwards_left = Counter((a.stage, a.step) for a in actions if a.op in gradient_ops)
    stepped: set[tuple[int, int]] = set()
    reduced: set[tuple[int, int]] = set()
    for i, a in enumerate(actions):
        key = (a.stage, a.step)
        if a.op in gradient_ops:
            backwards_left[key] -= 1
        elif a.op is Op.ALLREDUCE_GRAD:
            if backwards_left[key] or key in reduced:
                what = f"before {backwards_left[key]} of the backwards of" if backwards_left[key] else "twice in"
                raise fail(rank, i, f"gradient all-reduce of stage {a.stage} {what} training step {a.step}.")
            reduced.add(key)
        elif a.op is Op.OPTIMIZER_STEP:
            if key in stepped:
                raise fail(
                    rank,
                    i,
                    f"second optimizer step of stage {a.stage} in training step {a.step}; "
                    "a flushed schedule steps once per training step.",
                )
            if backwards_left[key]:
                raise fail(
                    rank,
                    i,
                    f"optimizer step of stage {a.stage} before {backwards_left[key]} of the "
                    f"backwards of training step {a.step}; move it after them (the flush).",
                )
            if a.stage in replicated and key not in reduced:
                raise fail(
                    rank,
                    i,
                    f"optimizer step of replicated stage {a.stage} without a gradient all-reduce before it "
                    f"in training step {a.step}; its replicas would drift apart.",
                )
            stepped.add(key)
    for key in sorted({(a.stage, a.step) for a in actions} - stepped):
        raise fail(rank, len(actions), f"stage {key[0]} has no optimizer step in training step {key[1]}.")


def _check_minibatch_updates(s: Schedule, rank: int, fail: _Failer) -> None:
    """PipeDream-2BW: update k of a stage follows the backwards of minibatch k's ``chunks`` micro-batches
    and precedes any backward of a later minibatch; minibatch t's forwards run on version t-1, so they
    come after update t-1 and before update t+1 (which would overwrite it: two versions are kept)."""
    m = s.chunks
    updates: Counter = Counter()  # stage -> updates so far
    backwards: Counter = Counter()  # (stage, minibatch) -> backwards so far
    for i, a in enumerate(s.actions[rank]):
        k = updates[a.stage]
        if a.op is Op.OPTIMIZER_STEP:
            if backwards[(a.stage, k)] != m:
                raise fail(
                    rank, i, f"update {k} of stage {a.stage} after {backwards[(a.stage, k)]} of the {m} backwards of "
                    f"minibatch {k}; 2bw updates once each minibatch's backwards are all done."
                )
            updates[a.stage] += 1
        elif a.op is Op.BACKWARD:
            assert a.microbatch is not None  # checked with the micro-batch ranges
            t = a.microbatch // m
            if t != k:
                raise fail(
                    rank, i, f"backward of micro-batch {a.microbatch} (minibatch {t}) while stage {a.stage} waits to "
                    f"apply update {k} of minibatch {k}; its gradient would go into the wrong update."
                )
            backwards[(a.stage, t)] += 1
        elif a.op is Op.FORWARD:
            assert a.microbatch is not None
            t = a.microbatch // m
            if not t - 1 <= k <= t:
                when, which = ("before", t - 1) if k < t - 1 else ("after", t + 1)
                raise fail(
                    rank, i, f"forward of micro-batch {a.microbatch} (minibatch {t}) {when} update {which} "
                    f"of stage {a.stage}: 2bw runs minibatch t on weight version t-1 and keeps two versions, so its "
                    "forwards come after update t-1 and before update t+1."
                )
    for stage in s.stages_of(rank):
        if updates[stage] != s.minibatches:
            raise fail(
                rank, len(s.actions[rank]),
                f"stage {stage} updates {updates[stage]} times for {s.minibatches} minibatches; 2bw updates once each.",
            )


def _check_collectives(s: Schedule, fail: _Failer) -> None:
    """Every replica of a stage runs the same number of all-reduces: each round has all its members."""
    layout = s.layout
    if layout is None:
        return
    for stage in range(s.num_stages):
        ranks = layout.ranks_of(stage)
        counts = {r: sum(a.op is Op.ALLREDUCE_GRAD for a in s.actions[r]) for r in ranks}
        most = max(counts.values())
        for r, n in counts.items():
            if n != most:
                busiest = max(counts, key=counts.__getitem__)
                raise fail(
                    r,
                    len(s.actions[r]),
                    f"runs {n} gradient all-reduces of stage {stage} but rank {busiest} runs {most}; the "
                    f"all-reduce number {n} would wait forever for this rank. Every replica must join every round.",
                )


def _message(a: Action) -> tuple:
    """What a send carries or a receive expects: (kind, sending stage, micro-batch)."""
    if a.op is Op.SEND_ACT or a.op is Op.SEND_GRAD:
        return (a.op is Op.SEND_ACT, a.stage, a.microbatch)
    return (a.op is Op.RECV_ACT, a.stage - 1 if a.op is Op.RECV_ACT else a.stage + 1, a.microbatch)


def _describe(message: tuple) -> str:
    is_act, stage, mb = message
    return f"{'output' if is_act else 'input gradient'} of stage {stage} micro-batch {mb}"


def _check_links(s: Schedule, fail: _Failer) -> None:
    """Every receive has exactly one send, and the two sides of each link agree on the order."""
    sends: dict[Link, list] = {}
    recvs: dict[Link, list] = {}
    for rank, actions in enumerate(s.actions):
        for i, a in enumerate(actions):
            if a.op in _SEND:
                sends.setdefault((rank, a.peer), []).append((_message(a), rank, i))
            elif a.op in _RECV:
                recvs.setdefault((a.peer, rank), []).append((_message(a), rank, i))
    for link in sorted(set(sends) | set(recvs)):
        out, into = sends.get(link, []), recvs.get(link, [])
        sent = {m for m, _, _ in out}
        for message, rank, i in into:
            if message not in sent:
                why = f"which rank {link[0]} never sends; add the matching send"
                raise fail(rank, i, f"waits for the {_describe(message)}, {why}.")
        received = {m for m, _, _ in into}
        for message, rank, i in out:
            if message not in received:
                why = f"to rank {link[1]}, which never receives it; add the matching receive"
                raise fail(rank, i, f"sends the {_describe(message)} {why}.")
        for (m_out, _, j), (m_in, rank, i) in zip(out, into):
            if m_out != m_in:
                raise fail(
                    rank,
                    i,
                    f"expects the {_describe(m_in)}, but the message arriving next from rank {link[0]} is "
                    f"the {_describe(m_out)} (rank {link[0]}'s action {j}): messages between two ranks arrive "
                    "in the order they were sent, so receive them in that order.",
                )
        if len(out) > len(into):  # the same message twice: one copy is never received
            message, rank, i = out[len(into)]
            raise fail(rank, i, f"sends the {_describe(message)} again; rank {link[1]} receives it once.")
        if len(into) > len(out):
            message, rank, i = into[len(out)]
            raise fail(rank, i, f"receives the {_describe(message)} again; rank {link[0]} sends it once.")


def _check_progress(s: Schedule, fail: _Failer) -> None:
    placement = fail.placement
    stuck = {r: i for r, i in enumerate(placement.stuck) if i is not None}
    if not stuck:
        return
    collectives = placement.collectives

    def waits_on(r: int) -> int:
        a = s.actions[r][stuck[r]]
        if a.op is Op.ALLREDUCE_GRAD:
            return collectives.missing(s, r, stuck[r])[0]
        assert a.peer is not None  # a receive names its peer (checked first)
        return a.peer

    def waiting(r: int, i: int) -> str:
        a = s.actions[r][i]
        if a.op is Op.ALLREDUCE_GRAD:
            missing = ", ".join(map(str, collectives.missing(s, r, i)))
            return f"rank {r} at action {i} ({a}) waits for rank(s) {missing} to join the all-reduce of stage {a.stage}"
        return f"rank {r} at action {i} ({a}) waits for the {_describe(_message(a))} from rank {a.peer}"

    # Follow "waits for" from the first stuck rank until a rank repeats: that is the cycle to break.
    path, rank = [], min(stuck)
    while rank not in path and rank in stuck:
        path.append(rank)
        rank = waits_on(rank)
    cycle = path[path.index(rank) :] if rank in path else path[-1:]
    waits = "; ".join(waiting(r, i) for r, i in sorted(stuck.items()))
    first = min(cycle)
    raise fail(
        first,
        stuck[first],
        f"deadlock: ranks {', '.join(map(str, sorted(cycle)))} wait for each other forever ({waits}). "
        "Reorder the actions so that each send comes before the receive it unblocks.",
    )
