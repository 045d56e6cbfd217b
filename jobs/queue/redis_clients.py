"""chunkq's Redis clients, each with a limit on how long it waits for a reply.

A Redis that stops answering keeps its connections open: the container is paused, the process
stopped, or its host cut off by the network (redis/redis-py#2243: "add an iptables DROP rule ...
the process hangs", its client left with ``socket_timeout=None``). Every read then waits for as long
as the client allows, and a process in such a read neither stops when asked nor gets on with its
work. Each chunkq client says its limit itself rather than trust the installed redis-py's default,
which is none before redis-py 6. A limit given in the URL (``?socket_timeout=30``) wins, as in
redis-py.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from chunkq.jobs.contract.defaults import REDIS_REPLY_SECONDS


def connect(url: str, **options: Any) -> redis.Redis:
    """A client to ``url`` whose commands fail as ``redis.TimeoutError`` once Redis has not answered
    for REDIS_REPLY_SECONDS."""
    limits = {"socket_timeout": REDIS_REPLY_SECONDS, "socket_connect_timeout": REDIS_REPLY_SECONDS}
    return redis.Redis.from_url(url, **{**limits, **options})


def client_like(connection: redis.Redis, **overrides: Any) -> redis.Redis:
    """A client of its own to ``connection``'s server, with its settings less ``overrides``."""
    pool = connection.connection_pool
    kwargs = {**pool.connection_kwargs, **overrides}
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))


def one_try(connection: redis.Redis, seconds: float) -> redis.Redis:
    """A client like ``connection`` that tries each command once and waits ``seconds`` at most:
    for what a process does beside its work (a note, a progress report), which must not hold it."""
    return client_like(
        connection, socket_timeout=seconds, socket_connect_timeout=seconds, retry=Retry(NoBackoff(), 0)
    )
