"""Issue 37.5/37.6: progress counted within a chunk, a quiet terminal with the run's log in a file,
and the report drawing rows when they were encoded, the start-up, and failures where they ran."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

from chunkq.jobs.compute import chunk_progress
from chunkq.jobs.contract.manifest import RunManifest, load_manifest
from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.supervisor.store import run_log
from chunkq.supervisor.store.attempts import FailedAttempt
from chunkq.supervisor.store.throughput import Throughput
from chunkq.supervisor.watch.display import describe
from chunkq.supervisor.watch.progress import Tracker
from chunkq.supervisor.watch.snapshot import Snapshot, set_rate
from chunkq.tools import report, run_facts
from tests.helpers import CLI, cli_env, make_texts, run_cli, wait_for, write_corpus

T0 = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


def _at(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat()


def test_the_rate_counts_rows_running_chunks_have_encoded_and_a_resume_counts_from_its_restart() -> None:
    first = Snapshot("r", chunks=10, rows=1000, rows_encoding=100, encoding_since=(T0.timestamp()))
    throughput = Throughput()
    # Nothing published yet: 100 rows encoded in the 10 s since the first chunk began.
    assert throughput.rows_per_second(True, T0 + timedelta(seconds=10), 100, T0) == pytest.approx(10.0)
    set_rate(first, throughput)  # now is later than T0: a rate, and an ETA for the rows not yet encoded
    assert first.rows_per_second is not None and first.eta_seconds is not None
    assert "rows 0/1,000 (+100 encoding)" in describe(first)
    # 100 rows published in a 10 s span; stopped an hour; resumed 20 s ago and 50 rows encoded since.
    throughput.add({"rows": 100, "started_at": _at(0), "finished_at": _at(10)})
    now, resumed = T0 + timedelta(seconds=3650), T0 + timedelta(seconds=3630)
    assert throughput.rows_per_second(True, now, 50, resumed) == pytest.approx(150 / 30)
    # Without a report of the resumed work, the stop counts only up to the pause allowance.
    assert throughput.rows_per_second(True, now) == pytest.approx(100 / 310)


def test_the_terminal_shows_progress_and_warnings_and_pool_lines_keep_their_level() -> None:
    handler = run_log.TerminalLog(logging.WARNING)

    def shown(name: str, level: int) -> bool:
        return handler.filter(logging.LogRecord(name, level, "", 0, "m", None, None))

    assert not shown("rq.worker", logging.INFO) and not shown("chunkq.jobs.embed", logging.INFO)
    assert shown(run_log.PROGRESS_LOGGER, logging.INFO) and shown(
        "chunkq.queue_worker.processes.pool", logging.WARNING
    )
    lines = [
        b"2026-11-24 20:37:01,990 ERROR [w gpu=-] rq.worker: job failed\n",
        b"CUDA kernel errors might be asynchronously reported\n",  # the ERROR record's next line
        b"2026-11-24 20:37:02,036 INFO chunkq.supervisor.watch.retry: retrying\n",
    ]
    levels, level = [], logging.INFO
    for line in lines:
        level = run_log.level_of(line, level)
        levels.append(level)
    assert levels == [logging.ERROR, logging.ERROR, logging.INFO]


def test_the_pool_output_is_drained_into_the_log_file_even_when_the_terminal_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay that stopped reading when the terminal went away would leave the pool blocked on a
    full pipe, and the run stalled."""

    def gone(text: str) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(run_log.TerminalLog, "print_line", staticmethod(gone))
    run_log.show_on_terminal(logging.INFO)
    line = b"2026-11-24 20:37:01,990 WARNING [w gpu=-] chunkq.jobs.embed: " + b"x" * 100 + b"\n"
    read, write = os.pipe()

    def pool() -> None:
        with os.fdopen(write, "wb") as out:
            for _ in range(2000):  # 250 KB: four times a pipe's buffer
                out.write(line)

    with run_log.RunLog(tmp_path / "run.log") as log_file:
        relayed = run_log.relay(os.fdopen(read, "rb"), log_file)
        writer = threading.Thread(target=pool, daemon=True)
        writer.start()
        writer.join(timeout=60)
        assert not writer.is_alive(), "the pool is blocked on a full pipe"
        relayed.join(timeout=60)
    assert (tmp_path / "run.log").read_bytes().count(line) == 2000


