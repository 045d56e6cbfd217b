"""A started job whose worker ran on this host and died with its pool is named at once (worker_place),
on a real Redis, from worker records written as RQ writes them with chunkq's two fields; a worker
that may live, or whose pool lives to report it, is never named."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import redis

from chunkq.jobs.contract.process_clock import process_started_at
from chunkq.jobs.queue import worker_place
from chunkq.jobs.queue.rq_api import Job, SimpleWorker

pytestmark = pytest.mark.skipif(worker_place.this_place() is None, reason="needs Linux's /proc")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


@pytest.fixture
def live_pid() -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _started(
    connection: redis.Redis, job_id: str, pid: int, pool: int | None, born: float, place: str | None = None
) -> None:
    """A started job held by worker ``w-JOB``, whose record says it was born at ``born``."""
    name = f"w-{job_id}"
    connection.hset(Job.key_for(job_id), mapping={"status": "started", "worker_name": name})
    birth = datetime.fromtimestamp(born, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # RQ's utcformat
    record = {"pid": pid, "birth": birth, "hostname": "any"}
    record |= {
        worker_place.PLACE_FIELD: place or worker_place.this_place(),
        worker_place.POOL_FIELD: pool or "",
    }
    connection.hset(SimpleWorker.redis_worker_namespace_prefix + name, mapping=record)


def test_only_a_worker_gone_with_its_pool_is_named(connection: redis.Redis, live_pid: int) -> None:
    now, dead = time.time(), _dead_pid()
    _started(connection, "wp-gone", dead, _dead_pid(), now)
    _started(connection, "wp-no-pool", dead, None, now)  # started without a pool: none to report it
    _started(connection, "wp-alive", live_pid, None, now)
    _started(connection, "wp-pool-alive", dead, live_pid, now)  # its pool fails the job itself
    _started(connection, "wp-elsewhere", dead, None, now, place="another-boot/pid:[1]")
    connection.hset(Job.key_for("wp-no-worker"), "status", "started")  # no worker named yet
    ids = ["wp-gone", "wp-no-pool", "wp-alive", "wp-pool-alive", "wp-elsewhere", "wp-no-worker", "wp-none"]
    gone = worker_place.gone_workers(connection, ids)
    assert sorted(gone) == ["wp-gone", "wp-no-pool"]
    assert gone["wp-gone"] == f"its worker w-wp-gone (pid {dead}) and its pool are gone"


def test_a_pid_running_again_as_another_process_is_not_the_worker(
    connection: redis.Redis, live_pid: int
) -> None:
    """A pid reused by a process started after the worker's record was born (the kernel reuses pids)."""
    created = process_started_at(live_pid)
    _started(connection, "wp-reused", live_pid, None, born=created - 30)
    _started(connection, "wp-same", live_pid, None, born=created + 0.5)
    assert sorted(worker_place.gone_workers(connection, ["wp-reused", "wp-same"])) == ["wp-reused"]
    _started(connection, "wp-pool-reused", _dead_pid(), live_pid, born=created - 30)
    assert sorted(worker_place.gone_workers(connection, ["wp-pool-reused"])) == ["wp-pool-reused"]


def test_a_record_without_chunkqs_fields_is_never_judged(connection: redis.Redis) -> None:
    """A worker of an older chunkq, or plain RQ's, says nothing of where it runs."""
    connection.hset(Job.key_for("wp-plain"), mapping={"status": "started", "worker_name": "plain"})
    birth = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    connection.hset(
        SimpleWorker.redis_worker_namespace_prefix + "plain", mapping={"pid": _dead_pid(), "birth": birth}
    )
    assert worker_place.gone_workers(connection, ["wp-plain"]) == {}
