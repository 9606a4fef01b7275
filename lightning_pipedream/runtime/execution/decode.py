"""Greedy decoding around the pipeline's ring: lanes of sequences, per-stage caches, a token back to the first stage.

:func:`run_decode_ring` runs on every rank of a pipeline, in the order of
:func:`lightning_pipedream.schedule.generation.decode_ring` (step-major over the lanes; the last stage sends each
lane's token back to the first; a lane whose sequences all ended retires with a notice around the ring), and
records the actions it ran, so a test compares them with the schedule the validator checked.

:class:`StageSlice` is one stage's share of a model whose blocks sit in one ``nn.ModuleList`` or
``nn.Sequential``: it calls the whole model's forward with the blocks of other stages skipped (each returns its
input), the received hidden states put in front of its first own block, and the forward stopped after its last
own block. Everything outside the blocks (embeddings, masks, rotary tables) is recomputed locally on every stage;
only the hidden states travel. Hugging Face models keep a cache per lane holding only this stage's layers
(``use_cache=True``: the keys and values of its own attention layers); a model without a cache recomputes the
whole prefix every step (:attr:`StageSlice.uses_cache` says which).

Recurrent models keep each stage's LSTM states per lane instead: a module that runs its LSTMs through
:func:`carried_lstm` and says so (``carries_decode_state = True``) is fed only the new token at each step, each of
its LSTMs continuing from the (h, c) this stage kept for the lane; an LSTM over the unchanging source (an encoder)
runs once per lane (``source=True``). Outside decoding :func:`carried_lstm` is the LSTM's plain call.
"""

from __future__ import annotations

import contextvars
import inspect
import itertools
import sys
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipedream.schedule.actions import Action, Op


class _Stopped(Exception):  # noqa: N818 - not an error: the forward ends at this stage's last block
    def __init__(self, hidden: Any) -> None:
        self.hidden = hidden


class _Skip(nn.Module):
    """Another stage's block: hands its hidden states on unchanged."""

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return hidden


class _Inject(nn.Module):
    """This stage's first block, fed the hidden states received from the previous stage."""

    def __init__(self, block: nn.Module, slot: list) -> None:
        super().__init__()
        self.block, self.slot = block, slot

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return self.block(self.slot[0], *args, **kwargs)


class _Stop(nn.Module):
    """The next stage's first block: ends the forward with the hidden states it would get."""

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        raise _Stopped(hidden)


_LANE_STATE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("lane_state", default=None)


@contextmanager
def _lane_state(store: dict | None) -> Iterator[None]:
    token = _LANE_STATE.set(store)
    try:
        yield
    finally:
        _LANE_STATE.reset(token)


def carried_lstm(lstm: nn.Module, x: Tensor, *, source: bool = False) -> Tensor:
    """``lstm(x)[0]``, except while :func:`generate_ids` decodes a model that carries its LSTM states: then ``x``
    holds only the positions new since this lane's last step, and the LSTM continues from the (h, c) this stage
    kept for the lane; with ``source=True`` (an input that does not change while decoding: the source sentence)
    the output of the lane's first step is reused."""
    store = _LANE_STATE.get()
    if store is None:
        return lstm(x)[0]
    if source:
        if lstm not in store:
            store[lstm] = lstm(x)[0]
        return store[lstm]
    out, state = lstm(x, store.get(lstm))
    store[lstm] = state
    return out


def has_carried_state(lstm: nn.Module) -> bool:
    """Whether ``lstm`` has run for this lane already (its input then holds only the new positions)."""
    store = _LANE_STATE.get()
    return store is not None and lstm in store


def carries_state(model: nn.Module) -> bool:
    """Whether ``model`` runs its LSTMs through :func:`carried_lstm` (a submodule with ``carries_decode_state``)."""
    return any(getattr(m, "carries_decode_state", False) for m in model.modules())


def find_blocks(model: nn.Module) -> tuple[str, nn.Module]:
    """The model's stack of blocks: its ``nn.ModuleList`` or ``nn.Sequential`` with the most parameters."""
    best: tuple[int, str, nn.Module] | None = None
    for name, sub in model.named_modules():
        if isinstance(sub, (nn.ModuleList, nn.Sequential)) and len(sub) > 1:
            size = sum(p.numel() for p in sub.parameters())
            if best is None or size > best[0]:
                best = (size, name, sub)
    if best is None:
        raise ValueError(f"generate() splits a model at its blocks, but {type(model).__name__} has no nn.ModuleList or "
                         "nn.Sequential of two or more blocks; keep the decoder's layers in one.")
    return best[1], best[2]


