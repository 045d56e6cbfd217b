"""Runs that share workers take turns: each run's chunks in a queue of its own, served round-robin.

One FIFO queue for every run let a run of 10,000 small chunks take every worker for five minutes
while another run waited behind its whole backlog (issue 65.1). Now a run's jobs go to the RQ queue
``<queue>.<run id>`` (``run_queue``), which its supervisor lists, with the run's priority, in a
sorted set beside the queue the pools listen on (``register``). Before each wait for a job a worker
reads that set and takes its queues in ``serving_order``: the runs in turn, a run of priority N
taking N turns for each turn of a priority-1 run, starting one turn further after each job it took.
So no run waits behind another's backlog, and each run's registries (failed, started, finished)
are its own in RQ's tools and the dashboard. The pools' queue itself comes last: jobs queued there
by a run submitted before this change are still taken.
"""

from __future__ import annotations

from typing import Any

import redis

from chunkq.jobs.queue.rq_api import (
    DeferredJobRegistry,
    FailedJobRegistry,
    Queue,
    ScheduledJobRegistry,
    StartedJobRegistry,
)

RUN_QUEUES_PREFIX = "chunkq:run-queues:"
MAX_PRIORITY = 100


def run_queue(pool_queue: str, run_id: str) -> str:
    """The RQ queue a run's chunk jobs go to."""
    return f"{pool_queue}.{run_id}"


def run_queues_key(pool_queue: str) -> str:
    return RUN_QUEUES_PREFIX + pool_queue


def register(connection: redis.Redis, pool_queue: str, queue: str, priority: int) -> None:
    """The run's queue is served by the pools of ``pool_queue`` from now on."""
    if queue != pool_queue:
        connection.zadd(run_queues_key(pool_queue), {queue: priority})


def unregister(connection: redis.Redis, pool_queue: str, queue: str) -> None:
    """A settled run's queue is no longer looked at (its registries stay, for RQ's tools)."""
    if queue != pool_queue:
        connection.zrem(run_queues_key(pool_queue), queue)


def retire(connection: redis.Redis, pool_queue: str, queue: str) -> bool:
    """Take a settled run's queue out of RQ's list of queues (``rq info``, the dashboard) if nothing
    is left in it or its registries: one queue a run, kept for good, piled up a line a run there.
    A queue with failed chunks stays, for their tracebacks. A job queued meanwhile keeps it (RQ
    lists a queue again as it queues into it); whether it was removed."""
    if queue == pool_queue:
        return False
    rq_queue = Queue(queue, connection=connection)
    registries = [
        kind(queue, connection=connection).key
        for kind in (FailedJobRegistry, StartedJobRegistry, DeferredJobRegistry, ScheduledJobRegistry)
    ]
    with connection.pipeline() as pipe:
        try:
            pipe.watch(rq_queue.key, *registries)  # type: ignore[no-untyped-call]
            if pipe.llen(rq_queue.key) or any(pipe.zcard(key) for key in registries):
                return False
            pipe.multi()
            pipe.srem(Queue.redis_queues_keys, rq_queue.key)
            pipe.delete(rq_queue.key)
            pipe.execute()
        except redis.WatchError:
            return False
    return True


def listed(connection: redis.Redis, pool_queue: str) -> list[tuple[str, int]]:
    """The runs' queues the pools of ``pool_queue`` serve, with their priorities, by name."""
    found: list[tuple[Any, float]] = connection.zrange(run_queues_key(pool_queue), 0, -1, withscores=True)  # type: ignore[assignment]
    return sorted(
        (name.decode() if isinstance(name, bytes) else str(name), int(score)) for name, score in found
    )


def serving_order(queues: list[tuple[str, int]], turn: int, pool_queue: str) -> list[str]:
    """The order a worker looks in at its ``turn``-th job: a weighted round-robin of the runs'
    queues (a queue of priority N has N of the turns), from the turn's place, then ``pool_queue``."""
    turns = [name for name, priority in queues for _ in range(max(1, min(priority, MAX_PRIORITY)))]
    order: list[str] = []
    if turns:
        start = turn % len(turns)
        for name in turns[start:] + turns[:start]:
            if name not in order:
                order.append(name)
    return [*order, pool_queue]
