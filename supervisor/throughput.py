"""Rows per second, defined once for status, supervise, report and metrics alike.

rows done ÷ the time from the first chunk's start to the last chunk's end, or to now while the run
is still going. Both ends come from the chunk outputs in the store (their ``started_at`` and
``finished_at``), so every command that reads the store gives the same figure for the same run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any


def parse_time(value: Any) -> datetime:
    """A chunk output's ISO time; one written without a zone is UTC (as workers write them)."""
    moment = datetime.fromisoformat(str(value))
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


@dataclass
class Throughput:
    rows: int = 0
    first_start: datetime | None = None
    last_end: datetime | None = None

    def add(self, meta: Mapping[str, Any]) -> None:
        """Count one committed chunk output (its metadata as written by the worker)."""
        self.rows += int(meta["rows"])
        started, ended = parse_time(meta["started_at"]), parse_time(meta["finished_at"])
        self.first_start = started if self.first_start is None else min(self.first_start, started)
        self.last_end = ended if self.last_end is None else max(self.last_end, ended)

    def seconds(self, running: bool, now: datetime | None = None) -> float | None:
        if self.first_start is None or self.last_end is None:
            return None
        end = (now or datetime.now(UTC)) if running else self.last_end
        return max((end - self.first_start).total_seconds(), 0.0)

    def rows_per_second(self, running: bool, now: datetime | None = None) -> float | None:
        seconds = self.seconds(running, now)
        return self.rows / seconds if seconds else None


def of_run(store: Any, run_id: str) -> Throughput:
    """A run's throughput from its committed chunk outputs (the ledger's summary where it covers
    them): for tools and benches that measure a run the way ``status`` reports it."""
    from chunkq.jobs.run_files import RunLayout
    from chunkq.supervisor.ledger import throughput_of

    layout = RunLayout(store, run_id)
    return throughput_of(layout, layout.done_chunks())


def of_outputs(metas: Iterable[Mapping[str, Any]]) -> Throughput:
    throughput = Throughput()
    for meta in metas:
        throughput.add(meta)
    return throughput
