"""A Redis that stops answering with its connections open: the server paused (SIGSTOP here, as
``docker pause`` freezes a container) or its host cut off (redis/redis-py#2243: "add an iptables DROP
rule ... the process hangs"). Unlike a Redis that is down, nothing fails at once: each read waits for
as long as its client allows."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from rq.serializers import JSONSerializer

from chunkq.jobs.compute import chunk_progress
from chunkq.jobs.contract.defaults import REDIS_REPLY_SECONDS
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.jobs.queue.redis_clients import connect
from chunkq.queue_worker.chunk_worker import STOP_POLL_SECONDS, ChunkWorker
from chunkq.queue_worker.processes.dead_workers import RELEASE_RETRY_SECONDS, DeadWorkers
from chunkq.supervisor.server.embedded_redis import EmbeddedRedis
from tests.helpers import result_matches, run_cli, start_run_with_a_slow_chunk, stop_tree, wait_for


def _embedded_server(run: subprocess.Popen[bytes]) -> psutil.Process:
    """The Valkey server ``chunkq run`` started for itself."""
    return next(p for p in psutil.Process(run.pid).children(recursive=True) if "valkey" in p.name())


@contextlib.contextmanager
def _server(tmp_path: Path) -> Iterator[tuple[redis.Redis, psutil.Process, str]]:
    """A client to a Redis of the test's own, its process to pause, and its URL."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    assert server.proc is not None
    process = psutil.Process(server.proc.pid)
    try:
        yield connect(server.url), process, server.url
    finally:
        if process.is_running():
            process.resume()
        server.stop()


def test_a_silent_redis_holds_a_chunks_progress_reports_once_not_at_every_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reports are the display's: against a silent server the encode waited a whole reply limit at
    each of them (6 s on a worker's connection; RQ's 415 s before)."""
    monkeypatch.setattr(chunk_progress, "REPORT_SECONDS", 0.0)  # every batch reports
    with _server(tmp_path) as (connection, process, _):
        reporter = chunk_progress.RowsReporter(connection, "r", 0, 100)
        reporter(0)
        assert chunk_progress.read(connection, "r", [0])[0].rows == 0
        process.suspend()
        started = time.monotonic()
        reporter(10)
        first = time.monotonic() - started
        started = time.monotonic()
        for rows in range(11, 101):
            reporter(rows)
        rest = time.monotonic() - started
        process.resume()
    assert chunk_progress.REPLY_SECONDS - 0.1 <= first < chunk_progress.REPLY_SECONDS + 2, first
    assert rest < 0.5, rest  # quiet for QUIET_SECONDS after a report Redis did not take
    assert reporter.rows == 100 and reporter.samples[-1][1] == 100  # the chunk's own record goes on


def test_a_workers_note_of_a_stop_leaves_its_signal_handler_at_once(tmp_path: Path) -> None:
    """RQ notes a stop in Redis from its signal handler, which held the interrupted chunk until a
    silent server timed out; the note is written by a thread once Redis answers again."""
    with _server(tmp_path) as (connection, process, _):
        worker = ChunkWorker(["q"], connection=connection, name="noted", serializer=JSONSerializer)
        limit = connection.connection_pool.connection_kwargs["socket_timeout"]
        assert limit == STOP_POLL_SECONDS + REDIS_REPLY_SECONDS  # not RQ's 415 s
        worker._shutdown_requested_date = datetime.now(UTC)
        process.suspend()
        started = time.monotonic()
        worker.set_shutdown_requested_date()
        assert time.monotonic() - started < 0.5
        process.resume()
        wait_for(lambda: connection.hget(worker.key, "shutdown_requested_date") is not None, 30, "the note")


def test_a_pool_releases_its_dead_workers_jobs_in_one_wait_not_one_each(tmp_path: Path) -> None:
    """The hostile pass: against a silent Redis the pool waited a reply limit for each dead worker
    in turn, a pass of 50 s after a few minutes of restarts, its loop (signals, reaping) held."""
    limit = 0.5
    with _server(tmp_path) as (_, process, url):
        dead = DeadWorkers(connect(url, socket_timeout=limit), "p", "q", 30.0)
        for number in range(5):
            dead.add(f"p-w{number}", "died")
        process.suspend()
        started = time.monotonic()
        dead.release(now=100.0)
        assert time.monotonic() - started < 2 * limit  # one wait, not five
        assert [name for name, _ in dead.pending] == [f"p-w{n}" for n in range(5)]
        started = time.monotonic()
        dead.release(now=100.0 + RELEASE_RETRY_SECONDS - 1)
        assert time.monotonic() - started < 0.1  # not tried again yet
        process.resume()
        dead.release(now=100.0 + RELEASE_RETRY_SECONDS)
        assert dead.pending == []


@pytest.mark.slow
def test_a_run_asked_to_stop_while_its_redis_is_silent_finishes_its_chunk_and_stops(
    tmp_path: Path, reference_model: Any
) -> None:
    """The chunk in hand is encoded and kept, and the run stops, although Redis answers nothing:
    before, the worker's progress reports and RQ's note of the stop (from its signal handler) each
    waited up to RQ's 415 s on the silent server, the chunk with them; the run was stopped at its
    120 s limit with the chunk lost, and ended 165 s after the SIGTERM."""
    proc, log, args, texts = start_run_with_a_slow_chunk(tmp_path, seed=44, seconds=3, chunk=0)
    server = _embedded_server(proc)
    store = tmp_path / "store"
    try:
        server.suspend()
        asked = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: any(store.glob("runs/*/outputs/000000.npy")), 30, "chunk 0's output")
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 90 s after its SIGTERM:\n{log.read_text(errors='replace')[-4000:]}")
        stopped_after = time.monotonic() - asked
    finally:
        if server.is_running():
            server.resume()
        if proc.poll() is None:
            stop_tree(proc)
    assert proc.returncode == 130, log.read_text(errors="replace")[-3000:]
    assert stopped_after < 90
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    (run,) = store.glob("runs/*")
    assert result_matches(RunLayout(store, run.name), texts, reference_model)


@pytest.mark.slow
def test_a_second_ctrl_c_while_the_first_waits_on_a_silent_redis_stops_now(tmp_path: Path) -> None:
    """The hostile pass: the second Ctrl+C, 2 s after the first, landed in the release of the run's
    Redis lock (a 5 s wait on the silent server); the pool was told to drain, and the chunk it was to
    give back was finished instead, 20 s later."""
    proc, log, _, _ = start_run_with_a_slow_chunk(tmp_path, seed=45, seconds=60, chunk=0)
    server = _embedded_server(proc)
    try:
        server.suspend()
        proc.send_signal(signal.SIGINT)
        time.sleep(2)  # the two presses of a user, not one signal delivered twice
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 60 s after two Ctrl+C:\n{log.read_text(errors='replace')[-4000:]}")
    finally:
        if server.is_running():
            server.resume()
        if proc.poll() is None:
            stop_tree(proc)
    said = log.read_text(errors="replace")
    assert "stopping the pool now" in said and proc.returncode == 130, said[-3000:]
    assert not any((tmp_path / "store").glob("runs/*/outputs/000000.npy"))  # given back, not finished
