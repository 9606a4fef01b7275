"""How much a micro-batch's token-mean loss counts when the strategy can see its labels, without ``mean_over=``.

A loss that is a mean over labelled tokens (Hugging Face's ``model(..., labels=labels).loss``, which leaves out the
label -100; ``cross_entropy(ignore_index=-100)``) differs between micro-batches that hold different counts of
labelled tokens. Where the labels are visible, each micro-batch's loss is weighed by its share of the batch's
labelled tokens (:class:`~lightning_pipedream.runtime.execution.shares.BatchShares` with these counts), as Hugging
Face's ``num_items_in_batch`` does for gradient accumulation, and the summed gradient is one device's. What is
detected, in this order:

1. the ``labels=`` keyword of the pipelined call (``self(input_ids=ids, labels=ids)``, or the model the step calls
   directly, ``self.model(..., labels=...)``; also ``**batch`` holding "labels");
2. else a dict batch's ``"shift_labels"`` (counted as it is) or ``"labels"``;

an integer tensor in either case. The labels are counted as the model's loss counts them (:func:`loss_shifts_labels`):
over ``labels[..., 1:]`` for a Hugging Face causal language model, else all of them. Anything else (labels in a
tuple batch that the step uses itself, a float target) keeps the samples' shares, and the warning about unequal
counts of labelled tokens where the batch shows them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn

from lightning_pipedream.runtime.execution.shares import labelled_tokens
from lightning_pipedream.strategy.setup.calls import ForwardCall

_SHIFTS: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def loss_shifts_labels(module: nn.Module) -> bool:
    """Whether the loss of the Hugging Face model in ``module`` (the outermost submodule with a ``loss_type``)
    shifts its labels: a causal LM's ``ForCausalLMLoss`` (set by its ``loss_type``, or Hugging Face's default for a
    model that can generate, such as GPT-2's), not an encoder-decoder's. False without such a model."""
    if module in _SHIFTS:
        return _SHIFTS[module]
    model = next((m for m in module.modules() if hasattr(m, "loss_type") and hasattr(m, "config")), None)
    shifts = False
    if model is not None:
        try:
            from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
        except ImportError:  # a module that only looks like one
            LOSS_MAPPING, ForCausalLMLoss = {}, None
        loss_type = getattr(model, "loss_type", None)
        if "_loss_function" in vars(model):  # set by the user
            function = vars(model)["_loss_function"]
        elif loss_type in LOSS_MAPPING:
            function = LOSS_MAPPING[loss_type]
        else:  # Hugging Face's loss_function falls back to the causal LM loss; models that generate use it
            can_generate = getattr(model, "can_generate", None)
            function = ForCausalLMLoss if callable(can_generate) and can_generate() else None
        shifts = function is not None and function is ForCausalLMLoss \
            and not getattr(model.config, "is_encoder_decoder", False)
    _SHIFTS[module] = shifts
    return shifts


def _integer(value: Any) -> Tensor | None:
    return value if isinstance(value, Tensor) and not value.is_floating_point() and not value.is_complex() \
        and value.dim() > 0 else None


def _call_labels(module: nn.Module, call: Any, hook: str, piece: Any, step_args: tuple,
                 step_kwargs: dict[str, Any]) -> Tensor | None:
    """The ``labels=`` the step passes to the pipelined call for ``piece`` of the batch; None if none."""
    if not isinstance(call, ForwardCall):
        return None
    try:
        _, kwargs = call.input_of(module, hook, piece, *step_args, **step_kwargs)
    except (RuntimeError, TypeError, ValueError):  # a step that does not make the call: said where it runs
        return None
    return _integer(kwargs.get("labels"))


def _batch_labels(piece: Any) -> tuple[Tensor | None, bool]:
    """A dict batch's ``shift_labels`` (already shifted) or ``labels``, and whether they are shifted already."""
    if not isinstance(piece, Mapping):
        return None, False
    shifted = _integer(piece.get("shift_labels"))
    if shifted is not None:
        return shifted, True
    return _integer(piece.get("labels")), False


def labelled_token_counter(module: nn.Module, call: Any, hook: str, batch: Any, *step_args: Any,
                           **step_kwargs: Any) -> Callable[[Any], int] | None:
    """A ``mean_over`` for ``batch``: the count of labelled tokens in a piece of it, from the labels found as the
    module docstring says; None when ``batch`` shows none (then the samples' shares hold). ``step_args`` and
    ``step_kwargs``: the step's arguments after the batch (its index, ...), with which ``call`` finds its input."""
    shifts = loss_shifts_labels(module)
    if _call_labels(module, call, hook, batch, step_args, step_kwargs) is not None:
        def in_call(piece: Any) -> int:
            labels = _call_labels(module, call, hook, piece, step_args, step_kwargs)
            if labels is None:
                raise ValueError(f"{type(module).__name__}.{hook} passed labels= to the model for the whole batch "
                                 "but not for a micro-batch of it; pass them alike, or give PipeDreamStrategy("
                                 "mean_over=...) what the loss averages over.")
            return labelled_tokens(labels, shifts)
        return in_call
    labels, already = _batch_labels(batch)
    if labels is None:
        return None

    def in_batch(piece: Any) -> int:
        found, shifted = _batch_labels(piece)
        assert found is not None  # a piece of a dict batch is a dict with the same keys
        return labelled_tokens(found, shifts and not shifted)
    return in_batch
