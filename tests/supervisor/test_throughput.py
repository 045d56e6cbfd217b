"""The rate counts the time a run ran (issue 37.7): a run stopped overnight and resumed is not
slower for the night it did not run."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

from chunkq.supervisor.store.ledger import Ledger, summarised
from chunkq.supervisor.store.throughput import PAUSE_SECONDS, Throughput

T0 = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)


def _chunk(start: float, seconds: float, rows: int = 100) -> dict[str, object]:
    begin = T0 + timedelta(seconds=start)
    return {
        "rows": rows,
        "started_at": begin.isoformat(),
        "finished_at": (begin + timedelta(seconds=seconds)).isoformat(),
    }


def _sessions() -> list[dict[str, object]]:
    """Ten chunks of 10 s back to back, a night off, ten more: 200 s of work over 12 hours."""
    first = [_chunk(10 * i, 10) for i in range(10)]
    second = [_chunk(12 * 3600 + 10 * i, 10) for i in range(10)]
    return first + second


def test_a_stopped_stretch_is_not_counted_whatever_order_chunks_are_added_in() -> None:
    records = _sessions()
    for seed in range(5):
        random.Random(seed).shuffle(records)
        t = Throughput()
        for record in records:
            t.add(record)
        assert t.seconds(running=False) == 200.0 and t.rows_per_second(running=False) == 10.0
        assert t.spans is not None and len(t.spans) == 2
    # Short gaps between chunks (up to PAUSE_SECONDS) are the run's own: counted.
    gappy = Throughput()
    for i in range(3):
        gappy.add(_chunk(i * (10 + PAUSE_SECONDS - 1), 10))
    assert gappy.seconds(running=False) == 30 + 2 * (PAUSE_SECONDS - 1)


def _pooled(start: float, seconds: float, pool_started: float) -> dict[str, object]:
    pool = (T0 + timedelta(seconds=pool_started)).isoformat()
    return {**_chunk(start, seconds), "startup": {"pool_started_at": pool}}


def test_a_pause_before_a_later_pool_is_not_counted_and_one_within_a_pool_is() -> None:
    """A newcomer's pass: Ctrl+C, resumed a minute later: the run said 42 rows/s where it had run
    at 118, the minute no process ran counted as the run's (it was shorter than PAUSE_SECONDS)."""
    first = [_pooled(10 * i, 10, pool_started=-5) for i in range(5)]  # 0-50 s, its pool from -5 s
    resumed = [_pooled(110 + 10 * i, 10, pool_started=105) for i in range(5)]  # a pool started at 105 s
    for seed in range(4):
        records = first + resumed
        random.Random(seed).shuffle(records)
        t = Throughput()
        for record in records:
            t.add(record)
        assert t.seconds(running=False) == 100.0 and t.spans is not None and len(t.spans) == 2
    # The same gap within one pool (a worker that waited for chunks) is the run's own time.
    waited = Throughput()
    for record in [*first, *(_pooled(110 + 10 * i, 10, pool_started=-5) for i in range(5))]:
        waited.add(record)
    assert waited.seconds(running=False) == 160.0
    # Two pools at once (a fleet, one started while the other worked): one stretch.
    fleet = Throughput()
    for record in [*first, _pooled(60, 10, pool_started=30)]:
        fleet.add(record)
    assert fleet.seconds(running=False) == 70.0


def test_a_resumed_runs_live_rate_counts_from_its_encoding_not_from_the_stop() -> None:
    """A hostile pass: for the seconds after a resume, before its first chunk was published, the
    rate counted the minute the run was stopped (76 rows/s, ETA 1:44, where it ran at 600)."""
    t = Throughput()
    for i in range(5):
        t.add(_chunk(10 * i, 10))  # 0-50 s
    resumed, now = T0 + timedelta(seconds=100), T0 + timedelta(seconds=106)
    assert t.seconds(running=True, now=now, watching_since=resumed) == 50.0  # nothing encoding yet
    encoding_since = T0 + timedelta(seconds=104)
    assert t.seconds(running=True, now=now, resumed_at=encoding_since, watching_since=resumed) == 52.0
    # A look that does not own the run (status) knows no resume: the pause counts up to PAUSE_SECONDS.
    assert t.seconds(running=True, now=now, resumed_at=encoding_since) == 106.0


def test_while_running_the_time_since_the_last_chunk_counts_up_to_a_pause() -> None:
    t = Throughput()
    t.add(_chunk(0, 10))
    assert t.seconds(running=True, now=T0 + timedelta(seconds=40)) == 40.0
    resumed_next_day = T0 + timedelta(hours=24)
    assert t.seconds(running=True, now=resumed_next_day) == 10 + PAUSE_SECONDS


def test_the_summary_keeps_the_spans_and_an_old_summary_still_reads(tmp_path: Path) -> None:
    from chunkq.jobs.contract.run_files import RunLayout, atomic_write_json, read_json
    from tests.helpers import _write_manifest

    _write_manifest(tmp_path, "paused", 20, 100, 2000)
    layout = RunLayout(tmp_path, "paused")
    ledger = Ledger(layout)
    for i, record in enumerate(_sessions()):
        ledger.add({**record, "chunk": i})
    ledger.flush(force=True)
    again = summarised(layout, 20)
    assert again is not None and again.seconds(running=False) == 200.0
    old = read_json(layout.summary)
    del old["spans"]
    atomic_write_json(layout.summary, old)
    before = summarised(layout, 20)
    assert before is not None and before.seconds(running=False) == 12 * 3600 + 100  # as it was counted then
    # The pools' starts are kept: a summary of a resumed run reads as its chunks do.
    _write_manifest(tmp_path, "resumed", 10, 100, 1000)
    resumed = Ledger(RunLayout(tmp_path, "resumed"))
    for i in range(10):
        resumed.add({**_pooled(10 * i + (60 if i >= 5 else 0), 10, -5 if i < 5 else 105), "chunk": i})
    resumed.flush(force=True)
    kept = summarised(RunLayout(tmp_path, "resumed"), 10)
    assert kept is not None and kept.seconds(running=False) == 100.0
