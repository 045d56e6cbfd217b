"""Ending a worker's wait for a job when a stop comes: from a thread of its own, with Redis's
``CLIENT UNBLOCK``, so a drain ends now and never strands a job; and the way out of a worker that
holds nothing while Redis does not answer."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import redis

from chunkq.jobs.contract.defaults import REDIS_REPLY_SECONDS
from chunkq.jobs.queue.redis_clients import client_like, one_try
from chunkq.queue_worker.exit_codes import EXIT_STOPPED

if TYPE_CHECKING:
    from chunkq.queue_worker.chunk_worker import ChunkWorker


class RedisGoneWhileStopping(Exception):
    """Redis cannot be reached and this idle worker was asked to stop: it stops, not waits."""


class StoppedWhileWaiting(Exception):
    """A stop came while this worker waited for a job, with nothing in hand: it stops, not waits."""


WAKE_RETRY_SECONDS = 0.05
WAKER_SECONDS = 2.0  # the stop's own requests: a Redis silent this long does not answer


def _silence(client: redis.Redis) -> str | None:
    """Why Redis does not answer ``client`` (None: it does)."""
    try:
        client.ping()
    except redis.TimeoutError:
        return "Redis does not answer"
    except redis.RedisError as exc:
        return f"Redis cannot be reached ({exc})"
    return None


def wake_blocked_clients(waker: redis.Redis, name: str) -> int:
    """End the wait of every blocked client named ``name`` as if it had timed out: a BLMOVE either
    has moved a job (and returns it) or returns nothing, so no job is stranded. ``waker``: a client
    of its own, since the named one is busy waiting. How many were woken."""
    blocked = [
        int(client["id"])
        for client in waker.client_list(_type="normal")
        if client.get("name") == name and "b" in client.get("flags", "")
    ]
    return sum(bool(waker.client_unblock(client_id)) for client_id in blocked)


class WaitCutter:
    """Cuts a worker's wait for a job short once a stop comes, so a drain ends now, not a wait later
    (every command ended ~0.9 s after its result). From a thread of its own: a signal handler must
    not talk to Redis, since it could wait forever on a lock the code it interrupted holds; the
    handler only sets an event. The worker's connections carry its name (worker.py)."""

    def __init__(self, worker: ChunkWorker) -> None:
        self.worker = worker
        self.asked = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="chunkq-wait-cutter", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        self.asked.wait()
        worker = self.worker
        deadline = time.monotonic() + worker.stop_poll_seconds + 1
        waker = client_like(
            worker.connection, socket_timeout=WAKER_SECONDS, socket_connect_timeout=WAKER_SECONDS
        )
        silent: str | None = None
        try:
            # Again until the worker has left its wait: a stop between its heartbeat and its BLMOVE
            # finds nothing blocked at the first look.
            while worker.waiting and time.monotonic() < deadline:
                wake_blocked_clients(waker, worker.name)
                time.sleep(WAKE_RETRY_SECONDS)
        except redis.RedisError as exc:  # no CLIENT command here, or Redis away: the wait ends itself
            worker.log.debug("Worker %s: could not cut its wait for a job short: %s", worker.name, exc)
        finally:
            silent = _silence(waker) if worker.holds_nothing else None
            waker.close()
            waker.connection_pool.disconnect()
        if silent and worker.holds_nothing:
            # A Redis that hangs (stopped, its sockets open) never ends the wait, nor answers what RQ
            # says on its way out: an idle worker asked to stop was alive 45 s later.
            # It holds no job (its BLMOVE has not returned, or it was not waiting for one yet), so it
            # leaves now; a job the server moves afterwards is one the supervisor finds lost and
            # queues again.
            worker.log.warning("Worker %s: stopping as asked; %s", worker.name, silent)
            for handler in logging.getLogger().handlers:
                with contextlib.suppress(Exception):
                    handler.flush()
            os._exit(EXIT_STOPPED)


class StopNote:
    """Writes RQ's note that a stop was asked for (the worker's ``shutdown_requested_date``, which
    rq-dashboard shows) from a thread of its own. RQ writes it from its signal handler, on the
    connection the interrupted code may be reading from: against a Redis that stopped answering the
    handler, and the chunk it interrupted, waited as long as that connection's limit (RQ's 415 s)."""

    def __init__(self, worker: ChunkWorker) -> None:
        self.worker = worker
        self.asked_at = ""
        self._asked = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chunkq-stop-note", daemon=True)
        self._thread.start()  # now: a signal handler must not start a thread (see WaitCutter)

    def ask(self, asked_at: str) -> None:
        """Note the stop asked for at ``asked_at`` (RQ's date format); safe in a signal handler."""
        self.asked_at = asked_at
        self._asked.set()

    def _run(self) -> None:
        self._asked.wait()
        worker = self.worker
        client = one_try(worker.connection, REDIS_REPLY_SECONDS)
        try:
            client.hset(worker.key, "shutdown_requested_date", self.asked_at)
        except redis.RedisError as exc:  # a note only: the stop goes on without it
            worker.log.debug("Worker %s: could not note the stop in Redis: %s", worker.name, exc)
        finally:
            client.close()
            client.connection_pool.disconnect()
