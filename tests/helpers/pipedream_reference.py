"""PipeDream's update rule in one process, written from the paper's description: what the strategy is compared with.

Stage ``s`` of ``S`` computes minibatch ``t``'s gradient at the weights it had when ``t`` entered the
pipeline (after its updates for minibatches ``< t - (S-1-s)``, weight stashing), and applies it to its
newest weights ``S-1-s`` steps later, with the hyperparameters minibatch ``t`` was admitted with. A
drain applies every pending gradient. With ``vertical_sync`` every stage uses the version stage 0 used.
Accumulation sums ``1/k`` of each gradient and steps at the minibatches that close a group.

``ties`` (parameters used by several stages, e.g. an embedding tied to the decoder): each holding stage
keeps its own copy; at a stage's update for minibatch ``t`` a copy's gradient is the sum of every
copy's gradient for ``t``, each computed at its own stage's stashed weights (the copies stay identical,
since every holder applies the same sums in the same order).

``stashing=False`` is the paper's ablation (no weight stashing): a stage's forward runs at the weights
it has then and keeps its activations, but its backward runs later, at the weights it has when the
backward runs (after its updates for every earlier minibatch): a Linear's input-gradient ``g @ W``
uses that newest ``W``, its weight-gradient ``g^T x`` the input saved by the forward, and Tanh's
backward the output saved by the forward. That backward is written out by hand for Linear and Tanh.

Nothing here imports lightning_pipedream: it is an independent implementation of the rule.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call


def train_one_process(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: Any, loss_fn: Callable = nn.functional.mse_loss
) -> tuple[dict[str, Tensor], list[float]]:
    """Synchronous training in one process, an update per batch of ``(inputs, targets)``: the final
    weights and each batch's loss. The reference for every flushed schedule."""
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model.state_dict(), losses


@dataclass
class Minibatch:
    index: int  # global number over the whole run (for its hyperparameters)
    inputs: Tensor
    targets: Tensor
    closes_group: bool = True


