"""Shared test set-up: the `multiprocess` marker, Hypothesis without a database, CI strictness, ports and folders per xdist worker."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

# Hypothesis would write .hypothesis/ into the checkout; examples that failed are printed anyway.
settings.register_profile("lightning_pipedream", database=None)
settings.load_profile("lightning_pipedream")

# Ranks that fail write their flight recorder (runtime/faults/flight.py); keep those files out of the checkout, in a
# folder of this process's own: pytest-xdist workers inherit the controller's environment, and two workers' ranks
# would write over each other's rank<R>.json.
if "PYTEST_XDIST_WORKER" in os.environ or "LIGHTNING_PIPEDREAM_FLIGHT_RECORDER" not in os.environ:
    os.environ["LIGHTNING_PIPEDREAM_FLIGHT_RECORDER"] = os.path.join(
        tempfile.gettempdir(), f"lightning_pipedream_flight_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}_{os.getpid()}")

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SHARED = Path(__file__).resolve().parents[1].parent / "shared"
PIPEDREAM_PROFILES = SHARED / "pipedream-profiles"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multiprocess: starts several processes (slow); CI runs them all")


@pytest.fixture(autouse=True)
def _no_process_group_leaks_into_later_tests():
    """A Trainer run in the pytest process (one device, a DDP-like strategy) leaves a process group and
    MASTER_PORT/RANK variables behind; processes started by later tests would inherit the port, which this
    process still holds, and fail with EADDRINUSE. Put both back as they were. (No MASTER_PORT is set here: a
    Hydra sweep restores its environment between jobs so that each finds a fresh port; the scripts the tests
    launch get a port of this worker's own from script_runs.script_env.)"""
    before = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in set(os.environ) - set(before):
        del os.environ[key]
    os.environ.update(before)


@pytest.fixture
def pipedream_profiles() -> Path:
    """The folder of PipeDream's published profiles: skip without it, but fail in CI (CI=true), where it must be."""
    if not PIPEDREAM_PROFILES.is_dir():
        message = f"PipeDream's profiles are not at {PIPEDREAM_PROFILES}"
        if IN_CI:
            pytest.fail(f"{message}; CI must have them (../shared/pipedream-profiles next to the checkout).")
        pytest.skip(message)
    return PIPEDREAM_PROFILES
