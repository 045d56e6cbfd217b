"""The run's ledger and summary (issue 22.2): status and report read a file per LEDGER_BATCH chunks,
agree with the chunk outputs, and rebuild what is missing from the outputs, once."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from chunkq.jobs.contract.manifest import load_manifest
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import read_json
from chunkq.supervisor.store import ledger as ledger_module
from chunkq.supervisor.store.ledger import Ledger, read_ledger
from chunkq.supervisor.store.throughput import of_outputs
from chunkq.supervisor.watch.snapshot import store_snapshot
from tests.helpers import write_test_run


def _opened(layout: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The chunk output metadata files this test's readers open, by name."""
    opened: list[str] = []
    real = ledger_module.read_json

    def counting(path: Path) -> Any:
        if path.stem.isdigit():  # a chunk output's metadata, not summary.json
            opened.append(path.name)
        return real(path)

    monkeypatch.setattr(ledger_module, "read_json", counting)
    return opened


def test_the_ledger_is_built_once_from_the_outputs_and_then_read_instead_of_them(
    encoded_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, _, _ = encoded_run
    manifest = load_manifest(layout)
    opened = _opened(layout, monkeypatch)
    outputs = [read_json(layout.output_meta(i)) for i in range(manifest.chunks)]
    want = of_outputs(outputs)

    first = store_snapshot(layout, manifest)  # no ledger yet: every output is read, then recorded
    assert sorted(opened) == [f"{i:06d}.json" for i in range(manifest.chunks)]
    assert sorted(r["chunk"] for r in read_ledger(layout, load_manifest(layout))) == list(
        range(manifest.chunks)
    )
    summary = json.loads(layout.summary.read_text())
    assert summary["chunks_recorded"] == manifest.chunks and summary["rows_recorded"] == 47

    opened.clear()
    again = store_snapshot(layout, manifest)
    assert opened == []  # the ledger answered: no chunk output was read
    assert again.rows_per_second == first.rows_per_second == want.rows_per_second(False)
    assert (again.chunks_done, again.rows_done) == (manifest.chunks, 47)

    # The ledger deleted: rebuilt from the outputs, once.
    for batch in layout.ledger.iterdir():
        batch.unlink()
    layout.summary.unlink()
    store_snapshot(layout, manifest)
    assert len(opened) == manifest.chunks and layout.summary.is_file()
    opened.clear()
    store_snapshot(layout, manifest)
    assert opened == []

    # A summary that covers fewer chunks than are done (stale) is not trusted: the ledger answers.
    layout.summary.write_text(json.dumps({**summary, "chunks_recorded": 1, "rows_recorded": 1}))
    assert store_snapshot(layout, manifest).rows_per_second == want.rows_per_second(False)


def test_an_owner_writes_batches_and_never_records_a_chunk_twice(
    encoded_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, _, _ = encoded_run
    monkeypatch.setattr(ledger_module, "LEDGER_BATCH", 2)
    ledger = Ledger.open(layout, load_manifest(layout))
    metas = [read_json(layout.output_meta(i)) for i in range(5)]
    for meta in metas + metas[:2]:
        ledger.add(meta)
    ledger.flush()  # five pending, two to a batch: written at once
    assert sorted(p.name for p in layout.ledger.iterdir()) == ["000000.jsonl", "000001.jsonl", "000002.jsonl"]
    reopened = Ledger.open(layout, load_manifest(layout))
    assert set(reopened.recorded) == set(range(5)) and reopened.throughput == of_outputs(metas)
    reopened.add(metas[0])
    assert reopened.pending == []


def _synthetic_run(store: Path, run_id: str, chunks: int, processes: int) -> Any:
    """A run of ``chunks`` one-row chunks, all finished, as the store records them: output commit
    markers (their names are what ``done_chunks`` lists) and a ledger written by the owner's writer.
    Four hours of made-up work across ``processes`` worker processes."""
    from datetime import UTC, datetime, timedelta

    from chunkq.jobs.contract.run_files import RunLayout

    write_test_run(store, run_id, chunks - 1, 1, seed=0)
    layout = RunLayout(store, run_id)
    layout.outputs.mkdir(parents=True, exist_ok=True)
    ledger = Ledger.open(layout, load_manifest(layout))
    t0 = datetime(2026, 11, 1, tzinfo=UTC)
    step = timedelta(hours=4) / chunks * processes
    for index in range(chunks):
        (layout.outputs / f"{index:06d}.json").write_bytes(b"{}")
        pid, nth = 1000 + index % processes, index // processes
        started = t0 + nth * step
        ledger.add(
            {
                "chunk": index,
                "rows": 1,
                "started_at": started.isoformat(),
                "finished_at": (started + step * 0.9).isoformat(),
                "worker": f"w{pid}",
                "host": "h",
                "pid": pid,
                "device": "cpu",
                "model_loaded_at": t0.isoformat(),
                "model_load_seconds": 2.0,
            }
        )
    ledger.flush(force=True)
    return layout


@pytest.mark.slow
def test_a_report_streams_the_ledger_and_holds_bins_not_records(store: Path) -> None:
    """``report``'s memory holds the plot's points (issue 22.2): gathering a 20,000-chunk run peaks
    at about what a 2,000-chunk run does, and the timeline has at most TIMELINE_BINS bars a lane."""
    import tracemalloc

    from chunkq.tools import run_facts

    peaks = {}
    for chunks in (2_000, 20_000):
        layout = _synthetic_run(store, f"big{chunks}", chunks, processes=4)
        tracemalloc.start()
        facts = run_facts.gather(Run.of(layout))
        peaks[chunks] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert facts.chunks_done == chunks and facts.rate.sum() == chunks == facts.throughput.rows
        assert sorted(lane.pid for lane in facts.lanes.values()) == [1000, 1001, 1002, 1003]
        bin_seconds = facts.span / run_facts.TIMELINE_BINS
        for lane in facts.lanes.values():
            spans = lane.spans(bin_seconds)
            assert not lane.chunks and len(spans) <= run_facts.TIMELINE_BINS
            # Each process was busy nine tenths of the time: binned, its lane is one bar end to end.
            assert spans == [(0.0, pytest.approx(facts.span))]
            assert lane.load == (0.0, 2.0)
    # What still grows is the set of finished chunks listed from the outputs (~160 B a chunk); a
    # record held per chunk, as before, cost ~1.5 KB a chunk.
    per_chunk = (peaks[20_000] - peaks[2_000]) / 18_000
    assert per_chunk < 250, peaks


@pytest.mark.slow
def _on_a_schedule(layout: Any, chunk_seconds: float, batch_rows: int) -> None:
    """Rewrite each chunk output's times: chunk i starts at i * chunk_seconds and runs nine tenths of
    it, its rows arriving ``batch_rows`` at a time at even steps (what ``rows_at`` records)."""
    from datetime import UTC, datetime, timedelta

    from chunkq.jobs.contract.run_files import atomic_write_json

    t0 = datetime(2026, 11, 1, tzinfo=UTC)
    for index in layout.done_chunks():
        meta = read_json(layout.output_meta(index))
        rows, busy = int(meta["rows"]), chunk_seconds * 0.9
        batches = -(-rows // batch_rows)
        started = t0 + timedelta(seconds=index * chunk_seconds)
        meta["started_at"] = started.isoformat()
        meta["finished_at"] = (started + timedelta(seconds=busy)).isoformat()
        meta["rows_at"] = [
            [busy * (k + 1) / batches, min(rows, (k + 1) * batch_rows)] for k in range(batches)
        ]
        atomic_write_json(layout.output_meta(index), meta)
    for stale in (*layout.ledger.glob("*"), layout.summary):  # rebuilt from the rewritten outputs
        stale.unlink(missing_ok=True)


def test_the_report_of_a_run_numbers_each_chunk_when_few_and_bins_them_when_many(
    encoded_run: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chunkq.tools import report, run_facts

    layout, _, _ = encoded_run
    numbered = run_facts.gather(Run.of(layout))
    assert sorted(c for lane in numbered.lanes.values() for _, _, c in lane.chunks) == list(range(5))
    monkeypatch.setattr(run_facts, "LABELLED_CHUNKS", 0)
    binned = run_facts.gather(Run.of(layout))
    assert all(
        not lane.chunks and lane.spans(binned.span / run_facts.TIMELINE_BINS)
        for lane in binned.lanes.values()
    )
    # The rate panel shows a rate, not each batch's rows arriving at once (issues 24.5, 37.6): rows
    # are placed when encoded (each chunk's samples), the window spans two gaps between samples or
    # more, and no point is far above the run's own rate. Read on a schedule the test writes: a
    # bound on a rate sampled from the real run depends on how the scheduler placed its chunks
    # (issue 55: 41.7 against 2.5 x 13.2 at rest, a slow first chunk beside fast ones).
    _on_a_schedule(layout, chunk_seconds=1.0, batch_rows=4)
    even = run_facts.gather(Run.of(layout))
    _, rates, window = even.rate_curve()
    assert even.samples == 5 and even.span == pytest.approx(4.9)
    assert window >= run_facts.RATE_WINDOW_SAMPLES * even.sample_seconds / even.samples
    # Each batch's 4 rows arrive at one instant: unsmoothed, one slice of the span reads 4 / 0.0245 s.
    assert rates.max() <= 2.5 * even.throughput.rows_per_second(running=False)
    numbers = report.write_report(Run.of(layout), tmp_path / "r")
    assert (tmp_path / "r" / "report.png").stat().st_size > 20_000
    assert (numbers["chunks_done"], numbers["rows_done"], numbers["worker_processes"]) == (5, 47, 1)


def test_a_stopped_run_says_so_with_the_rate_it_ran_at_and_no_eta(encoded_run: Any) -> None:
    """Issue 24.7: ``chunkq status`` of an interrupted run (no process owns it) must not show an
    ETA, nor a rate that keeps falling while nothing runs."""
    from chunkq.supervisor.result.chunk_reads import set_aside
    from chunkq.supervisor.watch.display import describe

    layout, _, _ = encoded_run
    manifest = load_manifest(layout)
    set_aside(layout, 4)
    kept = [read_json(layout.output_meta(i)) for i in range(4)]
    snap = store_snapshot(layout, manifest)
    assert not snap.settled and not snap.owned and snap.eta_seconds is None
    assert (snap.chunks_done, snap.rows_done) == (4, 40)  # the short last chunk (7 rows) is the one missing
    assert snap.rows_per_second == of_outputs(kept).rows_per_second(running=False)
    line = describe(snap)
    assert "not running: no process supervises it" in line and "ETA" not in line


def test_start_up_is_not_an_alarm_until_warn_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24.7: workers loading the model for the first seconds are "starting", not "no worker has
    taken a job"; past warn_idle it is said (and logged once per warn_idle)."""
    import time
    from types import SimpleNamespace

    from chunkq.supervisor.watch.display import describe
    from chunkq.supervisor.watch.snapshot import Snapshot
    from chunkq.supervisor.watch.supervise import Supervisor, WatchSettings

    watcher: Any = SimpleNamespace(
        settings=WatchSettings(warn_idle=30.0), idle_since=None, idle_warned=time.monotonic()
    )
    snap = Snapshot("r", 4, 40, chunks_queued=4, queue="chunkq")
    Supervisor._watch_idle(watcher, snap)
    assert snap.starting and snap.idle_seconds is None
    assert "starting: workers are loading the model" in describe(snap) and "no worker" not in describe(snap)
    watcher.idle_since = time.monotonic() - 31
    later = Snapshot("r", 4, 40, chunks_queued=4, queue="chunkq")
    Supervisor._watch_idle(watcher, later)
    assert not later.starting and later.idle_seconds is not None and later.idle_seconds >= 31
    assert "no worker has taken a job from queue 'chunkq' for 31 s" in describe(later)


def test_when_chunkq_started_the_pool_it_never_asks_for_another(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 37.2: after a resume and under chunkq.embed the warning said "start one: chunkq pool"
    while chunkq's own pool was still loading."""
    import time
    from collections import Counter
    from types import SimpleNamespace

    from chunkq.supervisor.watch import idle as idle_module
    from chunkq.supervisor.watch.display import describe
    from chunkq.supervisor.watch.snapshot import Snapshot
    from chunkq.supervisor.watch.supervise import Supervisor, WatchSettings

    monkeypatch.setattr(idle_module, "busy_with", lambda connection, queue: (0, Counter()))  # no worker yet
    now = time.monotonic()
    watcher: Any = SimpleNamespace(
        settings=WatchSettings(warn_idle=30.0, own_pool_started=now - 45),
        idle_since=now - 31,
        idle_warned=0.0,
        manifest=SimpleNamespace(run_id="r", queue="chunkq.r", pool_queue="chunkq"),
        connection=None,
    )
    snap = Snapshot("r", 4, 40, chunks_queued=4, queue="chunkq")
    with caplog.at_level(logging.WARNING):
        Supervisor._watch_idle(watcher, snap)
    assert "its pool is starting (45 s)" in describe(snap) and "no worker has taken" not in describe(snap)
    assert "the pool chunkq started 45 s ago has taken no job from queue 'chunkq' for 31 s" in caplog.text
    assert "its workers are still starting" in caplog.text and "chunkq pool --queue" not in caplog.text


def test_a_damaged_ledger_line_costs_only_that_record(tmp_path: Path) -> None:
    """A batch is parsed whole; a torn line (a disk filled mid-write) falls back to line by line."""
    from chunkq.jobs.contract.run_files import RunLayout
    from tests.helpers import _write_manifest

    layout = RunLayout(tmp_path, "damaged")
    _write_manifest(tmp_path, "damaged", 10, 1, 10)
    layout.ledger.mkdir(parents=True)
    lines = [json.dumps({"chunk": i, "rows": 1}) for i in range(4)]
    (layout.ledger / "000000.jsonl").write_text(
        "\n".join([*lines[:2], '{"chunk": 9, "ro', *lines[2:]]) + "\n"
    )
    (layout.ledger / "000001.jsonl").write_text(json.dumps({"chunk": 4, "rows": 1}) + "\n")
    assert [r["chunk"] for r in read_ledger(layout, load_manifest(layout))] == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_a_one_off_look_with_redis_reads_the_summary_not_the_ledger(
    encoded_run: Any, connection: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`chunkq status RUN` with Redis at 10^5 chunks read the whole ledger to record nothing (0.87 s)."""
    from chunkq.supervisor.watch.progress import Tracker

    layout, _, _ = encoded_run
    manifest = load_manifest(layout)
    owner = store_snapshot(layout, manifest)  # builds the ledger and its summary
    batches: list[str] = []
    real = ledger_module._parse_batch
    monkeypatch.setattr(ledger_module, "_parse_batch", lambda lines: batches.append("read") or real(lines))
    look = Tracker(connection, layout, manifest, records=False).poll()
    assert batches == []
    assert (look.chunks_done, look.rows_done) == (manifest.chunks, 47)
    assert look.rows_per_second == owner.rows_per_second
    assert Tracker(connection, layout, manifest).ledger is not None and batches  # the owner reads it


def test_a_rebuilt_ledger_of_one_file_is_read_a_batch_at_a_time(tmp_path: Path) -> None:
    """A reader's rebuild writes every record to one file; parsing it whole held ~1.4 KB a chunk
    (138 MB at 10^5 chunks)."""
    import tracemalloc

    from chunkq.jobs.contract.run_files import RunLayout
    from tests.helpers import _write_manifest

    layout = RunLayout(tmp_path, "rebuilt")
    _write_manifest(tmp_path, "rebuilt", 20_000, 1, 20_000)
    layout.ledger.mkdir(parents=True)
    record = {k: "2026-11-24T04:00:00.000000+00:00" for k in ledger_module.RECORD_KEYS}
    lines = [json.dumps({**record, "chunk": i, "rows": 1}) for i in range(20_000)]
    (layout.ledger / "rebuilt-1-1.jsonl").write_text("\n".join(lines) + "\n")
    del lines
    tracemalloc.start()
    try:
        count = sum(1 for _ in read_ledger(layout, load_manifest(layout)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 20_000
    # One batch of lines and records (each key here a 32-character string; 4.3 MB since records
    # gained "source", issue 32); the file whole: ~40 MB.
    assert peak < 5 * 2**20


def test_a_ledger_record_outside_the_run_is_skipped_and_sizes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 37.11: a record of chunk -1 stopped every resume (`chunk index -1 is negative`), one of
    chunk 10^12 asked for 931 GiB. Records with rows their chunk does not hold are not this run's."""
    from chunkq.jobs.contract.run_files import RunLayout
    from tests.helpers import _write_manifest

    layout = RunLayout(tmp_path, "forged")
    _write_manifest(tmp_path, "forged", 3, 2, 5)  # chunks of 2, 2 and 1 rows
    layout.ledger.mkdir(parents=True)
    records = [
        {"chunk": 0, "rows": 2},
        {"chunk": -1, "rows": 2},
        {"chunk": 10**12, "rows": 2},
        {"chunk": 1, "rows": 2_000_000},
        {"chunk": True, "rows": 2},
        {"chunk": 2, "rows": 1},
    ]
    (layout.ledger / "000000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with caplog.at_level(logging.WARNING):
        assert [r["chunk"] for r in read_ledger(layout, load_manifest(layout))] == [0, 2]
        ledger = ledger_module.Ledger.open(layout, load_manifest(layout))
    assert sorted(ledger.recorded) == [0, 2] and ledger.throughput.rows == 3
    assert "4 ledger record(s) not of this run's chunks skipped" in caplog.text


def test_a_stray_output_or_an_inflated_summary_never_shows_as_done(tmp_path: Path) -> None:
    """Issue 37.15: a stray outputs/000000000099.json made status say "11/10 done, -1 not done"; an
    inflated summary.json made it show 2,000,000 of 200 rows."""
    from chunkq.jobs.contract.run_files import RunLayout, atomic_write_json
    from chunkq.supervisor.watch.snapshot import store_snapshot
    from tests.helpers import write_encoded_run

    layout = write_encoded_run(tmp_path, "stray", rows=200, chunk_size=20, dim=8)
    manifest = load_manifest(layout)
    (layout.outputs / "000000000099.json").write_text("{}")
    (layout.outputs / "000099.json").write_text("{}")  # a chunk name, but not a chunk of this run
    snap = store_snapshot(layout, manifest)
    assert (snap.chunks_done, snap.rows_done) == (10, 200)
    summary = json.loads(layout.summary.read_text()) if layout.summary.is_file() else None
    if summary is None:
        ledger_module.Ledger.open(layout, load_manifest(layout)).flush(force=True)
        summary = json.loads(layout.summary.read_text())
    atomic_write_json(layout.summary, {**summary, "rows_recorded": 2_000_000})
    again = store_snapshot(RunLayout(tmp_path, "stray"), manifest)
    assert again.rows_done == 200 and again.rows_per_second is not None and again.rows_per_second < 2_000_000
