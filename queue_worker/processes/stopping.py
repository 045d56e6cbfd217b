"""Ending a child process: give it time to stop by itself, then kill it, and always reap it.

The pool (its workers, its fork server), ``chunkq run`` (its pool) and the embedded Redis each stop a
child this way; the signal that asks it to stop is each caller's own (SIGTERM to drain, a hang-up).
"""

from __future__ import annotations

import subprocess
from typing import Protocol


class Child(Protocol):
    """What is stopped: a ``subprocess.Popen``, or a worker the fork server forked (``ForkedWorker``)."""

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


def wait_or_kill(proc: Child, seconds: float) -> int:
    """Wait up to ``seconds`` for ``proc`` to exit, then SIGKILL it; its exit status either way.

    A Ctrl+C while waiting kills it too: whoever presses it while a stop is under way wants it
    stopped now, and a child left running would outlive the command that owns it.
    """
    try:
        return proc.wait(timeout=seconds)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        proc.kill()
        return proc.wait()
