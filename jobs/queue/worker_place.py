"""Where a worker runs, written into its RQ record, so that a supervisor sharing its host can tell a
dead worker from a silent one at once instead of waiting for the chunk's heartbeat to go stale.

The embedded Redis is private to one run, so its next run fails every started job as abandoned on
sight (supervisor/local_run.py). A user's own Redis is shared: a started job may be a live worker's
on another host, and only a stale heartbeat (60 s) said it was not. After ``kill -9`` of a ``chunkq
run`` (its pool and workers die with it) the same command then waited those 60 s for the chunk it had
in hand. A pid is evidence only where it means the same process: the same kernel boot and the same
PID namespace (containers on one host have their own), which ``this_place`` names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import redis

from chunkq.jobs.contract.process_clock import ran_since
from chunkq.jobs.queue.rq_api import Job, SimpleWorker, str_to_date

PLACE_FIELD = "chunkq_place"
POOL_FIELD = "chunkq_pool_pid"
_FIELDS = ["pid", "birth", PLACE_FIELD, POOL_FIELD]  # of a worker's record, as _record reads them


def this_place() -> str | None:
    """This kernel boot and PID namespace; None where Linux's /proc does not say (no check is made)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{boot}/{namespace}"


def place_fields(pool_pid: str | None) -> dict[str, str]:
    """What a worker adds to its RQ record: where it runs and the pool that watches it."""
    place = this_place()
    if place is None:
        return {}
    return {PLACE_FIELD: place, POOL_FIELD: pool_pid or ""}


@dataclass(frozen=True)
class _Record:
    pid: int
    born: float
    pool: int | None


def _record(fields: list[bytes | None], place: str) -> _Record | None:
    """A worker's record, when it was written at ``place``; None when it says nothing usable."""
    pid, birth, its_place, pool = (f.decode() if f else "" for f in fields)
    if its_place != place or not pid.isdigit() or not birth:
        return None
    try:
        born = str_to_date(birth).timestamp()
    except ValueError:
        return None
    return _Record(int(pid), born, int(pool) if pool.isdigit() else None)


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
                SimpleWorker.redis_worker_namespace_prefix + name, "pid", "birth", PLACE_FIELD, POOL_FIELD
            )
        records = dict(zip(held, pipe.execute(), strict=True))
    return _judged(records, held, place)


def _judged(records: Mapping[str, list[bytes | None]], held: Mapping[str, str], place: str) -> dict[str, str]:
    gone = {}
    for job_id, fields in records.items():
        record = _record(fields, place)
        if record is None or ran_since(record.pid, record.born):
            continue
        if record.pool is not None and ran_since(record.pool, record.born):
            continue
        gone[job_id] = f"its worker {held[job_id]} (pid {record.pid}) and its pool are gone"
    return gone