def test_after_the_users_stop_the_pools_lines_go_to_the_file_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37.1 under load: after the second Ctrl+C the workers' lines about the chunks they drop
    ("... SystemExit: 0") reached the terminal, which the supervisor's own lines already explain."""
    shown: list[str] = []
    monkeypatch.setattr(run_log.TerminalLog, "print_line", staticmethod(shown.append))
    run_log.show_on_terminal(logging.WARNING)
    line = b"2026-11-24 21:48:09,064 ERROR [w gpu=-] rq.worker: job c__c000000: SystemExit: 0\n"
    read, write = os.pipe()
    with run_log.RunLog(tmp_path / "run.log") as log_file:
        relayed = run_log.relay(os.fdopen(read, "rb"), log_file)
        with os.fdopen(write, "wb") as pool:
            pool.write(line)
            pool.flush()
            wait_for(lambda: len(shown) == 1, 30, "the first line on the terminal")
            log_file.terminal_muted = True  # what PoolProcess does when the user stops the run
            pool.write(line)
        relayed.join(timeout=30)
    assert len(shown) == 1 and (tmp_path / "run.log").read_bytes().count(line) == 2


def _facts(
    records: list[dict[str, Any]], failures: list[FailedAttempt], done: set[int], submitted: float = -30
) -> run_facts.RunFacts:
    data = {"run_id": "r", "rows": 40, "chunks": 4, "chunk_size": 10, "created_at": _at(submitted)}
    manifest = RunManifest(data)
    throughput = Throughput()
    for record in records:
        throughput.add(record)
    facts = run_facts.RunFacts(manifest, throughput, failures=failures, done=done)
    for record in records:
        facts.add(record, labelled=True)
    return facts


def _record(chunk: int, start: float, end: float, **extra: Any) -> dict[str, Any]:
    return {
        "chunk": chunk,
        "rows": 10,
        "started_at": _at(start),
        "finished_at": _at(end),
        "host": "h",
        "pid": 7,
        "worker": "w1",
        "device": "cpu",
        **extra,
    }


