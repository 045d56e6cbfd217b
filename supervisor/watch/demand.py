"""The work a run asks of the pools, as a Redis list KEDA can read.

KEDA's Redis scaler reads a list's length. RQ's queue list holds the jobs waiting, not those a
worker runs: while the last chunks run the list is empty, KEDA counts no demand, and once its
cooldown passes it scales the pools down under chunks in hand (only their 600 s grace kept a long
last chunk). The supervisor keeps ``chunkq:demand:<queue>`` as long as the chunks queued, running
and waiting for a retry, after each look; KEDA scales on it instead (deploy/k8s/keda.yaml). The list
holds a placeholder per chunk (its length is what counts), expires if no supervisor renews it, and is
emptied when the run settles. Several runs on one queue each add theirs: a hash beside the list
holds each run's, and the list is their sum.
"""

from __future__ import annotations

import logging

import redis

log = logging.getLogger(__name__)

DEMAND_PREFIX = "chunkq:demand:"
DEMAND_TTL_SECONDS = 600  # a supervisor that died stops asking for pools after this


def demand_key(queue: str) -> str:
    return DEMAND_PREFIX + queue


def publish(connection: redis.Redis, queue: str, run_id: str, chunks: int) -> None:
    """This run's demand (chunks queued, running or waiting for a retry) into the queue's list: the
    runs' demands are kept in a hash, and the list is rewritten to their sum."""
    runs_key = f"{demand_key(queue)}:runs"
    try:
        with connection.pipeline(transaction=True) as pipe:
            if chunks:
                pipe.hset(runs_key, run_id, chunks)
            else:
                pipe.hdel(runs_key, run_id)
            pipe.expire(runs_key, DEMAND_TTL_SECONDS)
            pipe.hvals(runs_key)
            values = pipe.execute()[-1]
        total = sum(int(v) for v in values)
        with connection.pipeline(transaction=True) as pipe:
            pipe.delete(demand_key(queue))
            if total:
                pipe.rpush(demand_key(queue), *(["1"] * total))
                pipe.expire(demand_key(queue), DEMAND_TTL_SECONDS)
            pipe.execute()
    except redis.RedisError as exc:  # the scaler's loss for a look, never the run's
        log.debug("could not publish the demand of run %s: %s", run_id, exc)
