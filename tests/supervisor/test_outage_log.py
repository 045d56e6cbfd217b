"""Issue 65.3: a Redis outage is one line when it starts, reminders at growing intervals, one line
when it ends (the supervisor logged one a second: 26 lines for a 25 s restart)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from chunkq.jobs.contract.outage import OutageLog
from chunkq.supervisor.server.embedded_redis import EmbeddedRedis
from chunkq.supervisor.watch.supervise import WatchSettings, _patiently


def test_a_25_s_outage_seen_each_second_is_three_lines_and_its_end(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    going_on = "the run goes on when it is back"
    outage = OutageLog(logging.getLogger("outage"), "Redis", going_on, lambda: now[0])
    with caplog.at_level(logging.WARNING, "outage"):
        for second in range(26):
            now[0] = float(second)
            outage.failed(redis.ConnectionError("Connection refused"))
        now[0] = 25.5
        outage.recovered()
        outage.recovered()  # nothing to say: it is not away
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "Redis unreachable (Connection refused); the run goes on when it is back",
        "Redis still unreachable after 5 s (Connection refused)",
        "Redis still unreachable after 15 s (Connection refused)",
        "Redis is back after 25.5 s",
    ]


def test_a_silent_server_is_away_from_the_look_that_met_it_not_from_its_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The hostile pass: a 6.5 s pause was "back after 1.2 s", its first 5 s spent in the read."""
    now = [105.0]
    outage = OutageLog(logging.getLogger("outage"), "Redis", "it goes on", lambda: now[0])
    with caplog.at_level(logging.WARNING, "outage"):
        outage.failed(redis.TimeoutError("Timeout reading from socket"), began=100.0)
        now[0] = 106.5
        outage.recovered()
    assert caplog.records[-1].getMessage() == "Redis is back after 6.5 s"


def test_the_watch_rides_out_an_outage_in_two_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real server that is not there for 30 tries (a closed port), then is: the supervisor's way
    of riding out an outage says so twice, not 30 times."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    tries: list[int] = []
    servers: list[EmbeddedRedis] = []

    def step() -> bool:
        tries.append(1)
        if len(tries) < 30:
            return bool(redis.Redis("127.0.0.1", closed, retry=Retry(NoBackoff(), 0)).ping())
        if not servers:
            servers.append(EmbeddedRedis(tmp_path / "redis").start())
        return bool(redis.Redis.from_url(servers[0].url).ping())

    try:
        with caplog.at_level(logging.WARNING, "chunkq.supervisor.watch.supervise"):
            assert _patiently(step, WatchSettings(poll_seconds=0.01, redis_patience=60)) is True
    finally:
        for server in servers:
            server.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert len(tries) == 30 and len(lines) == 2, lines
    assert lines[0].startswith("Redis unreachable (") and lines[1].startswith("Redis is back after ")