def even_split(blocks: int, stages: int) -> list[int]:
    """Blocks per stage, as even as can be, the earlier stages taking one more."""
    if blocks < stages:
        raise ValueError(f"generate() needs at least one block per stage: {blocks} blocks for {stages} stages.")
    return [blocks // stages + (1 if s < blocks % stages else 0) for s in range(stages)]


def split_of_owners(model: nn.Module, owners: Mapping[str, Collection[int]], num_stages: int,
                    blocks_name: str | None = None) -> list[int]:
    """Blocks per stage of a model whose stages the pipeline split from its graph (``owners``: every parameter's
    qualified name, aliases included -> the stages that hold it), so that each rank decodes with the blocks it holds.

    Refused, on every rank alike (each knows the whole split), where a stage's share is not whole blocks: the split
    cuts inside a block, a stage holds no whole block, or a tensor outside the blocks (embeddings, final norm, head)
    sits on a middle stage; the words say where to split instead.
    """
    name, blocks = find_blocks(model) if blocks_name is None else (blocks_name, model.get_submodule(blocks_name))
    held = [sorted({s for n, _ in block.named_parameters(remove_duplicate=False)
                    for s in owners.get(f"{name}.{i}.{n}", ())}) for i, block in enumerate(blocks)]
    what = f"{type(model).__name__}'s {name} ({len(blocks)} blocks)"
    # where each stage would begin if every cut block went wholly to the later stage that holds part of it
    starts = [min((i for i, stages in enumerate(held) if s in stages), default=-1) for s in range(1, num_stages)]
    if any(b <= a for a, b in zip([0] + starts, starts)):
        even = even_split(len(blocks), num_stages) if len(blocks) >= num_stages else [1] * num_stages
        starts = [sum(even[:s]) for s in range(1, num_stages)]
    fix = (f"Split the model at block boundaries, e.g. PipeDreamStrategy(split_points="
           f"{[f'{name}.{i}' for i in starts]}), so that each stage holds whole blocks.")
    for i, stages in enumerate(held):
        if len(stages) > 1:
            raise ValueError(f"generate() runs each stage's own blocks of {what}, the stages the model was split "
                             f"into for training, but that split cuts inside block {name}.{i}: stages {stages} each "
                             f"hold part of it. {fix}")
    stage_of = [stages[0] if stages else 0 for stages in held]
    counts = [stage_of.count(s) for s in range(num_stages)]
    if stage_of != sorted(stage_of) or 0 in counts:
        raise ValueError(f"generate() runs each stage's own blocks of {what}, but in the split the model was trained "
                         f"with, stage {counts.index(0) if 0 in counts else 0} holds no whole block (blocks per "
                         f"stage: {counts}); each stage needs at least one. {fix}")
    ends = {0, num_stages - 1}
    outside = {n: sorted(owners.get(n, ())) for n, _ in model.named_parameters(remove_duplicate=False)
               if not n.startswith(name + ".") and not set(owners.get(n, ())) <= ends}
    if outside:
        n, stages = next(iter(outside.items()))
        raise ValueError(f"generate() recomputes what lies outside {what} (embeddings before the blocks, the final "
                         f"norm and head after them) on the first and last stages, but {n} is held by stages "
                         f"{stages}. {fix}")
    return counts


class _Absent(nn.Module):
    """A module outside the blocks that this stage does not hold (built on the meta device; its weights are another
    stage's). An embedding gives zeros of its output's shape: on a stage after the first, the hidden states received
    replace its output at the stage's first block. Any other such module must not run here."""

    def __init__(self, name: str, module: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.qualified, self.kind, self.device = name, type(module).__name__, device
        self.width = module.embedding_dim if isinstance(module, nn.Embedding) else None
        self.dtype = module.weight.dtype if isinstance(module, nn.Embedding) else None

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.width is None:
            raise ValueError(f"generate() ran {self.qualified} ({self.kind}) on a stage that does not hold it (its "
                             "tensors are on the meta device here): a stage recomputes only embeddings outside the "
                             "blocks it holds. Keep such modules inside the model's blocks, or on the stage that "
                             "runs them.")
        return torch.zeros(*x.shape, self.width, dtype=self.dtype, device=self.device)


@contextmanager
def standing_in(model: nn.Module, blocks: nn.Module, device: torch.device) -> Iterator[None]:
    """While this stage decodes a model built per stage (some tensors on the meta device): outside ``blocks``,
    non-persistent buffers still on the meta device (a rotary embedding's ``inv_freq``: computed from the config,
    in no checkpoint) are computed here, and every other module holding meta tensors is stood in for by
    :class:`_Absent` (no weights); all is put back after. Nothing that another stage holds is materialized here."""
    from lightning_pipedream.runtime.stages.materialize import materialize

    inside = {id(m) for m in blocks.modules()}
    computed: dict[nn.Module, dict[str, Tensor]] = {}
    absent: list[tuple[nn.Module, str, str, nn.Module]] = []
    for name, sub in model.named_modules():
        if id(sub) in inside:
            continue
        own = [(leaf, t, leaf in sub._buffers and leaf in sub._non_persistent_buffers_set)
               for table in (sub._parameters, sub._buffers) for leaf, t in table.items() if t is not None]
        if not any(t.is_meta for _, t, _ in own):
            continue
        if all(t.is_meta and derived for _, t, derived in own):
            computed[sub] = {leaf: t for leaf, t, _ in own}
        elif not any(id(m) in inside for m in sub.modules()) and name:
            parent, _, leaf = name.rpartition(".")
            absent.append((model.get_submodule(parent), leaf, name, sub))
        else:
            raise ValueError(f"generate() runs {name or type(model).__name__} on every stage (it holds the blocks), "
                             "but some of its own tensors are on the meta device on this stage. Keep the tensors "
                             "outside the blocks in submodules (an embedding, a norm, a head).")
    names = {f"{name}.{leaf}" if name else leaf for name, sub in model.named_modules() if sub in computed
             for leaf in computed[sub]}
    for parent, leaf, name, sub in absent:
        parent._modules[leaf] = _Absent(name, sub, device)
    try:
        if names:
            materialize(model, device, 0, names=names)
        yield
    finally:
        for parent, leaf, _, sub in absent:
            parent._modules[leaf] = sub
        for sub, tensors in computed.items():
            sub._buffers.update(tensors)


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in evaluation mode (no dropout, batch-norm statistics left alone) while it decodes: called after
    ``fit`` its modules are in training mode; each gets its own mode back after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _hf_cache_class() -> type | None:
    try:
        from transformers import DynamicCache
    except ImportError:
        return None

    class StageCache(DynamicCache):
        """A DynamicCache holding only this stage's layers: the lengths it reports are those of its first own
        layer (Hugging Face sizes masks and positions by layer 0, which lives on stage 0)."""

        own_first = 0

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return super().get_seq_length(self.own_first if layer_idx == 0 else layer_idx)

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
            return super().get_mask_sizes(query_length, self.own_first if layer_idx == 0 else layer_idx)

    return StageCache


def is_hf_model(model: nn.Module) -> Any:
    """The Hugging Face ``PreTrainedModel`` inside ``model`` (itself or a submodule), or None."""
    transformers = sys.modules.get("transformers")  # a Hugging Face model imported it; importing it costs seconds
    if transformers is None:
        return None
    PreTrainedModel = transformers.PreTrainedModel  # noqa: N806
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


@dataclass
class StageSlice:
    """Stage ``stage`` of ``num_stages``: blocks ``start .. stop - 1`` of ``blocks`` (see the module's text).

    ``call(input_ids, attention_mask, position_ids, cache, rows)`` runs the whole model's forward on the rows
    ``rows`` (a slice) of the batch and returns its logits (the user's forward, passing the keyword arguments on to a
    Hugging Face model, or the model itself). ``rows[lane]`` is each lane's slice of the batch.
    """

    call: Callable[..., Any]
    blocks: nn.Module
    start: int
    stop: int
    stage: int
    num_stages: int
    hf: Any = None  # the Hugging Face model, whose caches this stage keeps per lane; None: recompute the prefix
    recurrent: bool = False  # the model carries its LSTM states (carried_lstm): this stage keeps them per lane
    caches: dict[int, Any] = field(default_factory=dict)
    rows: dict[int, slice] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)  # positions each lane's carried states have read

    @property
    def uses_cache(self) -> bool:
        return self.hf is not None or self.recurrent

    def state_bytes(self) -> dict[nn.Module, int]:
        """Bytes of the LSTM states and source outputs kept per module, over every lane (own layers only)."""
        sizes: dict[nn.Module, int] = {}
        for store in self.caches.values() if self.recurrent else ():
            for module, kept in store.items():
                tensors = kept if isinstance(kept, tuple) else (kept,)
                sizes[module] = sizes.get(module, 0) + sum(t.numel() * t.element_size() for t in tensors)
        return sizes

    def cache_bytes(self) -> dict[int, int]:
        """Bytes of cached keys and values per layer index, over every lane (only own layers have any)."""
        sizes: dict[int, int] = {}
        for cache in self.caches.values() if not self.recurrent else ():
            for i, layer in enumerate(getattr(cache, "layers", [])):
                for name in ("keys", "values"):
                    t = getattr(layer, name, None)
                    if isinstance(t, Tensor):
                        sizes[i] = sizes.get(i, 0) + t.numel() * t.element_size()
        return sizes

    def forward(self, lane: int, ids: Tensor, mask: Tensor, received: Any) -> Any:
        """This stage's forward of ``lane``: ``ids`` and ``mask`` are the lane's whole sequences so far (every rank
        knows them); with a cache only the new positions run. Returns the hidden states to send on, or on the last
        stage the logits of the last position."""
        new = ids
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        kwargs: dict[str, Any] = {}
        store: dict | None = None
        if self.recurrent:
            store = self.caches.setdefault(lane, {})
            new, positions = ids[:, self.seen.get(lane, 0):], positions[:, self.seen.get(lane, 0):]
            self.seen[lane] = ids.shape[1]
        elif self.hf is not None:
            cache = self.caches.get(lane)
            if cache is None:
                cache_class = _hf_cache_class()
                assert cache_class is not None
                cache = cache_class(config=self.hf.config)
                cache.own_first = self.start
                self.caches[lane] = cache
            seen = cache.get_seq_length()
            new, positions = ids[:, seen:], positions[:, seen:]
            kwargs = {_cache_keyword(self.hf): cache, "use_cache": True}
        slot = [received]
        saved = list(self.blocks)
        try:
            for i in range(len(saved)):
                if i < self.start:
                    self.blocks[i] = _Skip()
                elif i == self.start and self.stage > 0:
                    self.blocks[i] = _Inject(saved[i], slot)
                elif i == self.stop:  # the next stage's first block (the last stage has none)
                    self.blocks[i] = _Stop()
            with torch.no_grad(), _lane_state(store):
                try:
                    out = self.call(new, mask, positions, kwargs, self.rows.get(lane, slice(None)))
                except _Stopped as stopped:
                    return stopped.hidden
        finally:
            for i, block in enumerate(saved):
                self.blocks[i] = block
        logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
        return logits[:, -1]


def _cache_keyword(hf: nn.Module) -> str:
    names = inspect.signature(hf.forward).parameters
    return "cache" if "cache" in names else "past_key_values"


@dataclass
class Lane:
    """One micro-batch of sequences: its ids so far (left-padded prompts, then new tokens), attention mask, and on
    the last stage the tokens made and which sequences have ended."""

    ids: Tensor
    mask: Tensor
    finished: Tensor  # bool per sequence (kept on the last stage)
    tokens: list[Tensor] = field(default_factory=list)  # the new tokens (kept on the last stage)

    def append(self, token: Tensor) -> None:
        """One more position: ``token`` (its value matters on the first stage only), attended to."""
        self.ids = torch.cat([self.ids, token.view(-1, 1).to(self.ids.dtype)], dim=1)
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)


