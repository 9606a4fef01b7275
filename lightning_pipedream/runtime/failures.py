"""When one rank fails, make every rank stop with that rank's error instead of "connection closed"."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from lightning_pipedream.runtime.transport import PeerFailedError, post_error, posted_error


def wait_for_posted_error(seconds: float = 2.0) -> str | None:
    """The failing rank posts its error before exiting, but our socket may close first: wait a little."""
    deadline = time.monotonic() + seconds
    while True:
        message = posted_error()
        if message is not None or time.monotonic() > deadline:
            return message
        time.sleep(0.05)


@contextmanager
def pipeline_failures(stage: int) -> Iterator[None]:
    """Around a rank's pipeline work: post this rank's own errors; name the peer's error when a peer failed.

    A communication error (the peer's sockets closed) becomes a :class:`PeerFailedError` that
    carries the message the failing rank posted, when it posted one.
    """
    try:
        yield
    except (PeerFailedError, RuntimeError) as err:
        cause = wait_for_posted_error() if _is_communication_error(err) else None
        if cause is None:
            if not isinstance(err, PeerFailedError):
                post_error(f"Pipeline stage {stage} failed with {type(err).__name__}: {err}")
            raise
        raise PeerFailedError(f"{cause} (this rank, stage {stage}, stopped because of it)") from err
    except Exception as err:
        post_error(f"Pipeline stage {stage} failed with {type(err).__name__}: {err}")
        raise


def _is_communication_error(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, PeerFailedError) or "Connection closed" in text or "Connection reset" in text
