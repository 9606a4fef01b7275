"""Weight versions of one stage: PipeDream's weight stashing and vertical sync, PipeDream-2BW's double buffer."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook


class WeightVersions:
    """Gives each minibatch's forward the weights it must see, and keeps them until its backward.

    Every forward runs on fresh leaf tensors that alias a version's storage, so its backward
    computes gradients at exactly the weights the forward used, and those gradients land on the
    leaves (then move to the parameters' ``.grad``). Before an optimizer step, if an in-flight
    minibatch still uses the live storage, the parameters move to a copy (``p.data = clone``) and
    the old storage stays with that minibatch: the update never writes into a tensor autograd
    saved. A version lives exactly as long as a minibatch (or vertical sync) needs it; then its
    storage becomes the spare that the next such copy writes into (``copy_`` into memory already
    touched, not a fresh allocation: glibc returns large freed blocks to the OS, and faulting 16
    MiB of pages back in cost more than the copy itself in the benchmark), so a stage's memory
    peak is unchanged.

    With ``out_of_place=True`` (the default) the stash costs no copy where the optimizer allows it:
    the update itself writes the new weights elsewhere (``new = old - lr * grad`` read from the old
    storage, which stays with the minibatches in flight) instead of copying the old weights there and
    updating in place: into the gradient's own storage when it is a whole tensor of the parameter's
    layout (the gradient is spent: ``.grad`` is None after the step, as the pipeline's next
    ``zero_grad`` would leave it), else into the spare buffer. That holds for ``torch.optim.SGD``
    without momentum (any learning rate, weight decay, ``maximize``), the results equal to the bit;
    every other optimizer gets the copy, made inside its ``step`` before it writes. The out-of-place update runs inside
    the optimizer's ``step`` (through torch's optimizer step hooks, as the closure's last act), so
    whatever runs before it there (Lightning's ``on_before_optimizer_step`` and gradient clipping)
    still sees and changes the gradients first. An update that bypasses ``torch.optim`` (an
    in-place write to the parameters) while a minibatch in flight still uses them is refused at
    :meth:`after_update`; use ``out_of_place=False`` for such updates.

    With ``stashing=False`` (the paper's ablation) updates go into the live storage in place, so
    a backward sees the newest weights, as PipeDream without stashing does.

    ``two_versions=True`` is PipeDream-2BW's double buffer: forwards ask for an explicit version
    (minibatch t for version t-1), and an update keeps the version it replaces for the minibatch
    still using it, writing the new one into the buffer of the version nobody uses any more, so
    a stage holds at most two versions of its weights.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stashing: bool = True,
        vertical_sync: bool = False,
        two_versions: bool = False,
        out_of_place: bool = True,
        direct: bool = False,
    ) -> None:
        if vertical_sync and not stashing:
            raise ValueError("vertical_sync=True needs weight_stashing=True: it chooses which stashed version to use.")
        self.two_versions = two_versions
        # Every parameter, frozen ones too: one unfrozen during training (fine-tuning) is stashed
        # from then on, and its forward leaves ask for gradients exactly when the parameter does.
        self.params = dict(module.named_parameters())
        self.stashing = stashing
        self.vertical_sync = vertical_sync
        self.num_updates = 0
        self._live_users: set[int] = set()  # minibatches in flight whose forward used the live storage
        self._history: dict[int, dict[str, Tensor]] = {}  # version -> storage, for vertical sync
        self._leaves: dict[int, dict[str, Tensor]] = {}  # minibatch -> the leaves its forward used
        self._version_of: dict[int, int] = {}
        self._aliased: dict[int, set[str]] = {}  # minibatch -> its leaves whose .grad is the parameter's gradient
        # per micro-batch whose gradients were collected: how many updates the live weights had received since the
        # version its forward ran on (the staleness of the update that applies it), until the owner takes them
        self.staleness: list[int] = []
        self._spare: dict[str, Tensor] = {}  # finished versions' storage, per parameter, for the next update
        self.out_of_place = out_of_place
        # Between before_update and after_update on the out-of-place path: the parameters whose live storage
        # the update must not write into (name -> their version counter then), and the optimizer hooks.
        self._pending: dict[str, int] = {}
        self._names = {id(p): n for n, p in self.params.items()}
        # gradients kept from the optimizer that already applied them (None: spent as the new weights' storage)
        self._hidden: dict[str, Tensor | None] = {}
        self._armed = False  # the next step of an optimizer holding these parameters is ours (see _arm)
        self._stepping: Any = None  # the optimizer whose step is updating these parameters now
        # A stage that never holds two minibatches at an update (the last of a straight pipeline): with plain
        # stashing its forwards run on the parameters themselves (no leaves, no functional_call), the live version;
        # vertical sync and 2BW choose older versions, and the ablation without stashing keeps its leaves.
        self.direct = direct and stashing and not vertical_sync and not two_versions
        self.copies = 0  # updates that copied a stash (the fallback), for tests and benchmarks
        self.gradients_reused = 0  # parameters whose out-of-place update wrote into their gradient's storage

    def forward_params(self, microbatch: int, version: int | None = None) -> dict[str, Tensor] | None:
        """Leaves to run ``microbatch``'s forward on: the live weights, or an older ``version`` (vertical sync);
        None when the stage is ``direct`` (run the module on its own parameters)."""
        if self.direct:
            self._version_of[microbatch] = self.num_updates
            self._live_users.add(microbatch)
            return None
        if version is None or version >= self.num_updates:
            source = {n: p.data for n, p in self.params.items()}
            self._live_users.add(microbatch)
            version = self.num_updates
        elif version in self._history:
            source = self._history[version]
        else:
            raise RuntimeError(
                f"Weight version {version} is no longer stored (have {sorted(self._history)} and live "
                f"{self.num_updates}); the schedule and vertical sync disagree."
            )
        leaves = {n: t.detach().requires_grad_(self.params[n].requires_grad) for n, t in source.items()}
        self._leaves[microbatch] = leaves
        self._version_of[microbatch] = version
        return leaves

    def accumulate_in_place(self, microbatch: int) -> None:
        """Right before ``microbatch``'s backward: its leaves start from the gradients the parameters have
        accumulated already (2BW's micro-batches, ``accumulate_grad_batches``), so autograd adds into those in
        place instead of holding a second set of gradients until :meth:`collect_grads` sums the two."""
        if self.direct:  # the backward lands on the parameters' .grad itself
            return
        aliased = set()
        for name, leaf in self._leaves[microbatch].items():
            grad = self.params[name].grad
            if grad is not None and leaf.requires_grad and leaf.grad is None:
                leaf.grad = grad
                aliased.add(name)
        self._aliased[microbatch] = aliased

    def collect_grads(self, microbatch: int) -> None:
        """After ``microbatch``'s backward: add the gradients its leaves received to the parameters' ``.grad``."""
        if self.direct:
            self.staleness.append(self.num_updates - self._version_of.pop(microbatch))
            self._live_users.discard(microbatch)
            return
        leaves = self._leaves.pop(microbatch)
        aliased = self._aliased.pop(microbatch, set())
        self.staleness.append(self.num_updates - self._version_of.pop(microbatch))
        self._live_users.discard(microbatch)
        for name, leaf in leaves.items():
            if leaf.grad is None:
                continue
            p = self.params[name]
            # A leaf that started from the parameter's gradient holds the sum already (autograd added in place).
            p.grad = leaf.grad if p.grad is None or name in aliased else p.grad + leaf.grad
            leaf.grad = None
        if self.stashing and not self.two_versions and not self.vertical_sync:
            self._keep_finished(leaves)

    def _keep_finished(self, leaves: dict[str, Tensor]) -> None:
        """Keep as spares the storages of ``leaves`` that nothing needs any more: not the live weights, and
        read by no other minibatch in flight (its backward is done)."""
        for name, leaf in leaves.items():
            ptr = leaf.data_ptr()
            if ptr == self.params[name].data.data_ptr():
                continue
            if any(other[name].data_ptr() == ptr for other in self._leaves.values()):
                continue
            self._spare[name] = leaf.detach()

    def before_update(self) -> None:
        """Call right before the optimizer writes into the parameters."""
        if self.two_versions:
            self._swap_buffers()
            return
        if self.direct:
            if self._live_users:
                raise RuntimeError(
                    f"Minibatches {sorted(self._live_users)} ran their forward on this stage's parameters and are "
                    "still in flight at an update; a stage that holds several needs WeightVersions(direct=False)."
                )
            return
        # Only a minibatch still in flight needs the old storage (on the last stage none is: its
        # forward and backward both come before the update, so it updates in place).
        if not (self.stashing and (self._live_users or self.vertical_sync)):
            self._live_users.clear()
            return
        if self.vertical_sync:
            # Neither path below ever writes into the storage a version leaves behind.
            self._history[self.num_updates] = {n: p.data for n, p in self.params.items()}
        if self.out_of_place:
            self._arm()
            return
        self._stash_by_copy(list(self.params))
        self._live_users.clear()

    def _target(self, name: str) -> Tensor:
        """Where parameter ``name``'s next version goes: a finished version's storage, else new memory."""
        spare = self._spare.pop(name, None)
        return spare if spare is not None else torch.empty_like(self.params[name].data)

    def _stash_by_copy(self, names: list[str]) -> None:
        """The parameters move to a copy of their weights; the old storage stays with its minibatches."""
        for name in names:
            p = self.params[name]
            p.data = self._target(name).copy_(p.data)
        self.copies += 1

    # ----------------------------------------------------------------------- out-of-place updates
    def _arm(self) -> None:
        """The next optimizer step that holds these parameters writes their new versions elsewhere."""
        self._disarm()
        self._pending = {name: p._version for name, p in self.params.items()}
        _ArmedVersions.arm(self)
        self._armed = True

    def _disarm(self) -> None:
        if self._armed:
            _ArmedVersions.disarm(self)
        self._armed = False
        self._stepping = None

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Inside ``optimizer.step``, before it writes: copy the stash (the fallback), or have the step's closure
        end with the out-of-place update of these parameters."""
        mine = [self._names[id(p)] for group in optimizer.param_groups for p in group["params"]
                if self._names.get(id(p)) in self._pending]
        if not mine:
            return None
        self._stepping = optimizer  # its post-hook is ours: another optimizer's step leaves these parameters alone
        if not _plain_sgd(optimizer):
            self._stash_by_copy(mine)
            for name in mine:
                del self._pending[name]
            return None
        # torch hands the hooks ``step``'s arguments with the optimizer first: (optimizer, [closure])
        closure: Callable[[], Any] | None = args[1] if len(args) > 1 else kwargs.get("closure")

        def closure_then_update() -> Any:
            loss = closure() if closure is not None else None  # Lightning's hooks and clipping run in here
            self._update_out_of_place(optimizer)
            return loss

        if len(args) > 1:
            return (args[0], closure_then_update, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_then_update}

    def _update_out_of_place(self, optimizer: torch.optim.Optimizer) -> None:
        """SGD's update, ``new = old - lr * (grad [+ weight_decay * old])``, written into the spare buffer;
        the optimizer then finds no gradient on these parameters (they are given back after its step)."""
        with torch.no_grad():
            for group in optimizer.param_groups:
                lr = float(group["lr"])
                weight_decay, maximize = group["weight_decay"], group["maximize"]
                for p in group["params"]:
                    name = self._names.get(id(p))
                    if name not in self._pending or p.grad is None:
                        continue
                    grad = -p.grad if maximize else p.grad
                    if weight_decay != 0:
                        grad = grad.add(p.data, alpha=weight_decay)
                    # The gradient's own storage takes the new weights when nothing else can read it (a tensor
                    # made here, or a gradient that is a whole storage of the parameter's layout): the update then
                    # reads two streams and writes one, as in place, instead of also pulling in a spare buffer.
                    consumed = grad is not p.grad or _whole_storage_like(p.grad, p.data)
                    p.data = torch.add(p.data, grad, alpha=-lr, out=grad if consumed else self._target(name))
                    del self._pending[name]
                    if consumed:  # the finished version goes back to the allocator, for the next gradients
                        self._spare.pop(name, None)
                        self.gradients_reused += 1
                    self._hidden[name] = None if consumed else p.grad
                    p.grad = None

    def _after_step(self) -> None:
        for name, grad in self._hidden.items():
            self.params[name].grad = grad
        self._hidden = {}

    def _finish_out_of_place(self) -> None:
        """After the update: every parameter the optimizer did not move is still the live storage that minibatches
        in flight read; it must not have been written into."""
        self._disarm()
        self._after_step()
        written = [name for name, seen in self._pending.items() if self.params[name]._version != seen]
        unmoved = bool(self._pending)
        self._pending = {}
        if written:
            raise RuntimeError(
                f"Parameters {written} were updated in place outside a torch.optim optimizer's step while a "
                "minibatch in flight still uses their weights (weight stashing). Update them through a "
                "torch.optim.Optimizer, or build WeightVersions(..., out_of_place=False) to copy before every update."
            )
        if not unmoved:  # every parameter moved: no minibatch in flight shares the live weights any more
            self._live_users.clear()

    def _swap_buffers(self) -> None:
        """2BW: keep the live version for the minibatch that runs on it (the next one, t+1 on version t,
        whose forwards may have started); the update goes into the buffer of the version before, which
        nobody uses any more."""
        in_use = set(self._version_of.values())
        free = None
        for version in [v for v in self._history if v not in in_use]:
            free = self._history.pop(version)  # its minibatch's backwards are done: reuse its memory
        old = {}
        for name, p in self.params.items():
            old[name] = p.data
            # The free buffer held a version whose backwards are all done: no graph saved it any more.
            p.data = free[name].copy_(p.data) if free is not None else p.data.clone()
        self._history[self.num_updates] = old
        self._live_users.clear()

    def after_update(self, keep_from: int | None = None) -> None:
        """Call right after the optimizer step; ``keep_from`` is the oldest version a future forward may need."""
        if self._armed:
            self._finish_out_of_place()
        self.num_updates += 1
        if keep_from is not None:
            needed = set(self._version_of.values())
            for v in [v for v in self._history if v < keep_from and v not in needed]:
                del self._history[v]

    def clear(self) -> None:
        """Forget everything stashed (after a drain)."""
        if self._leaves:
            raise RuntimeError(f"Minibatches {sorted(self._leaves)} are still in flight; drain the pipeline first.")
        self._disarm()
        self._after_step()
        self._pending = {}
        self._history.clear()
        self._live_users.clear()
        self._spare = {}

    def stored_versions(self) -> int:
        """How many distinct weight versions are alive: the live one plus stashed and kept ones."""
        if not self.params:
            return 0
        name = next(iter(self.params))  # one parameter tells which storages are alive
        ptrs = {self.params[name].data.data_ptr()}
        ptrs |= {leaves[name].data_ptr() for leaves in self._leaves.values()}
        ptrs |= {version[name].data_ptr() for version in self._history.values()}
        return len(ptrs)


def _whole_storage_like(grad: Tensor, weights: Tensor) -> bool:
    """Whether ``grad`` is a tensor of its own that can become ``weights``' next version: a whole contiguous storage
    of the same shape, dtype and device (not a view into a flat gradient buffer), and not the weights themselves."""
    return (
        grad.shape == weights.shape and grad.dtype == weights.dtype and grad.device == weights.device
        and grad.is_contiguous() and grad.storage_offset() == 0 and not grad.requires_grad
        and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()
        and grad.data_ptr() != weights.data_ptr()
    )


def _plain_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s update can be written out of place exactly as it would write it in place:
    ``torch.optim.SGD`` itself, without momentum (whose buffer it would update), fused or differentiable kernels."""
    return type(optimizer) is torch.optim.SGD and all(
        g["momentum"] == 0 and not g.get("fused") and not g.get("differentiable") for g in optimizer.param_groups
    )


class _ArmedVersions:
    """torch's global optimizer-step hooks, registered once for the process, calling every armed
    :class:`WeightVersions` in turn.

    The hooks are global because the optimizer is the user's (Lightning's); registering and removing a pair per update
    would change torch's global hook tables while another thread's optimizer may be stepping through them (stages as
    threads of one process: the NCCL model, the GPU check), which Python refuses ("OrderedDict mutated during
    iteration"). Arming is a set under a lock instead; a versions object answers only for its own parameters, and only
    the optimizer that updated them ends its step.
    """

    _lock = threading.Lock()
    _armed: weakref.WeakSet[WeightVersions] = weakref.WeakSet()
    _handles: list[Any] = []

    @classmethod
    def arm(cls, versions: WeightVersions) -> None:
        with cls._lock:
            if not cls._handles:
                cls._handles = [register_optimizer_step_pre_hook(cls._pre),
                                register_optimizer_step_post_hook(cls._post)]
            cls._armed.add(versions)

    @classmethod
    def disarm(cls, versions: WeightVersions) -> None:
        with cls._lock:
            cls._armed.discard(versions)

    @classmethod
    def _current(cls) -> list[WeightVersions]:
        with cls._lock:
            return list(cls._armed)

    @classmethod
    def _pre(cls, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        changed = False
        for versions in cls._current():  # each may wrap the step's closure in turn, as torch chains its hooks
            result = versions._before_step(optimizer, args, kwargs)
            if result is not None:
                args, kwargs = result
                changed = True
        return (args, kwargs) if changed else None

    @classmethod
    def _post(cls, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        for versions in cls._current():
            if versions._stepping is optimizer:
                versions._stepping = None
                versions._after_step()
