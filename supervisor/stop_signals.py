"""The stop signals a chunkq command received: the first drains, a second stops now.

Both Ctrl+C (SIGINT) and SIGTERM (timeout, systemd, docker, kill) raise KeyboardInterrupt, as
Python's own SIGINT handler does, and each is counted. The count is what a second signal leaves
when it lands in clean-up that the first one started: the hostile pass sent Ctrl+C twice, 2 s
apart, while Redis answered nothing; the second interrupted the release of the run's Redis lock (a
5 s wait), the pool was then told to drain as if for the first, and the chunk it was told to give
back was finished instead.
"""

from __future__ import annotations

import signal
import time
from types import FrameType

from chunkq.jobs.contract.settings import SIGNAL_REPEAT_SECONDS

_received: list[float] = []  # when each came (time.monotonic)


def install() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    _received.append(time.monotonic())
    raise KeyboardInterrupt


def stop_now_asked() -> bool:
    """Whether a second stop came, SIGNAL_REPEAT_SECONDS or more after the first (sooner, it is one
    Ctrl+C delivered twice: to the process group and by a wrapper that passes it on)."""
    return len(_received) > 1 and _received[-1] - _received[0] >= SIGNAL_REPEAT_SECONDS
