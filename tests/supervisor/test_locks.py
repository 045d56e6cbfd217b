"""The store's lock files (issue 21.2, 21.3): held while their owner lives, never stolen from a live
process on this host, taken over from another host only when unrenewed, and fenced before publishing.

A holder "on another host" is a lock file written with another host name, as a process there would
write it; a paused holder is simulated by its file's age (os.utime), the one thing a pause changes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from chunkq.supervisor.store import store_lock as owner_module
from chunkq.supervisor.store.run_lock import RunLock, RunLockedError
from chunkq.supervisor.store.store_lock import LockLostError, StoreLock
from tests.helpers import wait_for

THEIRS = "theirs"
OLD = 120.0  # seconds: well past owner.STALE_SECONDS


@pytest.fixture
def live_process() -> Iterator[psutil.Process]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield psutil.Process(proc.pid)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _write_holder(path: Path, pid: int, host: str, started: float, age: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    holder = {"pid": pid, "host": host, "started_at": "then", "process_started": started, "token": THEIRS}
    path.write_text(json.dumps(holder))
    then = time.time() - age
    os.utime(path, (then, then))


def test_a_live_holder_on_this_host_is_never_stale_however_old_its_file(
    tmp_path: Path, live_process: psutil.Process
) -> None:
    path = tmp_path / "owner.json"
    _write_holder(path, live_process.pid, socket.gethostname(), live_process.create_time(), OLD)
    with pytest.raises(RunLockedError, match=f"in use by pid {live_process.pid}"):
        StoreLock(path, "run r").acquire()
    assert json.loads(path.read_text())["token"] == THEIRS  # untouched


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    path = tmp_path / "owner.json"
    _write_holder(path, proc.pid, socket.gethostname(), time.time() - 5, age=0)
    lock = StoreLock(path, "run r")
    lock.acquire()
    try:
        assert f"pid {proc.pid} has exited" in lock.took_over
    finally:
        lock.release()


def test_a_killed_holder_not_yet_reaped_is_taken_over_at_once(tmp_path: Path) -> None:
    """The hostile pass: a rerun right after every process was SIGKILLed was refused "in use by pid
    N" while N was a zombie its parent had not reaped yet."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])  # not waited for: a zombie once it ends
    try:
        wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, 30, "a zombie")
        path = tmp_path / "owner.json"
        _write_holder(path, proc.pid, socket.gethostname(), psutil.Process(proc.pid).create_time(), age=0)
        lock = StoreLock(path, "run r")
        lock.acquire()
        assert f"pid {proc.pid} has exited" in lock.took_over
        lock.release()
    finally:
        proc.wait(timeout=30)


def test_a_held_lock_is_renewed_by_its_owner_while_it_is_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(owner_module, "RENEW_SECONDS", 0.05)
    path = tmp_path / "redis" / "owner.json"
    lock = StoreLock(path, "the embedded Redis")
    lock.acquire()
    try:
        then = time.time() - OLD
        os.utime(path, (then, then))
        # Nothing but the lock's own thread renews it: the owner here is "busy" (this test waits).
        wait_for(lambda: time.time() - path.stat().st_mtime < 10, 10, "the lock to be renewed")
        assert StoreLock(path, "").live_holder() is not None
    finally:
        lock.release()
    assert not path.exists()


def test_a_paused_owner_that_was_taken_over_never_renews_removes_or_publishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(owner_module, "RENEW_SECONDS", 0.05)
    path = tmp_path / "owner.json"
    paused = StoreLock(path, "run r")
    paused.acquire()
    paused._stop.set()  # paused: its renewing thread is as stopped as the rest of it
    # Meanwhile another host found the file unrenewed and took it over.
    _write_holder(path, 4242, "another-host", 0.0, age=0)
    with pytest.raises(LockLostError, match="pid 4242 on another-host"):
        paused.check()  # the fencing test the supervisor runs on each look and before publishing
    before = path.stat().st_mtime_ns
    paused.release()
    assert json.loads(path.read_text())["token"] == THEIRS and path.stat().st_mtime_ns == before


def test_another_hosts_lock_is_taken_over_only_when_unrenewed(tmp_path: Path) -> None:
    path = tmp_path / "owner.json"
    _write_holder(path, 4242, "another-host", 0.0, age=5)
    with pytest.raises(RunLockedError, match="in use by pid 4242 on another-host"):
        StoreLock(path, "run r").acquire()
    _write_holder(path, 4242, "another-host", 0.0, age=OLD)
    lock = StoreLock(path, "run r")
    lock.acquire()
    try:
        assert "not renewed for" in lock.took_over
        lock.check()  # ours now
    finally:
        lock.release()


def test_a_garbled_lock_file_says_what_to_do_and_clean_is_never_told_to_wait(tmp_path: Path) -> None:
    """Issue 63.5: a garbled lock file made `chunkq clean` say "run the same command with --wait",
    an option clean does not have. Its refusal names the file and when it is taken over."""
    from tests.helpers import run_cli, write_encoded_run

    store = tmp_path / "store"
    layout = write_encoded_run(store, "r", 20, 10, 4)
    layout.owner.write_text('{"pid": 12')  # half written
    done = run_cli("clean", "r", "--store", str(store), forks=False)
    said = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 10 and "--wait" not in said, said
    assert f"its lock file {layout.owner} cannot be read" in said and "taken over once it is 60 s old" in said
    _write_holder(layout.owner, os.getpid(), socket.gethostname(), psutil.Process().create_time(), age=0)
    busy = run_cli("clean", "r", "--store", str(store), forks=False)
    assert busy.returncode == 10 and "run `chunkq clean r` again once it has finished" in busy.stderr, (
        busy.stderr
    )


def test_a_lock_path_that_is_no_file_is_refused_at_once(tmp_path: Path) -> None:
    """Issue 63's hostile pass: a folder at the lock's path waited a minute and then failed as an
    internal error; a link to nothing made the wait spin without a word."""
    for make, said in (
        (lambda path: path.mkdir(), "is not a file"),
        (lambda path: path.symlink_to(tmp_path / "nowhere"), "is a link to nothing"),
    ):
        path = tmp_path / f"lock-{said.split()[-1]}"
        make(path)
        started = time.monotonic()
        with pytest.raises(RunLockedError, match=f"its lock file {path} {said}; remove it"):
            StoreLock(path, "run r").acquire(wait=True)
        assert time.monotonic() - started < 5


def test_the_supervisor_lock_of_a_run_whose_store_lock_was_taken_over_is_dropped_at_once(
    connection: redis.Redis,
) -> None:
    """A killed supervisor's lock in Redis lives out its TTL (15 s); the successor that took the run's
    store lock over from it drops it instead of waiting, and any other successor still waits."""
    run_id = f"locks-{os.getpid()}"
    dead = RunLock(connection, run_id)
    dead.acquire()  # and never released: its process was killed
    waiting = RunLock(connection, run_id, wait=0.2)
    with pytest.raises(RunLockedError, match=f"another supervisor is watching run {run_id}"):
        waiting.acquire()
    successor = RunLock(connection, run_id, wait=0.2)
    successor.take_over("pid 4242 on this host (pid 4242 has exited)")
    successor.acquire()
    assert successor.lock.owned() and not dead.lock.owned()
    successor.release()
