"""Weight versions of one stage: PipeDream's weight stashing and vertical sync, PipeDream-2BW's double buffer."""

from __future__ import annotations

from torch import Tensor, nn


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

    With ``stashing=False`` (the paper's ablation) updates go into the live storage in place, so
    a backward sees the newest weights, as PipeDream without stashing does.

    ``two_versions=True`` is PipeDream-2BW's double buffer: forwards ask for an explicit version
    (minibatch t for version t-1), and an update keeps the version it replaces for the minibatch
    still using it, writing the new one into the buffer of the version nobody uses any more, so
    a stage holds at most two versions of its weights.
    """

    def __init__(
        self, module: nn.Module, *, stashing: bool = True, vertical_sync: bool = False, two_versions: bool = False
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
        self._spare: dict[str, Tensor] | None = None  # a finished version's storage, for the next copy

    def forward_params(self, microbatch: int, version: int | None = None) -> dict[str, Tensor]:
        """Leaves to run ``microbatch``'s forward on: the live weights, or an older ``version`` (vertical sync)."""
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

    def collect_grads(self, microbatch: int) -> None:
        """After ``microbatch``'s backward: add the gradients its leaves received to the parameters' ``.grad``."""
        leaves = self._leaves.pop(microbatch)
        version = self._version_of.pop(microbatch)
        self._live_users.discard(microbatch)
        for name, leaf in leaves.items():
            if leaf.grad is None:
                continue
            p = self.params[name]
            p.grad = leaf.grad if p.grad is None else p.grad + leaf.grad
            leaf.grad = None
        if self._is_finished_copy(version, leaves):
            self._spare = {name: leaf.detach() for name, leaf in leaves.items()}

    def _is_finished_copy(self, version: int, leaves: dict[str, Tensor]) -> bool:
        """Whether ``leaves`` hold a stashed copy that nothing needs any more (its backward is done)."""
        if not self.stashing or self.two_versions or self.vertical_sync or not leaves:
            return False
        name = next(iter(leaves))
        return (
            leaves[name].data_ptr() != self.params[name].data.data_ptr()  # not the live storage
            and version not in self._version_of.values()  # no other minibatch in flight reads it
        )

    def before_update(self) -> None:
        """Call right before the optimizer writes into the parameters."""
        if self.two_versions:
            self._swap_buffers()
            return
        # Only a minibatch still in flight needs the old storage (on the last stage none is: its
        # forward and backward both come before the update, so it updates in place).
        if self.stashing and (self._live_users or self.vertical_sync):
            old, spare, self._spare = {}, self._spare, None
            for name, p in self.params.items():
                old[name] = p.data
                p.data = p.data.clone() if spare is None else spare[name].copy_(p.data)
            if self.vertical_sync:
                self._history[self.num_updates] = old
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
        self.num_updates += 1
        if keep_from is not None:
            needed = set(self._version_of.values())
            for v in [v for v in self._history if v < keep_from and v not in needed]:
                del self._history[v]

    def clear(self) -> None:
        """Forget everything stashed (after a drain)."""
        if self._leaves:
            raise RuntimeError(f"Minibatches {sorted(self._leaves)} are still in flight; drain the pipeline first.")
        self._history.clear()
        self._live_users.clear()
        self._spare = None

    def stored_versions(self) -> int:
        """How many distinct weight versions are alive: the live one plus stashed and kept ones."""
        if not self.params:
            return 0
        name = next(iter(self.params))  # one parameter tells which storages are alive
        ptrs = {self.params[name].data.data_ptr()}
        ptrs |= {leaves[name].data_ptr() for leaves in self._leaves.values()}
        ptrs |= {version[name].data_ptr() for version in self._history.values()}
        return len(ptrs)
