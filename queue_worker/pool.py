"""The per-host pool: one fresh worker process per slot (GPU x workers-per-GPU, or CPU), restarted
whenever one ends, pinned through its environment, and never left behind as an orphan.

``rq worker-pool`` forks its workers (CUDA cannot be used in a forked child) and cannot give each
one its own environment, hence this pool built on ``subprocess``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import FrameType

from queue_worker import exit_codes
from queue_worker.gpus import GpuInfo, cpu_threads_per_worker, worker_environment
from queue_worker.worker import DEFAULT_QUEUE

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
_PR_SET_PDEATHSIG = 1
# Exits after which starting the same worker again cannot help.
NO_RESTART = {exit_codes.EXIT_CONFIG}


def default_pool_name() -> str:
    return f"pool-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class PoolSettings:
    """Everything a pool needs; read once from CLI flags and CHUNKQ_* variables."""

    redis_url: str
    queue: str = DEFAULT_QUEUE
    workers_per_gpu: int = 1
    cpu_workers: int = 1
    max_jobs: int | None = None
    preload: str | None = None
    precision: str = "fp32"
    name: str = field(default_factory=default_pool_name)
    log_level: str = "INFO"
    restart_delay: float = 1.0  # after an unexpected exit, so a crashing worker cannot spin
    kill_grace: float = 10.0  # after a second signal, before SIGKILL


@dataclass
class Slot:
    """One worker position: a GPU (or the CPU) and whichever process currently fills it."""

    key: str
    gpu: GpuInfo | None
    proc: subprocess.Popen[bytes] | None = None
    generation: int = 0
    retired: bool = False
    not_before: float = 0.0


def die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the pool dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Pool:
    """Starts, watches and restarts the workers of one host."""

    def __init__(self, settings: PoolSettings, gpus: list[GpuInfo]) -> None:
        self.settings = settings
        if gpus:
            self.slots = [
                Slot(key=f"gpu{gpu.index}-w{n}", gpu=gpu)
                for gpu in gpus
                for n in range(settings.workers_per_gpu)
            ]
        else:
            self.slots = [Slot(key=f"cpu-w{n}", gpu=None) for n in range(settings.cpu_workers)]
        self._signals = 0
        self.exits: list[tuple[str, int]] = []

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only count: logging or killing inside a handler can deadlock on locks the loop holds.
        self._signals += 1

    def _command(self, slot: Slot, name: str) -> list[str]:
        cmd = [sys.executable, "-m", "queue_worker.worker", "--queue", self.settings.queue, "--name", name]
        cmd += ["--log-level", self.settings.log_level, "--precision", self.settings.precision]
        if self.settings.max_jobs is not None:
            cmd += ["--max-jobs", str(self.settings.max_jobs)]
        if self.settings.preload:
            cmd += ["--preload", self.settings.preload]
        return cmd

    def start_worker(self, slot: Slot) -> None:
        slot.generation += 1
        name = f"{self.settings.name}-{slot.key}-g{slot.generation}"
        base = dict(os.environ, CHUNKQ_REDIS_URL=self.settings.redis_url, CHUNKQ_POOL_PID=str(os.getpid()))
        threads = cpu_threads_per_worker(len(self.slots)) if slot.gpu is None else 2
        env = worker_environment(base, slot.gpu, threads)
        slot.proc = subprocess.Popen(
            self._command(slot, name), env=env, start_new_session=True, preexec_fn=die_with_parent
        )
        log.info("started worker %s (pid %d) on %s", name, slot.proc.pid, self._where(slot))

    @staticmethod
    def _where(slot: Slot) -> str:
        return "CPU" if slot.gpu is None else f"GPU {slot.gpu.index} ({slot.gpu.name})"

    def _signal_all(self, sig: signal.Signals) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                try:
                    slot.proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _reap(self, stopping: bool, now: float) -> None:
        for slot in self.slots:
            if slot.proc is None:
                continue
            code = slot.proc.poll()
            if code is None:
                continue
            self.exits.append((slot.key, code))
            reason = exit_codes.describe(code)
            slot.proc = None
            if stopping:
                log.info("worker on %s (%s) %s", slot.key, self._where(slot), reason)
            elif code in NO_RESTART:
                slot.retired = True
                log.error("worker on %s %s; not restarting this slot", slot.key, reason)
            else:
                expected = code in (exit_codes.EXIT_MAX_JOBS, exit_codes.EXIT_STOPPED)
                slot.not_before = now if expected else now + self.settings.restart_delay
                log.log(
                    logging.INFO if expected else logging.WARNING,
                    "worker on %s %s; starting a fresh one",
                    slot.key,
                    reason,
                )

    def _fill(self, now: float) -> None:
        for slot in self.slots:
            if slot.proc is None and not slot.retired and now >= slot.not_before:
                self.start_worker(slot)

    def _alive(self) -> bool:
        return any(slot.proc is not None for slot in self.slots)

    def run(self) -> int:
        """Run until signalled: first signal drains (finish current chunk), second stops at once."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        handled = 0
        kill_at: float | None = None
        try:
            self._fill(time.monotonic())
            while True:
                now = time.monotonic()
                if self._signals > handled:
                    handled = self._signals
                    log.info("pool %s: %s", self.settings.name, "stopping now" if handled > 1 else "draining")
                    self._signal_all(signal.SIGTERM)
                    if handled > 1:
                        kill_at = now + self.settings.kill_grace
                if kill_at is not None and now >= kill_at:
                    self._signal_all(signal.SIGKILL)
                self._reap(stopping=handled > 0, now=now)
                if handled:
                    if not self._alive():
                        return 0
                else:
                    self._fill(now)
                    if all(slot.retired for slot in self.slots):
                        log.error(
                            "pool %s: every worker refused its configuration; giving up", self.settings.name
                        )
                        return exit_codes.EXIT_CONFIG
                time.sleep(POLL_SECONDS)
        finally:
            self._shutdown_leftovers()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _shutdown_leftovers(self) -> None:
        """Whatever way the loop ended, leave no worker running."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.kill_grace
        for slot in self.slots:
            if slot.proc is None:
                continue
            try:
                slot.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                slot.proc.kill()
                slot.proc.wait()
