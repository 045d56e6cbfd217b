"""The supervisor's wait between looks: until a chunk of its queue settles, or the poll interval ends.

Workers (and whoever marks a job abandoned) publish on the queue's channel when a chunk job
settles (``jobs.contract.events``); waking on that instead of sleeping takes up to a poll interval off the
end of every run and off every retry. The poll interval still bounds the wait, for what nobody
announces (back-off deadlines, stopped heartbeats, a worker that died mid-publish).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from chunkq.jobs.contract.events import settled_channel

log = logging.getLogger(__name__)

MIN_LOOK_GAP_SECONDS = 0.05  # a burst of settled chunks is one look, not one each


class Wakeup:
    def __init__(self, connection: redis.Redis, queue: str) -> None:
        self.connection = connection
        self.channel = settled_channel(queue)
        self._pubsub: Any = None
        self.woken = 0  # how many waits an announcement ended early (tests and logs)

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True if a chunk settled meanwhile."""
        deadline = time.monotonic() + seconds
        try:
            if self._pubsub is None:
                self._pubsub = self.connection.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
                self._pubsub.subscribe(self.channel)
            while (left := deadline - time.monotonic()) > 0:
                if self._pubsub.get_message(timeout=left) is not None:
                    time.sleep(min(MIN_LOOK_GAP_SECONDS, max(0.0, deadline - time.monotonic())))
                    while self._pubsub.get_message(timeout=0) is not None:
                        pass
                    self.woken += 1
                    return True
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.debug("lost the wake-up channel (%s); polling until Redis is back", exc)
            self.close()
            time.sleep(max(0.0, deadline - time.monotonic()))
        return False

    def close(self) -> None:
        if self._pubsub is not None:
            try:
                self._pubsub.close()
            except redis.RedisError:
                pass
            self._pubsub = None