def test_the_report_puts_rows_when_encoded_the_start_up_before_and_recovered_chunks_as_done() -> None:
    startup = {
        "pool_started_at": _at(-20),
        "pool_for_run": "r",
        "process_started_at": _at(-5),
        "ready_at": _at(-1),
    }
    # Chunk 0 encoded all its rows in its first second of ten; chunk 1 has no samples (spread).
    records = [
        _record(0, 0, 10, rows_at=[[0.5, 5], [1.0, 10]], startup=startup),
        _record(1, 10, 20),
    ]
    oom = FailedAttempt(2, 1, "oom", "CUDA out of memory", "w9", "h", "cpu", None, _at(15), started=_at(14))
    gone = FailedAttempt(3, 3, "oom", "CUDA out of memory", "w1", "h", "cpu", None, _at(18), quarantined=True)
    facts = _facts(records, [oom, gone], done={0, 1, 3})  # chunk 3 was published by a later run
    first_second = int(1.0 / facts.span * run_facts.RATE_BINS) + 1
    assert (
        facts.rate[:first_second].sum() == 10
        and facts.rate[first_second : run_facts.RATE_BINS // 2].sum() == 0
    )
    assert facts.rate[run_facts.RATE_BINS // 2 :].sum() == 10  # chunk 1's rows over its own ten seconds
    assert facts.startup_began == pytest.approx(-20.0)  # its pool started 20 s before the first chunk
    (lane,) = facts.lanes.values()
    assert lane.startup == (pytest.approx(-5.0), pytest.approx(-1.0))
    assert facts.quarantined == []  # recovered, so not listed as quarantined
    lanes = report._with_failed_only_lanes(facts)
    assert [(x.worker, x.failed_only) for x in lanes] == [("w1", False), ("w9", True)]
    # A pool started for another run (a long-lived one): this run's start-up begins at its submit.
    shared = dict(startup, pool_for_run="other")
    assert _facts([_record(0, 0, 10, startup=shared)], [], {0}, submitted=-8).startup_began == pytest.approx(
        -8
    )


def test_the_length_axis_ends_where_the_texts_are_and_counts_those_beyond() -> None:
    lengths = [20] * 990 + [30] * 9 + [1600]
    top, beyond = report.length_axis(lengths, 512)
    assert top < 512 and beyond == 1  # truncation far out: the axis stays with the data
    assert report.length_axis(lengths, 40) == (pytest.approx(42.0), 1)  # a near truncation point is drawn
    assert report.length_axis([10, 11, 12], None) == (12.0, 0)  # no long tail: every text drawn


@pytest.mark.slow
def test_a_quiet_run_counts_rows_within_its_chunk_and_logs_everything_to_its_file(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str
) -> None:
    ids, texts = make_texts(600, seed=37)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    harmless = json.dumps([{"kind": "oom", "chunks": [99]}])  # no such chunk: only the workers' warning
    args = ["run", str(corpus), "--store", str(store), "--redis-url", redis_url, "--queue", "quiet"]
    args += ["--run-id", "prog", "--chunk-size", "600", "--batch-size", "4"]
    env = cli_env(CHUNKQ_LOG_LEVEL="", CHUNKQ_FAULTS=harmless)
    with subprocess.Popen(
        [*CLI, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        layout = RunLayout(store, "prog")
        wait_for(lambda: layout.manifest.is_file() or proc.poll() is not None, 120, "the run's manifest")
        tracker = Tracker(connection, layout, load_manifest(layout), records=False)
        seen: list[int] = []

        def published() -> bool:
            snap = tracker.poll()
            if snap.chunks_done == 0:
                seen.append(snap.rows_encoding)
            return snap.chunks_done == 1 or proc.poll() is not None

        wait_for(published, 240, "the chunk to be published", interval=0.05)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert any(0 < n < 600 for n in seen), seen  # rows counted while the chunk ran, not only at its end
    assert seen == sorted(seen), str(seen)
    # The terminal: progress and the workers' warning; the log file: every INFO line, RQ's included.
    assert "FAULT INJECTION IS ON" in err and " INFO " not in err and "rq.worker" not in err, err
    assert "run prog: chunks 1/1 done" in err and "600 x 384 embeddings" in out
    logged = run_log.log_path(store, "prog").read_text()
    assert (
        "rq.worker" in logged and "chunk prog__c000000: 600 rows in" in logged and "FAULT INJECTION" in logged
    )
    meta = read_json(layout.output_meta(0))
    samples = meta["rows_at"]
    # the start, the first batch (a start-up figure), then one every 1/SAMPLES of the rows
    assert 2 <= len(samples) <= chunk_progress.SAMPLES + 2 and samples[-1][1] == 600
    assert samples[0][1] == 0 and 0 < samples[1][1] <= 32, samples  # the first batch of 32 on its own
    assert [s[1] for s in samples] == sorted(s[1] for s in samples)
    started = meta["startup"]
    assert started["pool_for_run"] == "prog"
    assert (
        started["pool_started_at"]
        <= started["process_started_at"]
        <= started["ready_at"]
        <= meta["started_at"]
    )
    drawn = run_cli("report", "prog", "--store", str(store))
    assert drawn.returncode == 0, drawn.stderr
    reported = json.loads((layout.root / "report" / "report.json").read_text())
    assert reported["startup_seconds"] > 0
    # Where the seconds before the first row went: the command's steps, then its first worker's
    before = reported["first_row"]
    steps = [name for name, _ in before["marks"]]
    assert before["from"] == "command started" and before["marks"][0] == ["command started", 0.0], before
    for earlier, later in [
        ("imports done, options checked", "Redis up"),
        ("Redis up", "pool started"),
        ("first worker process started", "its warm-up done, ready for a chunk"),
        ("its warm-up done, ready for a chunk", "first chunk started"),
        ("corpus split, chunks queued", "first chunk started"),
        ("first chunk started", "first rows encoded"),
    ]:
        assert steps.index(earlier) < steps.index(later), before
    assert before["first_row_seconds"] == before["marks"][-1][1] > 0
    assert before["warm_up_seconds"] > 0 and 0 <= before["last_chunk_to_result_seconds"] < 60
    phases = reported["phases"]  # issue 64.1: where the command's own seconds went
    assert list(phases)[:4] == ["identify", "split", "queue", "watch"], phases
    assert {"verify", "write", "publish"} <= set(phases) and phases["watch"]["seconds"] > 0
    assert all(v["seconds"] >= 0 and v["cpu_seconds"] >= 0 for v in phases.values())
    shown = (layout.root / "report" / "report.md").read_text()
    assert "| before the first row (seconds since command started) | command started 0.00 s; " in shown
    assert "| the command's phases, seconds (CPU seconds) | identify " in shown
    verbose = run_cli(*args, "-v", CHUNKQ_LOG_LEVEL="")
    assert (
        verbose.returncode == 0
        and " INFO chunkq.supervisor.local_run: run prog: result already published" in verbose.stderr
    )


@pytest.mark.parametrize("width", [80, 100, 160])
def test_the_bar_fits_the_terminal_whole(width: int) -> None:
    """Issue 65.5: at 80 columns the bar's one line was cut off mid-field ("ETA 0:…")."""
    import io

    from rich.console import Console

    from chunkq.supervisor.watch.display import ProgressDisplay

    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True, color_system=None)
    run = "corpus-2026-11-28-9f8e7d6c5b4a"
    snap = Snapshot(run, chunks=1000, rows=1_000_000, chunks_done=512, rows_done=512_000, chunks_retrying=3)
    snap.rows_per_second, snap.eta_seconds = 12_345.0, 3_923.0
    with ProgressDisplay(live=True, console=console) as display:
        display.update(snap)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue()).replace("\r", "\n")
    shown = [line.rstrip() for line in text.splitlines() if "rows" in line]
    assert shown, text
    last = shown[-1]
    assert "…" not in last and len(last) <= width and "ETA 1:05:23 " in last and "3 failed" in last, last
    assert "512/1000 chunks" in last and "12.3k/s" in last if width < 120 else "12,345/s" in last, last
    assert ("512,000/1,000,000" in last and run in last) if width >= 120 else ("512k/1.0M" in last), last


def _frames(out: Any) -> list[str]:
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue()).replace("\r", "\n")
    return [line.rstrip() for line in text.splitlines()]


def test_the_bar_has_no_blank_first_frame_follows_a_drain_and_ends_on_the_stores_count() -> None:
    """A newcomer's pass: the first frame was blank (the bar started before its task), after Ctrl+C
    the bar stayed at 12/20 while the drain finished 3 more chunks, and the last frame said "ETA ?"."""
    import io

    from rich.console import Console

    from chunkq.supervisor.watch.display import ProgressDisplay

    out = io.StringIO()
    console = Console(file=out, width=160, force_terminal=True, color_system=None)
    store = [Snapshot("r", chunks=20, rows=2000, chunks_done=15, rows_done=1500)]
    with pytest.raises(KeyboardInterrupt), ProgressDisplay(live=True, console=console) as display:
        assert out.getvalue() == ""  # nothing drawn before there is something to draw
        looked = Snapshot("r", chunks=20, rows=2000, chunks_done=12, rows_done=1200, rows_encoding=150)
        looked.eta_seconds = 30.0
        display.update(looked)
        display.follow(lambda: store[-1])
        store.append(Snapshot("r", chunks=20, rows=2000, chunks_done=12, rows_done=1200))
        display.tick()  # the store, before the running chunks published: the bar does not move back
        assert [f for f in _frames(out) if "rows" in f][-1].count("1,350/2,000"), _frames(out)
        store.append(Snapshot("r", chunks=20, rows=2000, chunks_done=15, rows_done=1500))
        display.tick()
        assert "ETA stopping" in [f for f in _frames(out) if "rows" in f][-1]
        raise KeyboardInterrupt
    frames = [f for f in _frames(out) if "rows" in f]
    assert frames[0].strip(), frames  # the first frame has the bar, not a blank line
    assert "rows 1,500/2,000" in frames[-1] and "chunks 15/20" in frames[-1], frames
    assert "ETA stopped" in frames[-1], frames
    done = io.StringIO()
    with ProgressDisplay(live=True, console=Console(file=done, width=160, force_terminal=True)) as display:
        display.update(Snapshot("r", chunks=2, rows=20, chunks_done=2, rows_done=20, result_published=True))
    assert "ETA done" in [f for f in _frames(done) if "rows" in f][-1], _frames(done)


def test_chunk_labels_are_drawn_where_they_fit_only() -> None:
    """Issue 65.5: the report's PNG labelled every chunk, 1,000 of them an unreadable strip."""
    from chunkq.tools.report import labelled_chunks

    many = [(i * 0.1, i * 0.1 + 0.1, i) for i in range(1000)]  # 100 s of 0.1 s chunks
    assert labelled_chunks(many, 100.0, 7) == []
    few = [(0.0, 30.0, 0), (30.0, 60.0, 1), (60.0, 60.2, 2)]  # two wide chunks and a sliver
    assert [c for _, _, c in labelled_chunks(few, 60.0, 10)] == [0, 1]
