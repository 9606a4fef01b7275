"""Errors between ranks: a peer's failure, and the message a failing rank leaves in the process group's store."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class PeerFailedError(RuntimeError):
    """Communication with another pipeline rank failed, usually because that rank raised and exited."""


_ERROR_KEY = "lightning_pipedream/error"


def post_error(message: str) -> None:
    """Leave a failing rank's error in the process group's store, so that its peers can report it."""
    store = default_store()
    if store is not None:
        try:
            store.set(_ERROR_KEY, message)
        except Exception:  # the store may be gone already; the peers still see closed sockets
            pass


def posted_error() -> str | None:
    """The error another rank left with :func:`post_error`, if any (without blocking)."""
    store = default_store()
    try:
        if store is not None and store.check([_ERROR_KEY]):
            return store.get(_ERROR_KEY).decode()
    except Exception:
        pass
    return None


def default_store() -> Any:
    """The default process group's store, or None (no process group, or it is gone)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None