def stages_of(layers: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """The Sequential's layers cut into stages of ``balance[s]`` layers (the same module objects)."""
    names, stages, start = list(layers._modules), [], 0
    for count in balance:
        stages.append(nn.Sequential(*[layers._modules[n] for n in names[start : start + count]]))
        start += count
    return stages


class PipeDreamRule:
    """Stages of an ``nn.Sequential`` (each with its own optimizer), trained segment by segment; a segment ends in a drain."""

    def __init__(
        self,
        layers: nn.Sequential,
        balance: Sequence[int],
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        hyperparameters: Callable[[int], dict[str, Any]],
        *,
        accumulate: int = 1,
        clip_norm: float | None = None,
        clip_value: float | None = None,
        vertical_sync: bool = False,
        stashing: bool = True,
        ties: Sequence[Sequence[tuple[int, str]]] = (),
    ) -> None:
        if vertical_sync and not stashing:
            raise ValueError("vertical sync chooses among stashed versions: it needs stashing")
        if ties and not stashing:
            raise ValueError("the no-stashing reference knows no ties")
        self.ties = [list(tie) for tie in ties]  # each: the (stage, parameter name in the stage) holding a copy
        self.stages = stages_of(layers, balance)
        self.optimizers = [make_optimizer(list(stage.parameters())) for stage in self.stages]
        self.loss_fn = loss_fn
        self.hyperparameters = hyperparameters
        self.accumulate = accumulate
        self.clip_norm, self.clip_value = clip_norm, clip_value
        self.vertical_sync = vertical_sync
        self.stashing = stashing
        self.losses: list[float] = []

    def _weights(self, s: int) -> dict[str, Tensor]:
        return {n: p.detach().clone() for n, p in self.stages[s].named_parameters()}

    def _gradients(self, weights: list[dict[str, Tensor]], mb: Minibatch) -> list[dict[str, Tensor | None]]:
        """Every stage's gradient of ``mb`` when stage s runs with ``weights[s]``."""
        leaves = []
        h = mb.inputs
        for s, stage in enumerate(self.stages):
            own = dict(stage.named_parameters())
            w = {n: t.clone().requires_grad_(own[n].requires_grad) for n, t in weights[s].items()}
            leaves.append(w)
            h = functional_call(stage, w, (h,))
        loss = self.loss_fn(h, mb.targets)
        self.losses.append(float(loss.detach()))
        (loss / self.accumulate).backward()
        return [{n: t.grad for n, t in w.items()} for w in leaves]

    def segment(self, minibatches: list[Minibatch]) -> None:
        """Run minibatches through the asynchronous pipeline, then drain it."""
        S = len(self.stages)
        delay = [S - 1 - s for s in range(S)]
        pending: list[deque] = [deque() for _ in range(S)]
        history = [[self._weights(s)] for s in range(S)]  # weights after j updates in this segment
        accumulated: list[dict[str, Tensor]] = [{} for _ in range(S)]
        # Without stashing: the gradient each stage's backward receives, by (stage, minibatch index).
        output_grads: dict[tuple[int, int], Tensor] = {}
        computed: dict[int, list[dict[str, Tensor | None]]] = {}  # every stage's gradients, by minibatch index

        def apply(s: int) -> None:
            mb, grads = pending[s].popleft()
            if not self.stashing:  # ``grads`` holds the forward's activations: the backward runs now
                grads = self._late_backward(s, grads, output_grads.pop((s, mb.index)), output_grads, mb.index)
            for tie in self.ties:
                for holder, name in tie:
                    if holder == s:
                        copies = [computed[mb.index][t][n] for t, n in tie]
                        grads = {**grads, name: sum(g for g in copies if g is not None)}
            for n, g in grads.items():
                if g is not None:
                    accumulated[s][n] = accumulated[s][n] + g if n in accumulated[s] else g
            if not mb.closes_group:
                return
            params = dict(self.stages[s].named_parameters())
            for n, p in params.items():
                p.grad = accumulated[s].get(n)
            grads_now = [p.grad for p in params.values() if p.grad is not None]
            if self.clip_value is not None:
                torch.nn.utils.clip_grad_value_(list(params.values()), self.clip_value)
            if self.clip_norm is not None and grads_now:
                norm = torch.sqrt(sum(g.float().pow(2).sum() for g in grads_now))
                factor = torch.clamp(self.clip_norm / (norm + 1e-6), max=1.0)
                for g in grads_now:
                    g.mul_(factor)
            optimizer = self.optimizers[s]
            for group in optimizer.param_groups:
                group.update(self.hyperparameters(mb.index))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            accumulated[s] = {}
            history[s].append(self._weights(s))

        for n, mb in enumerate(minibatches):
            if self.vertical_sync:
                version = max(0, n - delay[0])
                weights = [history[s][min(version, len(history[s]) - 1)] for s in range(S)]
            else:
                weights = [self._weights(s) for s in range(S)]
            if self.stashing:
                per_stage = self._gradients(weights, mb)
                computed[mb.index] = per_stage
            else:
                per_stage, loss_grad = self._activations(mb)
                output_grads[(S - 1, mb.index)] = loss_grad
            for s in range(S):
                pending[s].append((mb, per_stage[s]))
            for s in range(S):
                if n - delay[s] >= 0:
                    apply(s)
        # The drain: a stage's backward needs the next stage's, so the last stage goes first.
        for s in reversed(range(S)):
            while pending[s]:
                apply(s)

    def _activations(self, mb: Minibatch) -> tuple[list[list[Tensor]], Tensor]:
        """Without stashing: the forward at the live weights; per stage, what each layer's backward keeps
        (a Linear's input, a Tanh's output); and the gradient of the (1/k-scaled) loss by the output."""
        saved: list[list[Tensor]] = []
        h = mb.inputs
        with torch.no_grad():
            for stage in self.stages:
                kept = []
                for layer in stage:
                    if isinstance(layer, nn.Linear):
                        kept.append(h)
                        h = h @ layer.weight.T + (layer.bias if layer.bias is not None else 0)
                    elif isinstance(layer, nn.Tanh):
                        h = torch.tanh(h)
                        kept.append(h)
                    else:
                        raise TypeError(f"the no-stashing reference knows Linear and Tanh, not {type(layer).__name__}")
                saved.append(kept)
        out = h.clone().requires_grad_()
        loss = self.loss_fn(out, mb.targets)
        self.losses.append(float(loss.detach()))
        (grad,) = torch.autograd.grad(loss / self.accumulate, out)
        return saved, grad

    def _late_backward(
        self, s: int, kept: list[Tensor], g: Tensor, output_grads: dict[tuple[int, int], Tensor], index: int
    ) -> dict[str, Tensor | None]:
        """Stage ``s``'s backward now, at its live weights, from the activations its forward kept."""
        grads: dict[str, Tensor | None] = {}
        names = list(self.stages[s]._modules)
        with torch.no_grad():
            for name, layer, saved in reversed(list(zip(names, self.stages[s], kept))):
                if isinstance(layer, nn.Tanh):
                    g = g * (1 - saved * saved)
                    continue
                grads[f"{name}.weight"] = g.T @ saved if layer.weight.requires_grad else None
                if layer.bias is not None:
                    grads[f"{name}.bias"] = g.sum(0) if layer.bias.requires_grad else None
                g = g @ layer.weight  # the newest weights
        if s > 0:
            output_grads[(s - 1, index)] = g
        return grads

    def state_dict(self, prefix: str, layer_names: list[str]) -> dict[str, Tensor]:
        """The weights under the LightningModule's names (``prefix`` + the Sequential's layer names)."""
        out = {}
        flat = [m for stage in self.stages for m in stage]
        for name, module in zip(layer_names, flat):
            for k, v in module.state_dict().items():
                out[f"{prefix}{name}.{k}"] = v.detach().clone()
        return out


class RoundRobinRule:
    """PipeDream's 1F1B-RR in one process: stage ``s`` has ``replicas[s]`` replicas with identical weights.

    Minibatch m goes to replica ``m % r`` of a stage with r replicas, which keeps
    ``ceil(sum(replicas[s:]) / r)`` minibatches in flight (the paper's NOAM on the input stage, ``S - s``
    in a straight pipeline). So the stage's forward of m, its ``m // r``-th on that replica, runs at the
    stage's weights after ``max(0, m // r - in_flight + 1)`` updates; update u averages the gradients of
    minibatches ``u*r .. u*r + r - 1`` (those that exist: a drain's last round may be partial), each
    computed at the weights of its own forward (stashing), and applies to the newest weights. One copy
    of each stage stands for all its replicas. A segment ends in a drain.
    """

    def __init__(self, layers: nn.Sequential, balance: Sequence[int], replicas: Sequence[int],
                 make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 loss_fn: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.stages = stages_of(layers, balance)
        self.replicas = list(replicas)
        self.optimizers = [make_optimizer(list(stage.parameters())) for stage in self.stages]
        self.loss_fn = loss_fn
        self.losses: list[float] = []

    def segment(self, minibatches: list[tuple[Tensor, Tensor]]) -> None:
        S, r = len(self.stages), self.replicas
        in_flight = [-(-sum(r[s:]) // r[s]) for s in range(S)]
        history = [[{n: p.detach().clone() for n, p in stage.named_parameters()}] for stage in self.stages]
        grads: list[dict[int, dict[str, Tensor]]] = [{} for _ in range(S)]

        def update(s: int, final: bool) -> bool:
            u = len(history[s]) - 1
            members = [m for m in range(u * r[s], (u + 1) * r[s]) if m < len(minibatches)]
            have = [grads[s].pop(m) for m in members if m in grads[s]] if final or all(
                m in grads[s] for m in members) and members else []
            if not have:
                return False
            params = dict(self.stages[s].named_parameters())
            for n, p in params.items():
                p.grad = sum(g[n] for g in have) / len(have)
            self.optimizers[s].step()
            self.optimizers[s].zero_grad(set_to_none=True)
            history[s].append({n: p.detach().clone() for n, p in params.items()})
            return True

        for m, (x, y) in enumerate(minibatches):
            h, leaves = x, []
            for s, stage in enumerate(self.stages):
                version = max(0, m // r[s] - in_flight[s] + 1)
                w = {n: t.clone().requires_grad_() for n, t in history[s][version].items()}
                leaves.append(w)
                h = functional_call(stage, w, (h,))
            loss = self.loss_fn(h, y)
            self.losses.append(float(loss.detach()))
            loss.backward()
            for s in range(S):
                grads[s][m] = {n: t.grad for n, t in leaves[s].items()}
                while update(s, final=False):
                    pass
        for s in range(S):
            while update(s, final=True):
                pass
