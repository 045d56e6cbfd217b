"""A started job whose worker ran on this host and died with its pool is named at once (worker_place),
on a real Redis, from worker records written with chunkq's fields as a worker writes them; a worker
that may live, or whose pool lives to report it, is never named."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from chunkq.jobs.queue import worker_place
from chunkq.jobs.queue.rq_api import Job, SimpleWorker

pytestmark = pytest.mark.skipif(worker_place.this_place() is None, reason="needs Linux's /proc and /dev/shm")


def _dead_mark() -> str:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    mark = worker_place.process_mark(proc.pid)
    proc.wait(timeout=60)
    assert mark is not None
    return mark


@pytest.fixture
def live_mark() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        mark = worker_place.process_mark(proc.pid)
        assert mark is not None
        yield mark
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _started(connection: redis.Redis, job_id: str, worker: str, pool: str, place: str | None = None) -> None:
    """A started job held by worker ``w-JOB``, whose record names it and its pool as marks."""
    name = f"w-{job_id}"
    connection.hset(Job.key_for(job_id), mapping={"status": "started", "worker_name": name})
    record = {"pid": worker.partition("@")[0], "hostname": "any", worker_place.POOL_FIELD: pool}
    record |= {
        worker_place.PLACE_FIELD: place or worker_place.this_place(),
        worker_place.PROCESS_FIELD: worker,
    }
    connection.hset(SimpleWorker.redis_worker_namespace_prefix + name, mapping=record)


def test_only_a_worker_gone_with_its_pool_is_named(connection: redis.Redis, live_mark: str) -> None:
    dead = _dead_mark()
    _started(connection, "wp-gone", dead, _dead_mark())
    _started(connection, "wp-no-pool", dead, "")  # started without a pool: none to report it
    _started(connection, "wp-alive", live_mark, "")
    _started(connection, "wp-pool-alive", dead, live_mark)  # its pool fails the job itself
    _started(connection, "wp-elsewhere", dead, "", place="another-boot/pid:[1]/token")
    connection.hset(Job.key_for("wp-no-worker"), "status", "started")  # no worker named yet
    ids = ["wp-gone", "wp-no-pool", "wp-alive", "wp-pool-alive", "wp-elsewhere", "wp-no-worker", "wp-none"]
    gone = worker_place.gone_workers(connection, ids)
    assert sorted(gone) == ["wp-gone", "wp-no-pool"]
    assert gone["wp-gone"] == f"its worker w-wp-gone (pid {dead.partition('@')[0]}) and its pool are gone"


def test_a_pid_given_to_another_process_is_not_the_worker(connection: redis.Redis, live_mark: str) -> None:
    """The kernel reuses pids: a live pid that started at another clock tick is another process,
    whatever the wall clock did since (the hostile pass: a clock stepped forward made live workers
    read as reused when their start was compared with their record's time)."""
    pid, _, start = live_mark.partition("@")
    earlier = f"{pid}@{int(start) - 100}"
    _started(connection, "wp-reused", earlier, "")
    _started(connection, "wp-same", live_mark, "")
    _started(connection, "wp-pool-reused", _dead_mark(), earlier)
    assert sorted(worker_place.gone_workers(connection, ["wp-reused", "wp-same", "wp-pool-reused"])) == [
        "wp-pool-reused",
        "wp-reused",
    ]


def test_a_record_without_chunkqs_fields_is_never_judged(connection: redis.Redis) -> None:
    """A worker of an older chunkq, or plain RQ's, says nothing of where it runs."""
    connection.hset(Job.key_for("wp-plain"), mapping={"status": "started", "worker_name": "plain"})
    connection.hset(SimpleWorker.redis_worker_namespace_prefix + "plain", mapping={"pid": 1, "hostname": "x"})
    assert worker_place.gone_workers(connection, ["wp-plain"]) == {}


HIDDEN = """
import os, sys
from chunkq.jobs.queue import worker_place  # before the user changes: it may not read this Python
os.setgid(65534); os.setuid(65534)
print(worker_place.gone(sys.argv[1]), worker_place.gone(sys.argv[2]))
"""


def test_a_process_another_user_may_not_see_is_alive(tmp_path: Path, live_mark: str) -> None:
    """The hostile pass: a supervisor run as another user, /proc mounted with hidepid=2 (hardened
    shared hosts), read every root worker as gone and failed a live worker's chunk. Here the same
    look from uid 65534 in a mount namespace of its own: a live root process is alive; a dead pid is
    still gone."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to mount a proc of its own and become another user")
    dead = _dead_mark()
    mount = "mount -t proc -o hidepid=2 proc /proc"
    script = f'{mount} && exec {sys.executable} -c "$1" "$2" "$3"'
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", HIDDEN, live_mark, dead]
    seen = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if seen.returncode != 0 and ("unshare" in seen.stderr or "mount" in seen.stderr):
        pytest.skip(f"cannot mount a hidepid proc here: {seen.stderr.strip()[-300:]}")
    assert seen.stdout.split() == ["False", "True"], seen.stderr[-2000:]