@dataclass
class Sampler:
    """Sampling instead of the argmax: ``softmax(logits / temperature)`` over the ``top_k`` likeliest tokens (all if
    None), drawn by the Gumbel-max trick with noise that depends only on ``seed``, the step and the sequence's row
    in the whole batch: the same tokens for any lane count, any number of stages, and on one device."""

    seed: int
    temperature: float = 1.0
    top_k: int | None = None
    batch: int = 1  # the whole batch's sequences (the noise is drawn for all, each lane takes its rows)

    def __call__(self, logits: Tensor, rows: slice, step: int) -> Tensor:
        logits = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        g = torch.Generator().manual_seed((self.seed + 1_000_003 * step) % 2**63)
        noise = torch.rand(self.batch, logits.shape[-1], generator=g)[rows].to(logits.device)
        return (logits - torch.log(-torch.log(noise.clamp_min(1e-20)))).argmax(-1)


def sampler(generator: torch.Generator | None, temperature: float, top_k: int | None, batch: int) -> Sampler:
    """A :class:`Sampler` whose seed is drawn from ``generator`` (seeded alike on every rank, it draws alike and
    stays in step), with the arguments checked."""
    if not isinstance(generator, torch.Generator):
        raise ValueError("do_sample=True needs generator=torch.Generator().manual_seed(seed), seeded alike on every "
                         f"rank (the pipeline's ranks must draw the same tokens), got {generator!r}.")
    if not isinstance(temperature, (int, float)) or temperature <= 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}; for greedy decoding pass "
                         "do_sample=False.")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None (every token), got {top_k!r}.")
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return Sampler(seed, float(temperature), top_k, batch)


