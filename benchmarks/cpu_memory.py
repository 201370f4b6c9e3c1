"""A process's resident memory on Linux, for benchmarks that measure peak memory on CPU (tracemalloc does not see
torch's allocations): read ``/proc/self/status`` and reset the kernel's high-water mark between phases."""

from __future__ import annotations

from pathlib import Path


def status_kib(field: str) -> int:
    """A KiB field of ``/proc/self/status``: ``VmRSS`` (resident now) or ``VmHWM`` (resident at its highest)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Set ``VmHWM`` to the current resident set, so a later read is the peak of what runs from now on."""
    Path("/proc/self/clear_refs").write_text("5")
