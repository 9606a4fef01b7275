"""Generation as a schedule: the decode ring, its validator and its bubble.

Greedy decoding of ``lanes`` micro-batches over ``num_stages`` stages. Step 0 of a lane is its prefill (the
prompt through every stage, the first new token on the last stage); step t >= 1 feeds the token of step t-1 back
in. The last stage sends each lane's new token to the first (the link last -> first that closes the ring), so
while one lane's token travels back, the other lanes occupy the other stages: with ``lanes >= num_stages`` every
stage is busy after the first round, and the bubble is (P-1) / (M*T + P-1) for M lanes of T tokens.

Every rank runs (step, lane) in the same order, step-major: step 0 of lanes 0..M-1, then step 1 of lanes
0..M-1, ... A lane that stops early (each of its sequences reached the end-of-sequence token, or
``max_new_tokens`` ran out) retires: the last stage's message after its final forward says so, the first stage
passes a notice (no forward) along the stages at the next step, and from then on no rank spends anything on the
lane. ``decode_ring(p, m, new_tokens=[3, 5])`` builds the actions for lanes that made 3 and 5 tokens; the runtime
(``runtime/execution/decode.py``) follows the same order and records what it ran, so a test can compare the two.

Actions: ``FORWARD`` with ``microbatch`` = lane and ``step`` = decode step; ``RECV_ACT``/``SEND_ACT`` for the
hidden states between neighbouring stages and for the token (or retire notice) from the last stage to the
first (``SEND_ACT`` on the last stage, ``RECV_ACT`` on the first, peers closing the ring). The retire pass is a
``RECV_ACT``/``SEND_ACT`` pair without a ``FORWARD`` at the lane's step ``new_tokens[lane]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_pipedream.schedule.actions import Action, Link, Op, Schedule
from lightning_pipedream.schedule.check import OWN_RULES, ScheduleError, place, render_grid

DECODE = "decode"


def _count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    return value


def decode_ring(num_stages: int, lanes: int, new_tokens: int | Sequence[int]) -> Schedule:
    """Every rank's actions for greedy decoding of ``lanes`` micro-batches on ``num_stages`` stages.

    ``new_tokens``: the tokens each lane generates (one number for all, or one per lane). A lane with k tokens runs
    k forwards on every stage (steps 0..k-1), then its retire pass at step k.
    """
    p, m = _count("num_stages", num_stages), _count("lanes", lanes)
    tokens = [new_tokens] * m if isinstance(new_tokens, int) else list(new_tokens)
    if len(tokens) != m:
        raise ValueError(f"new_tokens lists {len(tokens)} lanes but lanes={m}; give one count per lane or one for all.")
    for k in tokens:
        _count("new_tokens", k)
    last = p - 1
    actions: list[list[Action]] = [[] for _ in range(p)]
    for t in range(max(tokens) + 1):
        for lane in range(m):
            k = tokens[lane]
            if t > k:
                continue
            for s in range(p):
                row = actions[s]
                if p == 1:  # the token stays on the one rank: nothing travels
                    if t < k:
                        row.append(Action(Op.FORWARD, 0, lane, step=t))
                    continue
                if s == 0 and t > 0:  # the token of step t-1 (or the news that the lane is done)
                    row.append(Action(Op.RECV_ACT, 0, lane, last, t))
                elif s > 0:
                    row.append(Action(Op.RECV_ACT, s, lane, s - 1, t))
                if t < k:
                    row.append(Action(Op.FORWARD, s, lane, step=t))
                if s < last:
                    row.append(Action(Op.SEND_ACT, s, lane, s + 1, t))
                elif t < k:
                    row.append(Action(Op.SEND_ACT, s, lane, 0, t))
    return Schedule(DECODE, p, p, m, tuple(tuple(row) for row in actions))


def ring_bubble(num_stages: int, lanes: int, new_tokens: int) -> float:
    """The idle share of the stages' time in a ring of equal stages and free links: (P-1)/(M*T+P-1) when M >= P.

    With M < P a token waits (P - M) forward times before it can enter again: each step takes P stage-times
    instead of M, so the share is 1 - M*T / (P*(T-1) + M + P - 1).
    """
    p, m, t = num_stages, lanes, new_tokens
    busy = m * t
    span = busy + p - 1 if m >= p else p * (t - 1) + m + p - 1
    return 1 - busy / span


def validate_ring(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless a decode ring is sound.

    Sound means: one stage per rank; on every stage each lane's forwards run at steps 0..k-1 in order, once each,
    each after its input (the previous stage's output; on the first stage from step 1 on, the last stage's token
    of the step before), with the same k on every stage; each forward's output is sent on (the last stage's
    token to the first); a retire pass (receive and pass on, no forward) follows each lane's last token on every
    stage and nothing runs on the lane after it; every message has one receive, in the order sent, naming the
    same (sending stage, lane, step); and the blocking simulation finishes, so no rank waits forever.
    """
    s = schedule
    p, last = s.num_stages, s.num_stages - 1
    if s.num_ranks != p or len(s.actions) != p or s.replicas is not None:
        raise ScheduleError(f"A decode ring runs one stage per rank; this one has {p} stages on {s.num_ranks} ranks.")

    def fail(rank: int, index: int, problem: str) -> ScheduleError:
        acts = s.actions[rank]
        what = f"({acts[index]} step {acts[index].step})" if index < len(acts) else "(end of its list)"
        return ScheduleError(f"{s.name} ring, {p} stages x {s.chunks} lanes: rank {rank}, action {index} {what}: "
                             f"{problem}\n{render_grid(s)}")

    Message = tuple[int, int, int]  # (sending stage, lane, the step the sender ran)
    sends: dict[Link, list[tuple[Message, int, int]]] = {}
    recvs: dict[Link, list[tuple[Message, int, int]]] = {}
    tokens: list[dict[int, int]] = []  # per stage: lane -> forwards (the lane's tokens)
    for rank, acts in enumerate(s.actions):
        done: dict[int, int] = {}
        received: set[tuple[int, int]] = set()  # (lane, step) whose input arrived
        sent: set[tuple[int, int]] = set()
        retired: dict[int, int] = {}  # lane -> the step of its retire pass
        for i, a in enumerate(acts):
            if a.stage != rank:
                raise fail(rank, i, f"stage {a.stage} does not live on rank {rank} (one stage per rank).")
            if not isinstance(a.microbatch, int) or not 0 <= a.microbatch < s.chunks:
                raise fail(rank, i, f"lane {a.microbatch!r} is out of range 0..{s.chunks - 1}.")
            lane, t = a.microbatch, a.step
            if lane in retired and (t > retired[lane] or a.op is Op.FORWARD):
                raise fail(rank, i, f"lane {lane} retired at step {retired[lane]}; nothing may run on it after that.")
            if a.op is Op.FORWARD:
                if t != done.get(lane, 0):
                    step = done.get(lane, 0)
                    raise fail(rank, i, f"forward of lane {lane} at step {t}, but its next step is {step}.")
                if p > 1 and (rank > 0 or t > 0) and (lane, t) not in received:
                    raise fail(rank, i, f"forward of lane {lane} step {t} before its input was received.")
                done[lane] = t + 1
            elif a.op is Op.RECV_ACT:
                want = last if rank == 0 else rank - 1
                if a.peer != want:
                    raise fail(rank, i, f"peer should be rank {want} (the ring's previous stage), not {a.peer}.")
                if rank == 0 and t == 0:
                    raise fail(rank, i, "the first stage receives nothing at step 0: the prompt is its input.")
                if (lane, t) in received:
                    raise fail(rank, i, f"receives lane {lane} step {t} twice.")
                received.add((lane, t))
                made = t - 1 if rank == 0 else t  # the token that comes back was made at the step before
                recvs.setdefault((want, rank), []).append(((want, lane, made), rank, i))
                if rank == last and t == done.get(lane, 0) and not any(
                    b.op is Op.FORWARD and (b.microbatch, b.step) == (lane, t) for b in acts[i + 1:]
                ):
                    retired[lane] = t  # the notice reached the last stage
            elif a.op is Op.SEND_ACT:
                want = (rank + 1) % p
                if a.peer != want:
                    raise fail(rank, i, f"peer should be rank {want} (the ring's next stage), not {a.peer}.")
                if (lane, t) in sent:
                    raise fail(rank, i, f"sends lane {lane} step {t} twice.")
                if done.get(lane, 0) != t + 1:  # no forward of this step: a retire notice, passed on
                    if rank == last:
                        raise fail(rank, i, f"sends the token of lane {lane} step {t} before its forward ran.")
                    if (lane, t) not in received and not (rank == 0 and t > 0):
                        raise fail(rank, i, f"sends lane {lane} step {t} without its forward or a notice to pass on.")
                    if rank == 0 and (lane, t) not in received:
                        raise fail(rank, i, f"passes on the retire notice of lane {lane} before receiving it.")
                    retired[lane] = t
                sent.add((lane, t))
                sends.setdefault((rank, want), []).append(((rank, lane, t), rank, i))
            else:
                raise fail(rank, i, f"a decode ring has forwards, sends and receives only, not {a.op.name}.")
        for lane, k in done.items():
            if p > 1 and rank < last and (lane, k - 1) not in sent:
                raise fail(rank, len(acts), f"never sends the output of lane {lane} step {k - 1}.")
            if p > 1 and retired.get(lane) != k:
                raise fail(rank, len(acts), f"lane {lane} made {k} tokens but has no retire pass at step {k}: "
                                            "the stages would wait for it forever.")
        tokens.append(done)
    if any(d != tokens[0] for d in tokens):
        raise ScheduleError(f"{s.name} ring: the stages run different numbers of steps per lane ({tokens}); every "
                            "stage must run each of a lane's steps.")
    if set(tokens[0]) != set(range(s.chunks)):
        raise ScheduleError(f"{s.name} ring: lanes {sorted(set(range(s.chunks)) - set(tokens[0]))} never run.")
    for link in sorted(set(sends) | set(recvs), key=str):
        out, into = sends.get(link, []), recvs.get(link, [])
        for (m_out, _, j), (m_in, rank, i) in zip(out, into):
            if m_out != m_in:
                raise fail(rank, i, f"expects stage {m_in[0]} lane {m_in[1]} step {m_in[2]}, but the message "
                                    f"arriving next from rank {link[0]} is lane {m_out[1]} step {m_out[2]} (its action "
                                    f"{j}): messages between two ranks arrive in the order they were sent.")
        if len(out) != len(into):
            extra, rank, i = out[len(into)] if len(out) > len(into) else into[len(out)]
            end = "send" if len(out) > len(into) else "receive"
            raise fail(rank, i, f"lane {extra[1]} step {extra[2]} has a {end} on the link {link[0]} -> {link[1]} "
                                "without its other end.")
    for rank, index in enumerate(place(s).stuck):
        if index is not None:
            raise fail(rank, index, "deadlock: this receive waits forever. Run (step, lane) in the same order on "
                                    "every rank.")


