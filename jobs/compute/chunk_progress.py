"""Rows a running chunk has encoded so far: for the progress display, the rate and the report.

Without it progress moves only when a whole chunk is published: with 1,000-row chunks on a CPU
the display stands still for a minute, then jumps, and the rate between jumps falls while the run
is fine. The worker reports after each batch, at most every REPORT_SECONDS, into one Redis hash
per run (field: the chunk's index; value: rows encoded, the wall time its encoding started and the
time of the report). The supervisor reads the fields of the chunks it sees running, one command a
look whatever the run's size. A lost or stale report costs only the display's smoothness: what is
published is still counted from the store alone.

The chunk's output keeps a few samples (seconds since its encoding started, rows by then), so the
report draws rows when they were encoded, not all at the chunk's end.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field

import redis

from chunkq.jobs.queue.redis_clients import one_try

log = logging.getLogger(__name__)

KEY_PREFIX = "chunkq:encoding:"
REPORT_SECONDS = 1.0  # a report per batch would cost a round trip per few milliseconds on a GPU
# A report is two small commands, sent between batches: a Redis that has not answered them in this
# long is not answering, and the chunk goes on without reports for QUIET_SECONDS. On the worker's own
# connection a Redis that stopped answering held the encode for RQ's 415 s at each report.
REPLY_SECONDS = 1.0
QUIET_SECONDS = 30.0
KEEP_SECONDS = 24 * 3600  # a run's hash outlives a worker that died without clearing its field
FORGET_BLOCK = 1000  # fields a command clears at most
SAMPLES = 8  # samples kept in a chunk's output (and its ledger record): a point every 1/8 of its rows


def progress_key(run_id: str) -> str:
    return KEY_PREFIX + run_id


@dataclass(frozen=True)
class Encoding:
    """One running chunk's report, as the supervisor reads it."""

    rows: int
    started: float  # wall-clock seconds (epoch) at which its encoding started
    at: float  # wall-clock seconds of the report


def _parse(raw: bytes | str | None) -> Encoding | None:
    if raw is None:
        return None
    try:
        rows, started, at = (raw.decode() if isinstance(raw, bytes) else raw).split()
        return Encoding(max(0, int(rows)), float(started), float(at))
    except ValueError:  # anyone who can write to Redis can write here: a bad field is no report
        return None


def read(connection: redis.Redis, run_id: str, indices: list[int]) -> dict[int, Encoding]:
    """The reports of ``indices`` (chunks seen running) that exist and parse."""
    if not indices:
        return {}
    values = connection.hmget(progress_key(run_id), [str(i) for i in indices])
    found = {}
    for index, raw in zip(indices, values, strict=True):
        report = _parse(raw)
        if report is not None:
            found[index] = report
    return found


def forget(connection: redis.Redis, run_id: str, indices: list[int] | None = None) -> None:
    """Reports of chunks now counted from the store (their rows would count twice), or the run's
    whole hash once it has settled. The supervisor clears them, not the worker: a worker clearing
    its own on success would leave a moment when the chunk is neither reported nor published."""
    if indices is None:
        connection.delete(progress_key(run_id))
    for start in range(0, len(indices or ()), FORGET_BLOCK):
        connection.hdel(
            progress_key(run_id), *(str(i) for i in (indices or [])[start : start + FORGET_BLOCK])
        )


_reporting_clients: weakref.WeakKeyDictionary[redis.ConnectionPool, redis.Redis] = weakref.WeakKeyDictionary()


def reporting_client(connection: redis.Redis) -> redis.Redis:
    """The client a worker's reports go through: one per worker connection, each command tried once."""
    pool = connection.connection_pool
    client = _reporting_clients.get(pool)
    if client is None:
        client = _reporting_clients[pool] = one_try(connection, REPLY_SECONDS)
    return client


@dataclass
class RowsReporter:
    """Called with the rows encoded so far after each batch of one attempt at one chunk; called
    with 0 first, so a retry does not show its failed attempt's rows."""

    connection: redis.Redis | None
    run_id: str
    index: int
    total: int
    started: float = field(default_factory=time.time)
    rows: int = 0
    samples: list[list[float]] = field(default_factory=list)
    _started_mono: float = field(default_factory=time.monotonic)
    _last_report: float = float("-inf")
    _quiet_until: float = float("-inf")

    def __call__(self, rows: int) -> None:
        now = time.monotonic()
        if rows < self.rows:  # an out-of-memory back-off encodes the chunk again from its first row
            self.samples = [s for s in self.samples if s[1] <= rows]
        step = max(1, self.total // SAMPLES)
        # The first rows always: when a run's first rows came out is a start-up figure (report)
        first = bool(self.samples) and self.samples[-1][1] == 0 < rows
        if not self.samples or first or rows >= self.samples[-1][1] + step or rows == self.total:
            self.samples.append([round(now - self._started_mono, 3), rows])
        self.rows = rows
        due = now - self._last_report >= REPORT_SECONDS or rows == self.total
        if self.connection is not None and due and now >= self._quiet_until:
            self._last_report = now
            if not self._send(f"{rows} {self.started:.3f} {time.time():.3f}"):
                self._quiet_until = time.monotonic() + QUIET_SECONDS

    def _send(self, value: str) -> bool:
        """Whether Redis took the report."""
        if self.connection is None:
            return True
        key = progress_key(self.run_id)
        try:
            with reporting_client(self.connection).pipeline(transaction=False) as pipe:
                pipe.hset(key, str(self.index), value)
                pipe.expire(key, KEEP_SECONDS)
                pipe.execute()
        except redis.RedisError as exc:  # the display's loss, never the chunk's
            log.debug("could not report chunk %d's rows: %s", self.index, exc)
            return False
        return True
