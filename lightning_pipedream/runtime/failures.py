"""When one rank fails, make every rank stop with that rank's error instead of "connection closed"."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from lightning_pipedream.runtime.flight import (
    PipelineTimeoutError,
    is_timeout,
    post_error_soon,
    recorder,
    timeout_error,
)
from lightning_pipedream.runtime.transport import PeerFailedError, post_error, posted_error

log = logging.getLogger("lightning_pipedream")


def wait_for_posted_error(seconds: float = 2.0) -> str | None:
    """The failing rank posts its error before exiting, but our socket may close first: wait a little."""
    deadline = time.monotonic() + seconds
    while True:
        message = posted_error()
        if message is not None or time.monotonic() > deadline:
            return message
        time.sleep(0.05)


@contextmanager
def pipeline_failures(stage: int, waiting: str | None = None) -> Iterator[None]:
    """Around a rank's pipeline work: post this rank's own errors; name the peer's error when a peer failed.

    A communication error (the peer's sockets closed) becomes a :class:`PeerFailedError` that
    carries the message the failing rank posted, when it posted one. A timed-out wait becomes a
    :class:`PipelineTimeoutError` that names the peer waited for and what it last reported.
    ``waiting`` names a collective run inside (e.g. "the step summary's broadcast") for those words.
    Every error writes this rank's flight recorder (its last actions) to a file.
    """
    flight = recorder()
    flight.start_heartbeat()
    # The except clauses run inside the mark, so that a timeout's words name this wait.
    with flight.waiting(f"{waiting} (stage {stage})") if waiting is not None else nullcontext():
        try:
            yield
        except PipelineTimeoutError:
            raise
        except (PeerFailedError, RuntimeError) as err:
            if is_timeout(err):
                timed_out = timeout_error(err, flight.current)
                post_error_soon(str(timed_out))
                raise timed_out from err
            cause = wait_for_posted_error() if _is_communication_error(err) else None
            if cause is None:
                if not isinstance(err, PeerFailedError):
                    post_error(f"Pipeline stage {stage} failed with {type(err).__name__}: {err}")
                _record(err)
                raise
            _record(err, cause)
            raise PeerFailedError(f"{cause} (this rank, stage {stage}, stopped because of it)") from err
        except Exception as err:
            post_error(f"Pipeline stage {stage} failed with {type(err).__name__}: {err}")
            _record(err)
            raise


def _record(err: BaseException, cause: str | None = None) -> None:
    """Write the flight recorder for ``err``, once, and say where in the log."""
    if getattr(err, "_flight_recorded", False):
        return
    path = recorder().dump(cause or f"{type(err).__name__}: {err}")
    try:
        err._flight_recorded = True  # type: ignore[attr-defined]
    except AttributeError:
        pass
    if path is not None:
        log.warning("Rank %d's last pipeline actions are in %s (python -m lightning_pipedream show --trace %s).",
                    recorder().rank, path, path)


def _is_communication_error(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, PeerFailedError) or "Connection closed" in text or "Connection reset" in text
