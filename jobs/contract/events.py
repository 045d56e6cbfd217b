"""A wake-up call for the supervisor: a chunk job of a queue has settled (finished or failed).

Without it the supervisor sees a finished chunk only at its next look, up to one poll interval
later: the last chunk of a run, a failure waiting for its retry. The message carries only the job
id and the supervisor still reads the truth from RQ's registries, so a lost message costs one poll
interval, never correctness.
"""

from __future__ import annotations

import logging

import redis

log = logging.getLogger(__name__)

CHANNEL_PREFIX = "chunkq:settled:"


def settled_channel(queue: str) -> str:
    return CHANNEL_PREFIX + queue


def announce_settled(connection: redis.Redis, queue: str, job_id: str) -> None:
    """Publish that ``job_id`` settled; never fails the caller (the supervisor polls anyway)."""
    try:
        connection.publish(settled_channel(queue), job_id)
    except redis.RedisError as exc:
        log.debug("could not announce that %s settled: %s", job_id, exc)
