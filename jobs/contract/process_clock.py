"""When a process started, on the wall clock that ``time.time()`` reads.

The start-up figures (``chunkq report``'s steps before the first row, a worker's "ready N s after
its process started", the pool's start) subtract a process's start from ``time.time()``.
``psutil.Process().create_time()`` adds the process's start, counted from boot, to the boot time
from /proc/stat, which Linux gives in whole seconds and which drifts from the wall clock as the host
stays up: measured 1.02 s early on this project's CI machine, so every such figure read a second
long. Linux counts the process's age on one clock instead: /proc/uptime less its start in
/proc/<pid>/stat, both from boot, then subtracted from now.
"""

from __future__ import annotations

import os
import time

_START_FIELD = 19  # starttime, the 22nd field of /proc/<pid>/stat, counted after the command's ")"
ZOMBIE = "zombie"  # start_ticks of a process that has exited and is not yet reaped


def start_ticks(pid: int | str = "self") -> str | None:
    """When process ``pid`` started, in clock ticks since boot as /proc/PID/stat says it (exact, on no
    wall clock); ZOMBIE for one that has exited; None where /proc does not show it (gone, hidden
    by ``hidepid``, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            after = fh.read().rsplit(")", 1)[1].split()
        return ZOMBIE if after[0] == "Z" else after[_START_FIELD]
    except (OSError, IndexError):
        return None


def process_started_at(pid: int | None = None) -> float:
    """Epoch seconds at which process ``pid`` (default: this one) started, to the clock tick."""
    try:
        ticks = int(start_ticks(pid or "self") or "")
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime = float(fh.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux: psutil's, the best there is
        import psutil

        return float(psutil.Process(pid).create_time())


def pid_free(pid: int) -> bool:
    """Whether no process has ``pid``: the kernel's own answer (ESRCH). Another user's process
    (EPERM), or one /proc hides from this one, exists: the hostile pass saw a supervisor run as
    another user, /proc mounted ``hidepid=2``, take a live worker for dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


# A process that started this long after a moment it should have been alive at is another one
# with the pid reused (the kernel's start time is in clock ticks).
REUSED_AFTER_SECONDS = 1.0


def ran_since(pid: int, moment: float) -> bool:
    """Whether ``pid`` runs as a process that was already running at ``moment`` (epoch seconds): not
    gone, not a zombie, and not a newer process the pid was given to since. One this process may
    not look at counts as running."""
    if pid_free(pid):
        return False
    ticks = start_ticks(pid)
    if ticks is None:
        return True
    return ticks != ZOMBIE and process_started_at(pid) <= moment + REUSED_AFTER_SECONDS
