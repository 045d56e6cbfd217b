"""What a process says while a server it needs does not answer: one line when it goes, then a line
at growing intervals, then one when it is back. A supervisor that retried each second logged 26
lines for a 25 s Redis restart (issue 65.3), a pool ~2,000 a minute: the first and last say
everything, the ones between only that it still waits."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

FIRST_REMINDER_SECONDS = 5.0  # then doubled each time, up to LONGEST_SILENCE_SECONDS
LONGEST_SILENCE_SECONDS = 300.0


class OutageLog:
    """``failed`` after each attempt that did not reach ``what``; ``recovered`` after one that did."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        going_on: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``going_on``: what the process does meanwhile, said once ("the run goes on when it is back")."""
        self.log, self.what, self.going_on, self.clock = log, what, going_on, clock
        self.since: float | None = None
        self._next = 0.0
        self._gap = FIRST_REMINDER_SECONDS

    @property
    def seconds(self) -> float:
        """How long the current outage has lasted (0 when there is none)."""
        return 0.0 if self.since is None else self.clock() - self.since

    def failed(self, exc: BaseException, began: float | None = None) -> None:
        """``began``: when the attempt that failed began (this log's clock). A server that answers
        nothing fails an attempt only once its reply limit has passed: counted from the failure,
        a 6.5 s pause was "back after 1.2 s"."""
        now = self.clock()
        if self.since is None:
            self.since = now if began is None else min(began, now)
            self._next, self._gap = now + FIRST_REMINDER_SECONDS, FIRST_REMINDER_SECONDS
            self.log.warning("%s unreachable (%s); %s", self.what, exc, self.going_on)
        elif now >= self._next:
            self.log.warning("%s still unreachable after %.0f s (%s)", self.what, now - self.since, exc)
            self._gap = min(self._gap * 2, LONGEST_SILENCE_SECONDS)
            self._next = now + self._gap

    def recovered(self) -> None:
        if self.since is not None:
            self.log.warning("%s is back after %.1f s", self.what, self.clock() - self.since)
            self.since = None
