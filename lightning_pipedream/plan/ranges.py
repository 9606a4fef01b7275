"""The auto planner's tables over layer ranges (a stage over layers i..j) and its contiguous splits."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from lightning_pipedream.plan.memory import cut_bytes, layer_keeps, layer_parameters, layer_work
from lightning_pipedream.plan.profile import Profile
from lightning_pipedream.plan.shards import top_two_sum

_INF = math.inf


class LayerRanges:
    """``[i, j]`` tables over layers i..j (inf or 0 where j < i), and what a stage starting or ending there moves."""

    def __init__(self, profile: Profile, input_bytes: float, device: str = "cpu") -> None:
        layers = profile.layers
        self.n = len(layers)
        self.forward = self._table([layer.forward_s for layer in layers])
        self.backward = self._table([layer.backward_s for layer in layers])
        # the weight-gradient part of the backward (zero bubble): measured, or half
        self.weight = self._table([layer.backward_s / 2 if layer.weight_s is None else layer.weight_s
                                   for layer in layers])
        # device="cuda": every byte figure as CUDA's caching allocator counts it, as plan.memory.stage_bytes does
        self.params = self._table(layer_parameters(profile, device))
        saved, ending = layer_keeps(profile, device)
        self.acts = self._table(saved) + np.array(ending)[None, :]  # what layers i..j keep as one stage
        cuts = cut_bytes(profile, input_bytes, device)
        self.input = np.array(cuts)[:, None]  # what stage i.. receives
        self.output = np.array(cuts[1:] + [0.0])[None, :]  # what stage ..j sends on
        # what a backward and an optimizer step need on top (plan.memory.layer_work): per stage, the most of any layer
        working, temps, pending, largest = layer_work(profile, device)
        self.grad_working = self._range_max(working)
        self.grad_temps = self._range_max(temps)
        self.pending = self._table(pending) + self.output  # a split backward keeps its output's gradient too
        self.largest = self._range_max(largest)
        # sharded stages (plan.shards): the largest layer FSDP2 gathers, and the two largest (gathered at once)
        layer_params = layer_parameters(profile, device)
        self.largest_layer = self._range_max(layer_params)
        self.two_largest_layers = top_two_sum(layer_params)
        # a step's first backward, layer by layer (plan.memory.first_backward_bytes): prefix sums to sweep any range
        self._saved_prefix = np.concatenate([[0.0], np.cumsum(np.array(saved, dtype=float))])
        self._params_prefix = np.concatenate([[0.0], np.cumsum(np.array(layer_parameters(profile, device),
                                                                             dtype=float))])
        self._ending = np.array(ending, dtype=float)
        self._cuts = np.array(cuts, dtype=float)
        self._working = np.array(working, dtype=float)
        self._first_backward: dict[int, np.ndarray] = {}
        # a step's first split weight half (plan.memory.weight_half_bytes)
        self._layer_pending = np.array(pending, dtype=float)
        self._layer_params = np.array(layer_params, dtype=float)
        self._weight_half: dict[int, np.ndarray] = {}
        self.cuttable = np.array(profile.cut_allowed() + [False])  # may a stage end after layer k
        # A stage needs parameters to have an optimizer (unless the model has none): layers i..j alone may not be one.
        self.idle = (self.params == 0) if np.any(self.params[0] > 0) else np.zeros((self.n, self.n), dtype=bool)

    def first_backward(self, chunks: int) -> np.ndarray:
        """``[i, j]``: what one micro-batch's first backward of a step holds at its worst over layers i..j (see
        ``plan.memory.first_backward_bytes``): at layer k < j, ``(input_i + saved[i..k] + saved_j + ending_j +
        output_j) / chunks + params[k..j] + working_k / chunks`` (the stage's output and its gradient held to the end);
        at k = j, ``(input_i + saved[i..j] + ending_j) / chunks + params_j + working_j / chunks``. The maximum over
        k < j is a range maximum of the terms in k."""
        if chunks not in self._first_backward:
            s, p = self._saved_prefix, self._params_prefix
            in_k = s[1:] / chunks - p[:-1] + self._working / chunks
            fixed = (self._cuts[:, None] + self._ending[None, :] - s[:-1, None]) / chunks + p[None, 1:]
            before_last = np.full((self.n, self.n), -_INF)  # k in i..j-1 (none when j = i)
            before_last[:, 1:] = self._range_max(list(in_k))[:, :-1]
            before_last[np.tril_indices(self.n)] = -_INF
            held_to_end = (s[1:] - s[:-1] + self.output[0]) / chunks  # the last layer's saved output, its gradient
            self._first_backward[chunks] = fixed + np.maximum(before_last + held_to_end[None, :], in_k[None, :])
        return self._first_backward[chunks]

    def weight_half(self, chunks: int) -> np.ndarray:
        """``[i, j]``: what a step's first split weight half of one micro-batch adds at its worst over layers i..j (see
        ``plan.memory.weight_half_bytes``): ``(sum((chunks params_l - pending_l)+) + max(min(chunks params_l,
        pending_l))) / chunks``, in whole-batch bytes and divided once, as there."""
        if chunks not in self._weight_half:
            p, q = chunks * self._layer_params, self._layer_pending
            gained = self._table(list(np.maximum(0.0, p - q)))
            self._weight_half[chunks] = (gained + self._range_max(list(np.minimum(p, q)))) / chunks
        return self._weight_half[chunks]

    def _range_max(self, values: list[float]) -> np.ndarray:
        table = np.zeros((self.n, self.n))  # j < i: no stage (params' inf marks it)
        for i in range(self.n):
            table[i, i:] = np.maximum.accumulate(np.array(values[i:], dtype=float))
        return table

    def _table(self, values: list[float]) -> np.ndarray:
        prefix = np.concatenate([[0.0], np.cumsum(np.array(values, dtype=float))])
        table = prefix[None, 1:] - prefix[:-1, None]
        table[np.tril_indices(self.n, -1)] = _INF
        return table


def minmax_split(stage_costs: Sequence[np.ndarray], cuttable: np.ndarray) -> tuple[float, list[int]] | None:
    """Contiguous split into ``len(stage_costs)`` stages minimising the largest ``stage_costs[s][first, last]``
    (later boundaries break ties); None when every split has an infinite stage."""
    stages, n = len(stage_costs), cuttable.shape[0]
    best = np.full((stages, n), _INF)
    arg = np.zeros((stages, n), dtype=int)
    best[0] = stage_costs[0][0]
    starts = np.arange(n)
    for s in range(1, stages):
        # stage s starts at layer k (after a cut at k - 1): cand[k, j] = max(best[s - 1, k - 1], cost_s[k, j])
        before = np.full(n, _INF)
        before[1:] = np.where(cuttable[:-1], best[s - 1, :-1], _INF)
        before[starts < s] = _INF
        cand = np.maximum(before[:, None], stage_costs[s])
        pick = n - 1 - np.argmin(cand[::-1], axis=0)  # ties: the latest boundary
        best[s], arg[s] = cand[pick, starts], pick
    if not math.isfinite(best[stages - 1, n - 1]):
        return None
    balance, j = [], n - 1
    for s in range(stages - 1, 0, -1):
        k = int(arg[s, j])
        balance.append(j - k + 1)
        j = k - 1
    balance.append(j + 1)
    return float(best[stages - 1, n - 1]), balance[::-1]


def stage_entries(stage_tables: Sequence[np.ndarray], balance: Sequence[int]) -> list[Any]:
    """Each stage's entry ``stage_tables[s][first, last]`` for the layers ``balance`` (layers per stage) gives it."""
    bounds = np.cumsum([0, *balance])
    return [stage_tables[s][bounds[s], bounds[s + 1] - 1] for s in range(len(balance))]


def equal_shares(costs: np.ndarray, parts: int, cuttable: np.ndarray) -> list[int] | None:
    """Cut where the running cost crosses each k / parts of the total (nearest allowed cut, every part non-empty)."""
    n = len(costs)
    prefix = np.cumsum(costs)
    total = float(prefix[-1])
    bounds, last = [], -1
    for k in range(1, parts):
        target = total * k / parts
        allowed = [j for j in range(last + 1, n - (parts - k)) if cuttable[j]]
        if not allowed:
            return None
        last = min(allowed, key=lambda j: (abs(float(prefix[j]) - target), j))
        bounds.append(last)
    edges = [-1] + bounds + [n - 1]
    return [edges[i + 1] - edges[i] for i in range(parts)]
