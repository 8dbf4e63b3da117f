"""The clocks the restart code keeps time on: when this process started (the ledger books every
attempt from it, the lease announces it), and a clock that keeps counting while a machine is
suspended (lease deadlines)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def process_start() -> float:
    """When this process started, on the wall clock, to within a clock tick (10 ms) on Linux.

    psutil's `create_time` adds the start tick to /proc/stat's `btime`, which is whole seconds, so
    it reads up to 1 s early: a restart right after a SIGKILL then seemed to start before the killed
    attempt's last heartbeat (CI caught the overlap). So on Linux: now minus the process's age, both
    taken on the boot clock that /proc/self/stat's `starttime` counts on."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux (no /proc, no CLOCK_BOOTTIME)
        pass
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # psutil missing or the platform refuses: the ledger's own start is close enough
        return time.time()


def seconds_since_process_start() -> float:
    """This process's age by the OS's record of its start (the ledger's clock)."""
    return max(0.0, time.time() - process_start())


def boot_clock() -> float:
    """Seconds on a clock that keeps counting while the machine is suspended (a paused VM, a laptop
    lid): a lease deadline on `time.monotonic` would stop with it and outlive the lease."""
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):  # not Linux: monotonic is the best there is
        return time.monotonic()
