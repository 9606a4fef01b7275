"""A process's resident memory as Linux reports it: a field of ``/proc/self/status`` (VmRSS now, VmHWM the peak) and
the reset of the peak to the resident memory now, so that a peak can be read over a stretch of a run."""

from __future__ import annotations


def status_kb(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"{field} not in /proc/self/status")


def status_mb(field: str) -> float:
    """A field of /proc/self/status in MiB."""
    return status_kb(field) / 1024


def reset_peak_rss() -> None:
    """VmHWM := VmRSS (Linux >= 4.0): VmHWM is then the peak from here on. Raises OSError where the kernel refuses."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def try_reset_peak_rss() -> bool:
    """:func:`reset_peak_rss`, or False where the kernel refuses (VmHWM is then the peak since the process began)."""
    try:
        reset_peak_rss()
        return True
    except OSError:
        return False
