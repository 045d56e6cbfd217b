"""Where a worker runs, written into its RQ record, so that a supervisor sharing its host can tell a
dead worker from a silent one at once instead of waiting for the chunk's heartbeat to go stale.

The embedded Redis is private to one run, so its next run fails every started job as abandoned on
sight (supervisor/local_run.py). A user's own Redis is shared: a started job may be a live worker's
on another host, and only a stale heartbeat (60 s) said it was not. After every process of a ``chunkq
run`` was SIGKILLed at once the same command then waited those 60 s for the chunk it had in hand.

A pid is evidence only where it means the same process. The *place* says where: the kernel's boot
id, the PID namespace (containers on one host have their own) and a token this boot's first chunkq
process left in /dev/shm (clones of one VM snapshot share a boot id and the host's namespace
number, not what was written after they parted). Each process is named by its pid and its start in
clock ticks since boot (/proc/PID/stat), so a pid given to a newer process is not it, whatever the
wall clock did meanwhile. A pid this process may not look at (another user's under ``hidepid``)
counts as alive: the hostile pass saw a supervisor run as another user fail a live worker's chunk.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import redis

from chunkq.jobs.contract.process_clock import pid_free, start_ticks
from chunkq.jobs.queue.rq_api import Job, SimpleWorker

PLACE_FIELD = "chunkq_place"
PROCESS_FIELD = "chunkq_process"  # PID@START: the worker
POOL_FIELD = "chunkq_pool"  # PID@START: its pool; empty without one
TOKEN_FILE = Path("/dev/shm/chunkq-place")  # noqa: S108 - a per-boot tmpfs, read by every user


def this_place() -> str | None:
    """This kernel boot, PID namespace and boot token; None where /proc or /dev/shm does not say
    (no judgement is made then)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
        namespace = os.readlink("/proc/self/ns/pid")
        token = _boot_token()
    except (OSError, ValueError):
        return None
    return f"{boot}/{namespace}/{token}"


def _boot_token() -> str:
    try:
        fd = os.open(TOKEN_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w", encoding="ascii") as out:
            os.fchmod(out.fileno(), 0o644)  # whatever the umask: supervisors of other users read it
            out.write(secrets.token_hex(16))
    token = TOKEN_FILE.read_text(encoding="ascii").strip()
    if len(token) != 32:  # being written by another process this very moment, or not chunkq's
        raise ValueError("no boot token")
    return token


def process_mark(pid: int) -> str | None:
    """``PID@START``: the process, told apart from any later one given its pid."""
    start = start_ticks(pid)
    return None if start is None else f"{pid}@{start}"


def place_fields(pool_pid: str | None) -> dict[str, str]:
    """What a worker adds to its RQ record: where it runs, itself, and the pool that watches it."""
    place, me = this_place(), process_mark(os.getpid())
    if place is None or me is None:
        return {}
    pool = process_mark(int(pool_pid)) if pool_pid and pool_pid.isdigit() else None
    return {PLACE_FIELD: place, PROCESS_FIELD: me, POOL_FIELD: pool or ""}


def gone(mark: str) -> bool:
    """Whether the process ``PID@START`` is gone: its pid free, a zombie, or another process's."""
    pid_text, _, start = mark.partition("@")
    if not pid_text.isdigit() or not start:
        return False
    if pid_free(int(pid_text)):
        return True
    now = start_ticks(int(pid_text))
    # None: it exists but /proc hides it (hidepid), or it ended this moment: its beat tells then.
    return now is not None and now != start


def gone_workers(connection: redis.Redis, job_ids: list[str]) -> dict[str, str]:
    """Of the started jobs ``job_ids``, those whose worker ran here and is gone with its pool (no one
    is left to report the job), each with the reason; a worker whose pool lives is left to the pool,
    which fails its job within a second."""
    place = this_place()
    if place is None or not job_ids:
        return {}
    with connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(Job.key_for(job_id), "worker_name")
        names = [n.decode() if n else "" for n in pipe.execute()]
    held = {job_id: name for job_id, name in zip(job_ids, names, strict=True) if name}
    with connection.pipeline(transaction=False) as pipe:
        for name in held.values():
            pipe.hmget(
                SimpleWorker.redis_worker_namespace_prefix + name, PLACE_FIELD, PROCESS_FIELD, POOL_FIELD
            )
        records = dict(zip(held, pipe.execute(), strict=True))
    found = {}
    for job_id, fields in records.items():
        its_place, worker, pool = (f.decode(errors="replace") if f else "" for f in fields)
        if its_place != place or not worker or not gone(worker) or (pool and not gone(pool)):
            continue
        found[job_id] = f"its worker {held[job_id]} (pid {worker.partition('@')[0]}) and its pool are gone"
    return found