OWN_RULES[DECODE] = validate_ring  # validate() and simulate() check rings by these rules


def simulate_ring(num_stages: int, lanes: int, new_tokens: int, forward_s: float | Sequence[float], *,
                  activation_bytes: float = 0, token_bytes: float = 0, bandwidth: float = math.inf,
                  latency: float = 0.0) -> dict:
    """The decode ring on the simulator's clock: its makespan, bubble and tokens per second per lane's sequence.

    ``forward_s[s]`` is stage s's time for one lane's decode step (the prefill is timed as one more step: with
    short prompts it costs about as much); ``activation_bytes`` what a stage sends on, ``token_bytes`` what the last
    stage sends back. Returns ``{"makespan_s", "bubble_fraction", "steps_per_s"}``, ``steps_per_s`` being lane-steps
    (one new token for each sequence of a lane) per second, so tokens/s = steps_per_s x sequences per lane.
    """
    from lightning_pipedream.schedule.simulate import simulate

    schedule = decode_ring(num_stages, lanes, new_tokens)
    sizes = [activation_bytes] * (num_stages - 1) + [token_bytes]
    result = simulate(schedule, forward_s, 0.0, activation_bytes=sizes, bandwidth=bandwidth, latency=latency)
    return {"makespan_s": result.makespan, "bubble_fraction": result.bubble_fraction,
            "steps_per_s": lanes * new_tokens / result.makespan if result.makespan > 0 else math.inf}
