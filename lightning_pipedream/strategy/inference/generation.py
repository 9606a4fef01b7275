"""``lightning_pipedream.generate``: greedy decoding (or sampling) of a LightningModule, through the pipeline's
ring under :class:`PipeDreamStrategy` and on one device without it, so the same code runs either way.

Under the strategy every rank of the pipeline calls it with the same prompts (from a step marked with
:func:`generates`, or after ``fit``/``validate``); each runs its own stage's blocks
(the strategy's split for a module whose layers are one ``nn.Sequential``; on the graph path, the blocks each rank
materialized for a module built per stage on the meta device, else an even split of the decoder's blocks, every rank
holding the whole module) and returns the same ids. No rank gathers or materializes weights it does not own.

A marked step may be the Trainer's first call (``trainer.predict`` straight from a checkpoint): setup builds the
pipeline from the model's plain forward, which :func:`generate` makes once, without a cache, while setup captures the
step's call (``setup/marked_steps.py``); an unmarked step that calls :func:`generate` is refused with words that say
to mark it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipedream.runtime.execution.decode import find_blocks, generate_ids, is_hf_model, split_of_owners
from lightning_pipedream.strategy.setup.marked_steps import GENERATES, PIPELINED_STEP, unmarked_step_words


def generates(step: Callable) -> Callable:
    """Mark a ``validation_step``, ``test_step`` or ``predict_step`` that calls :func:`generate`.

    Under :class:`PipeDreamStrategy` a marked step runs whole on every rank (its :func:`generate` calls go around the
    decode ring, every rank with the same batch), instead of being split at its ``self(...)`` call; what it logs and
    returns is the same on every rank. Such a step must not call ``self(...)`` for a pipelined forward of its own
    (compute a loss in another step). Without the strategy the mark changes nothing.
    """
    setattr(step, GENERATES, True)
    return step


def _plain_forward(module: nn.Module, call: Callable[..., Any], input_ids: Tensor,
                   attention_mask: Tensor | None) -> None:
    """The model's plain forward on the prompts (no cache: a Hugging Face model gets ``use_cache=False``), which
    setup's capture stops at: the pipeline is built from it, never from a cached decoding call."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    extra = {"use_cache": False} if is_hf_model(module) is not None else {}
    call(input_ids, mask, positions, extra, slice(None))
    raise RuntimeError(f"generate() made {type(module).__name__}'s forward call for PipeDreamStrategy's setup to "
                       "capture, but the call did not reach the module's forward. A forward= given to generate() must "
                       "call the module (or its nn.Sequential of layers).")


def _call_of(module: nn.Module, forward: Callable[[slice, Tensor], Any] | None) -> Any:
    """How one forward runs: ``forward(rows, ids)`` when given; a module over a Hugging Face model gets its keyword
    arguments (and the stage's cache); any other gets the ids alone and recomputes the whole prefix every step."""
    if forward is not None:
        def call(ids: Tensor, mask: Tensor, positions: Tensor, cache: dict, rows: slice) -> Any:
            return forward(rows, ids)
    elif is_hf_model(module) is not None:
        def call(ids: Tensor, mask: Tensor, positions: Tensor, cache: dict, rows: slice) -> Any:
            return module(input_ids=ids, attention_mask=mask, position_ids=positions, **cache)
    else:
        def call(ids: Tensor, mask: Tensor, positions: Tensor, cache: dict, rows: slice) -> Any:
            return module(ids)
    return call


def generate(module: nn.Module, input_ids: Tensor, *, attention_mask: Tensor | None = None, max_new_tokens: int,
             eos_token_id: int | None = None, pad_token_id: int | None = None,
             micro_batches: int | None = None, forward: Callable[[slice, Tensor], Any] | None = None,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None) -> Tensor:
    """Greedy decoding: the prompts (left-padded, ``attention_mask`` 0 on the padding) followed by up to
    ``max_new_tokens`` new tokens each, as Hugging Face's ``generate(do_sample=False)`` returns them (a sequence
    that ended gets ``pad_token_id`` after its ``eos_token_id``; the batch stops when all have ended).

    Under :class:`PipeDreamStrategy` (from a step marked with :func:`generates`, or after ``fit``/``validate``
    built the pipeline; every rank calls it with the same prompts) the batch is split into ``micro_batches`` lanes
    (default: one per stage, which keeps every stage busy, at most one per sequence) that circulate around the
    stages; each stage caches its own layers' keys and values per lane for a Hugging Face model, and a model without
    a cache recomputes its prefix. Every rank returns the ids.

    ``forward(rows, ids)``: how to run the model on the ids so far of the batch's rows ``rows`` (a slice), for a
    model that takes more than the ids (an encoder-decoder's sources: ``lambda rows, ids: self.layers((src[rows],
    ids))``); it must call the module's blocks (its ``nn.Sequential`` or ``nn.ModuleList``) and return logits
    (batch, length, vocabulary). Without a cache, the whole prefix runs every step.

    ``do_sample=True`` samples from ``softmax(logits / temperature)`` over the ``top_k`` likeliest tokens (all if
    None) instead; it needs ``generator``, a ``torch.Generator`` seeded alike on every rank (each call draws one seed
    from it). The tokens depend on the seed only: the same for any lane count, under the strategy and on one device.
    """
    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None)
    # PipeDreamStrategy's pipeline (its StagePipeline, once built); told by the class's name: the strategy imports us
    ours = any(c.__name__ == "PipeDreamStrategy" for c in type(strategy).__mro__)
    pipeline = getattr(strategy, "_pipeline", None) if ours else None
    call = _call_of(module, forward)
    running = PIPELINED_STEP.get() if ours else None
    if running is not None:
        hook, marked = running
        if not marked:
            raise ValueError(unmarked_step_words(module, hook))
        _plain_forward(module, call, input_ids, attention_mask)  # setup captures it (and stops the step there)
    common: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": eos_token_id,
                              "pad_token_id": pad_token_id, "do_sample": do_sample, "temperature": temperature,
                              "top_k": top_k, "generator": generator}
    if pipeline is None or pipeline.placement.num_stages == 1:
        return generate_ids(module, call, input_ids, attention_mask, micro_batches=micro_batches or 1, **common)
    placement = pipeline.placement
    if placement.num_pipelines > 1 or placement.round_robin or strategy.options.virtual_stages > 1:
        raise ValueError("generate() under PipeDreamStrategy runs one straight pipeline of one stage per process; "
                         "this one has data-parallel copies or several model chunks per process. Generate with "
                         "a straight pipeline (stages = processes, virtual_stages=1).")
    sequential = getattr(pipeline.call, "name", None) if pipeline.graph is None else None
    blocks = module.get_submodule(sequential) if sequential is not None else None
    split = list(strategy.balance) if blocks is not None and strategy.balance is not None else None
    path = pipeline.graph
    if path is not None and path.weights is not None and path.graph is not None:
        # Built per stage on the meta device: each rank decodes with the blocks it materialized for training.
        name, blocks = find_blocks(module)
        split = split_of_owners(module, path.graph.owners, placement.num_stages, name)
    lanes = micro_batches or min(placement.num_stages, input_ids.shape[0])
    return generate_ids(module, call, input_ids, attention_mask, micro_batches=lanes,
                        stage=placement.stage_index, num_stages=placement.num_stages, split=split,
                        transport=pipeline.engine.transport, blocks=blocks, **common)
