"""Rows per second, defined once for status, supervise, report and metrics alike.

rows done ÷ the time the run ran: the spans during which some chunk was being encoded, from the
chunk outputs in the store (their ``started_at`` and ``finished_at``), so every command that reads
the store gives the same figure for the same run. Chunk spans closer than PAUSE_SECONDS are one
span (the moments between chunks are the run's own cost); a longer pause, a run stopped and
resumed the next day, is not counted, nor any pause before a pool that started after the last
span ended (a run stopped with Ctrl+C and resumed a minute later: the minute no process ran is not
the run's; a newcomer's resumed run said 42 rows/s where it had run at 118). While the run goes
on, the time since its last chunk ended counts, up to PAUSE_SECONDS.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from chunkq.jobs.compute.device_busy import Tally


def parse_time(value: Any) -> datetime:
    """A chunk output's ISO time; one written without a zone is UTC (as workers write them)."""
    moment = datetime.fromisoformat(str(value))
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


PAUSE_SECONDS = 300.0  # a gap between chunk spans longer than this is a stopped run, not its work
_PAUSE = timedelta(seconds=PAUSE_SECONDS)


@dataclass
class Span:
    """A stretch the run ran: chunks encoded from ``start`` to ``end``; ``opened``: when the
    earliest pool of its chunks started (None: not recorded), which tells a stop from a pause."""

    start: datetime
    end: datetime
    opened: datetime | None = None

    def joins(self, later: Span) -> bool:
        """Whether ``later`` (starting no earlier) is this stretch going on: close enough, and
        encoded by a pool that was already there when this one ended."""
        if later.start - self.end > _PAUSE:
            return False
        return later.opened is None or later.opened <= self.end

    def to_json(self) -> list[str]:
        ends = [self.start.isoformat(), self.end.isoformat()]
        return ends if self.opened is None else [*ends, self.opened.isoformat()]

    @classmethod
    def from_json(cls, value: list[str]) -> Span:
        return cls(
            parse_time(value[0]), parse_time(value[1]), parse_time(value[2]) if len(value) > 2 else None
        )


@dataclass
class Throughput:
    rows: int = 0
    first_start: datetime | None = None
    last_end: datetime | None = None
    # Merged spans of chunk work, in time order: one per stretch the run ran (a few entries,
    # whatever the chunk count). None: not known (a summary written before they were kept).
    spans: list[Span] | None = field(default_factory=list)
    busy: Tally = field(default_factory=Tally)  # how busy the chunks kept their devices (compute/device_busy)

    def add(self, meta: Mapping[str, Any]) -> None:
        """Count one committed chunk output (its metadata as written by the worker); a chunk read
        from the vector cache was not encoded and is no part of the rate."""
        if meta.get("source") == "cache":
            return
        self.rows += int(meta["rows"])
        started, ended = parse_time(meta["started_at"]), parse_time(meta["finished_at"])
        self.first_start = started if self.first_start is None else min(self.first_start, started)
        self.last_end = ended if self.last_end is None else max(self.last_end, ended)
        if self.spans is not None:
            _merge(self.spans, Span(started, max(started, ended), _pool_start(meta)))
        self.busy.add(meta.get("busy"), meta.get("seconds"))

    def ran_seconds(self) -> float | None:
        """The time spent in the run's spans; the whole span where they are unknown."""
        if self.first_start is None or self.last_end is None:
            return None
        if self.spans is None:
            return max((self.last_end - self.first_start).total_seconds(), 0.0)
        return sum((span.end - span.start).total_seconds() for span in self.spans)

    def seconds(
        self,
        running: bool,
        now: datetime | None = None,
        resumed_at: datetime | None = None,
        watching_since: datetime | None = None,
    ) -> float | None:
        """The time the run ran. ``resumed_at``: when the encoding now in progress started (the
        earliest running chunk's), which counts while nothing is published yet, and replaces the
        PAUSE_SECONDS allowance after a longer stop, or after a stop before ``watching_since``
        (when the run's owner, a resumed command, began to watch it)."""
        now = now or datetime.now(UTC)
        ran = self.ran_seconds()
        if ran is None or self.last_end is None:
            if running and resumed_at is not None:
                return max((now - resumed_at).total_seconds(), 0.0)
            return None
        if running:
            since = (now - self.last_end).total_seconds()
            stopped = watching_since is not None and watching_since > self.last_end
            if (since > PAUSE_SECONDS or stopped) and resumed_at is not None and resumed_at > self.last_end:
                ran += (now - resumed_at).total_seconds()
            elif not stopped:  # resumed, nothing encoding yet: the rate it ran at, not one that sags
                ran += min(max(since, 0.0), PAUSE_SECONDS)
        return ran

    def rows_per_second(
        self,
        running: bool,
        now: datetime | None = None,
        encoding: int = 0,
        resumed_at: datetime | None = None,
        watching_since: datetime | None = None,
    ) -> float | None:
        """Rows per second; ``encoding``: rows running chunks have encoded and not yet published."""
        seconds = self.seconds(running, now, resumed_at, watching_since)
        return (self.rows + encoding) / seconds if seconds else None


def _pool_start(meta: Mapping[str, Any]) -> datetime | None:
    startup = meta.get("startup")
    opened = startup.get("pool_started_at") if isinstance(startup, Mapping) else None
    return parse_time(opened) if opened else None


def _merge(spans: list[Span], new: Span) -> None:
    """Add ``new`` to sorted, merged ``spans``: spans that join (Span.joins) become one."""
    spans.insert(bisect.bisect_left([s.start for s in spans], new.start), new)
    # A few spans, whatever the chunk count: merged again from the first, as a new one may join two.
    merged = [spans[0]]
    for span in spans[1:]:
        last = merged[-1]
        if last.joins(span) or span.start <= last.end:  # overlapping chunks are one stretch
            openings = [t for t in (last.opened, span.opened) if t is not None]
            merged[-1] = Span(last.start, max(last.end, span.end), min(openings) if openings else None)
        else:
            merged.append(span)
    spans[:] = merged


def of_outputs(metas: Iterable[Mapping[str, Any]]) -> Throughput:
    throughput = Throughput()
    for meta in metas:
        throughput.add(meta)
    return throughput