def run_decode_ring(stage: StageSlice, transport: Any, lanes: list[Lane], *, max_new_tokens: int,
                    eos_token_id: int | None, pad_token_id: int, trace: list[Action] | None = None,
                    pick: Callable[[Tensor, slice, int], Tensor] | None = None) -> list[Tensor]:
    """Greedy decoding of ``lanes`` through the ring; every rank returns each lane's new tokens (batch x k, k the
    lane's steps: a lane stops once all its sequences have ended; an ended sequence gets ``pad_token_id``).

    ``transport`` sends tensor trees between the pipeline's ranks (peers are stage indices); ``trace`` collects
    the actions this rank ran, as :func:`~lightning_pipedream.schedule.generation.decode_ring` writes them.
    ``pick(logits, rows, step)`` chooses the tokens on the last stage (a :class:`Sampler`; the argmax if None).
    """
    p, s = stage.num_stages, stage.stage
    last = p - 1
    record = trace.append if trace is not None else (lambda a: None)
    retired: set[int] = set()
    for t in range(max_new_tokens + 1):
        for m, lane in enumerate(lanes):
            if m in retired:
                continue
            channel = ("decode", m)
            received: Any = None
            if p > 1 and (s > 0 or t > 0):
                peer = last if s == 0 else s - 1
                received = transport.recv(peer, channel=channel)
                record(Action(Op.RECV_ACT, s, m, peer, t))
                if isinstance(received, dict) and ("retire" in received or bool(received.get("done", False))):
                    if s < last:
                        transport.send({"retire": torch.ones(1)}, s + 1, channel=channel)
                        record(Action(Op.SEND_ACT, s, m, s + 1, t))
                    retired.add(m)
                    continue
                if s == 0:  # the token of step t-1 from the last stage
                    lane.append(received["token"])
                    received = None
            if t > 0 and s > 0:  # a new position; its value lives on the first stage
                lane.append(torch.zeros(lane.ids.shape[0], dtype=lane.ids.dtype))
            out = stage.forward(m, lane.ids, lane.mask, received)
            record(Action(Op.FORWARD, s, m, step=t))
            if s < last:
                transport.send(out, s + 1, channel=channel)
                record(Action(Op.SEND_ACT, s, m, s + 1, t))
                continue
            token = out.argmax(-1) if pick is None else pick(out, stage.rows.get(m, slice(None)), t)
            token = torch.where(lane.finished, torch.full_like(token, pad_token_id), token)
            if eos_token_id is not None:
                lane.finished = lane.finished | (token == eos_token_id)
            lane.tokens.append(token)
            done = bool(lane.finished.all()) or t + 1 >= max_new_tokens
            if p == 1:
                lane.append(token)
                if done:
                    retired.add(m)
                continue
            transport.send({"token": token, "done": torch.tensor(done)}, 0, channel=channel)
            record(Action(Op.SEND_ACT, s, m, 0, t))
        if len(retired) == len(lanes):
            break
    # Every rank gets the tokens: from the last stage to the first, then down the stages (the ring's own links).
    made = [torch.stack(lane.tokens, dim=1) for lane in lanes] if s == last else None
    if p > 1:
        if s != last:
            made = transport.recv(last if s == 0 else s - 1, channel="decoded")
        if s != last - 1:
            transport.send(made, (s + 1) % p, channel="decoded")
        transport.wait_all()
    assert made is not None
    return list(made)


