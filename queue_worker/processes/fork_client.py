"""The pool's side of the fork server (``fork_server.py``): it starts one of its own, or uses a
standing one (``standing_forks.py``) when it is given its socket and can use it, and has workers
forked there; ``ForkedWorker`` offers the pool what it used of ``subprocess.Popen``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from chunkq.queue_worker.processes import standing_forks
from chunkq.queue_worker.processes.fork_server import (
    MODEL_ENV,
    NVML_BASED_CUDA_CHECK,
    SERVER_MODULE,
    SOCKET_FD_ENV,
    START_TIMEOUT,
    ForkServerError,
    receive_message,
    send_message,
)
from chunkq.queue_worker.processes.lifeline import killed_with_parent, process_alive
from chunkq.queue_worker.processes.stopping import wait_or_kill
from chunkq.queue_worker.worker_args import WORKER_MODULE

log = logging.getLogger(__name__)


class ForkedWorker:
    """A worker forked by the fork server, with the part of ``subprocess.Popen`` the pool uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired([WORKER_MODULE, str(self.pid)], timeout or 0.0)
            self.server.collect(wait=min(0.1, left) if left is not None else 0.1)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """Starts the fork server on first use and again if it dies (or uses the standing one at
    ``standing``, while it can); forks workers through it."""

    def __init__(self, env: dict[str, str], standing: str | None = None) -> None:
        self.env, self.standing = env, standing
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.workers: dict[int, ForkedWorker] = {}

    def _start(self) -> socket.socket:
        if self.standing:
            sock = self._join_standing(self.standing)
            if sock is not None:
                return sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", SERVER_MODULE],
            env=dict(self.env, **{SOCKET_FD_ENV: str(theirs.fileno())}, **NVML_BASED_CUDA_CHECK),
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
            preexec_fn=killed_with_parent,  # it ignores SIGTERM
        )
        theirs.close()
        self.sock = ours
        reply = self._next(START_TIMEOUT)
        if reply is None or "ready" not in reply:
            self.close()
            raise ForkServerError(f"the fork server did not start (it said {reply!r})")
        if "model_seconds" in reply:
            log.info(
                "fork server loaded %s in %.1f s for its workers", self.env[MODEL_ENV], reply["model_seconds"]
            )
        elif "model_error" in reply:
            log.warning(
                "fork server could not load %s (%s); each worker loads it",
                self.env[MODEL_ENV],
                reply["model_error"],
            )
        return ours

    def _join_standing(self, path: str) -> socket.socket | None:
        """Connected to the standing server at ``path``, or None when this pool cannot use it (it
        is then not tried again: a fork server of the pool's own serves instead)."""
        why: str | None
        try:
            self.sock = standing_forks.connect(path)
            reply = self._next(standing_forks.CONNECT_SECONDS)
            why = f"it said {reply!r}" if reply is None or "ready" not in reply else None
            why = why or standing_forks.unlike(reply or {}, self.env)
        except OSError as exc:
            why = str(exc)
        if why is None and self.sock is not None:
            log.info(
                "workers forked by the standing fork server at %s (pid %s)", path, (reply or {})["ready"]
            )
            return self.sock
        log.warning(
            "cannot use the standing fork server at %s (%s); starting one of this pool's own", path, why
        )
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.standing = None
        return None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def _next(self, timeout: float) -> dict[str, Any] | None:
        """The next message that is not an exit report (those are applied), or None on timeout/EOF."""
        deadline = time.monotonic() + timeout
        while self.sock is not None:
            if not select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            message, _ = receive_message(self.sock)
            if message is None:
                self._lost()
                return None
            if "exited" not in message:
                return message
            self._exited(int(message["exited"]), int(message["code"]))
        return None

    def _exited(self, pid: int, code: int) -> None:
        worker = self.workers.pop(pid, None)
        if worker is not None:
            worker.returncode = code

    def _lost(self) -> None:
        """The fork server died: its workers get ORPHANED_SIGNAL from their parent-death signal; wait for
        them to go (they are no longer ours to reap) and report them killed by it."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            self.proc.wait()
            self.proc = None
        for pid in list(self.workers):
            deadline = time.monotonic() + 30
            while process_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
            self._exited(pid, -signal.SIGTERM)

    def collect(self, wait: float = 0.0) -> None:
        """Apply every exit report waiting (up to ``wait`` seconds for the first)."""
        if self.sock is None:
            return
        message = self._next(wait)
        while message is not None:  # a reply nobody waits for: ignore it
            message = self._next(0.0)

    def spawn(self, args: list[str], env: dict[str, str], notify_fd: int) -> ForkedWorker:
        """Fork a worker running ``python -m WORKER_MODULE ARGS`` in ``env``."""
        request = {"args": args, "env": env, "cwd": os.getcwd(), "umask": _umask()}
        sock = self.sock or self._start()
        try:
            send_message(sock, request, [notify_fd, *_stdio()])
        except OSError:
            self._lost()
            sock = self._start()
            send_message(sock, request, [notify_fd, *_stdio()])
        reply = self._next(30.0)
        if reply is None or "started" not in reply:
            raise ForkServerError(f"the fork server did not fork a worker (it said {reply!r})")
        worker = ForkedWorker(self, int(reply["started"]))
        self.workers[worker.pid] = worker
        return worker

    def close(self) -> None:
        """Hang up; the fork server exits (a standing one is told this pool lives on), and any
        worker still alive gets its parent-death signal."""
        if self.sock is not None:
            if self.proc is None:
                with contextlib.suppress(OSError):
                    send_message(self.sock, {"goodbye": True})
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            wait_or_kill(self.proc, 10)
            self.proc = None


def _stdio() -> list[int]:
    """This pool's stdout and stderr, for its workers (both, or none when one is closed)."""
    try:
        for fd in (1, 2):
            os.fstat(fd)
    except OSError:
        return []
    return [1, 2]


def _umask() -> int | None:
    """This process's umask, read without setting it (threads share it): None where Linux does not say."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