def generate_ids(model: nn.Module, call: Callable[..., Any], input_ids: Tensor, attention_mask: Tensor | None, *,
                 max_new_tokens: int, eos_token_id: int | None, pad_token_id: int | None, micro_batches: int,
                 stage: int = 0, num_stages: int = 1, split: list[int] | None = None, transport: Any = None,
                 trace: list[Action] | None = None, slices: list[StageSlice] | None = None,
                 blocks: nn.Module | None = None, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> Tensor:
    """Greedy decoding (or sampling: ``do_sample``, see :class:`Sampler`) of ``input_ids`` (left-padded;
    ``attention_mask`` 0 on the padding) on stage ``stage`` of ``num_stages``; returns the prompts followed by the
    new tokens, as Hugging Face's ``generate`` does (padded with ``pad_token_id`` after a sequence's end, up to the
    longest generation of the batch).

    The batch is split into ``micro_batches`` lanes along dim 0; ``split`` gives the blocks per stage (even by
    default) of ``blocks`` (default: :func:`find_blocks`). ``slices`` receives this rank's :class:`StageSlice`
    (for its cache's bytes).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}.")
    if pad_token_id is None:
        if eos_token_id is None:
            raise ValueError("generate() needs pad_token_id (or eos_token_id, used as the pad): the token that fills "
                             "a sequence after it ended.")
        pad_token_id = eos_token_id
    meta = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    if meta and num_stages == 1:
        raise ValueError("generate() on one device runs the whole module, but some of its tensors are on the meta "
                         "device (a model built per stage holds only its stage's). Generate under the "
                         "PipeDreamStrategy that built it (every rank calling generate()), or materialize the whole "
                         "module first.")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    batch = input_ids.shape[0]
    if not isinstance(micro_batches, int) or not 1 <= micro_batches <= batch:
        raise ValueError(f"micro_batches must be an integer in 1..{batch} (the batch's sequences), got "
                         f"{micro_batches!r}.")
    if blocks is None:
        _, blocks = find_blocks(model)
    split = even_split(len(blocks), num_stages) if split is None else split
    start = sum(split[:stage])
    for i in range(start, start + split[stage]) if meta else ():
        if any(t.is_meta for t in itertools.chain(blocks[i].parameters(), blocks[i].buffers())):
            raise ValueError(f"generate() runs blocks {start}..{start + split[stage] - 1} on stage {stage}, but block "
                             f"{i} is on the meta device on this rank (built per stage, it holds other blocks): "
                             f"the decode ring's split {split} is not the one the stages were built with.")
    hf = is_hf_model(model)
    this = StageSlice(call, blocks, start, start + split[stage], stage, num_stages, hf=hf,
                      recurrent=hf is None and carries_state(model))
    if slices is not None:
        slices.append(this)
    sizes = [batch // micro_batches + (1 if i < batch % micro_batches else 0) for i in range(micro_batches)]
    bounds = [sum(sizes[:i]) for i in range(micro_batches + 1)]
    this.rows = {m: slice(a, b) for m, (a, b) in enumerate(zip(bounds, bounds[1:]))}
    lanes = [Lane(input_ids[a:b], mask[a:b], torch.zeros(b - a, dtype=torch.bool, device=input_ids.device))
             for a, b in zip(bounds, bounds[1:])]
    pick = sampler(generator, temperature, top_k, batch) if do_sample else None
    device = next((p.device for i in range(start, start + split[stage]) for p in blocks[i].parameters()),
                  input_ids.device)
    with standing_in(model, blocks, device) if meta else nullcontext(), evaluating(model):
        made = run_decode_ring(this, transport, lanes, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                               pad_token_id=pad_token_id, trace=trace, pick=pick)
    longest = max(t.shape[1] for t in made)
    made = [torch.cat([t, torch.full((t.shape[0], longest - t.shape[1]), pad_token_id, dtype=t.dtype,
                                     device=t.device)], dim=1) for t in made]
    return torch.cat([input_ids, torch.cat(made).to(input_ids.device, input_ids.dtype)], dim=1)
