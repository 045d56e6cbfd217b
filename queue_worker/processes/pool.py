"""The per-host pool: one fresh worker process per slot (GPU x workers-per-GPU, or CPU), restarted
whenever one ends, pinned through its environment, and never left behind as an orphan.

``rq worker-pool`` forks its workers (CUDA cannot be used in a forked child) and cannot give each
one its own environment, hence this pool built on ``subprocess``. The pool also does what RQ
does late or never: it fails the job of a worker that died at once (RQ waits for timeout + 60 s),
kills a worker whose job hangs past its timeout (SIGALRM cannot interrupt a CUDA call), both through
``dead_workers``, and takes a GPU out of service when its workers keep dying.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from types import FrameType

import redis

from chunkq.jobs.compute.models import check_precision
from chunkq.jobs.compute.runtime import POOL_STARTED_ENV
from chunkq.jobs.contract.errors import ChunkqError
from chunkq.jobs.contract.process_clock import process_started_at
from chunkq.jobs.contract.redaction import guard_process
from chunkq.jobs.contract.settings import (
    DEVICES_JSON_ENV,
    LOG_FORMAT,
    SETTINGS_JSON_ENV,
    SIGNAL_REPEAT_SECONDS,
    PoolSettings,
    env_of,
)
from chunkq.jobs.contract.units import parse_size
from chunkq.jobs.queue import run_queues
from chunkq.jobs.queue.nopickle import forbid_pickle
from chunkq.jobs.queue.queueing import any_waiting
from chunkq.jobs.queue.redis_clients import connect
from chunkq.queue_worker import exit_codes
from chunkq.queue_worker.devices.discovery import GpuInfo, devices_from_json
from chunkq.queue_worker.devices.gpus import (
    choose,
    cpu_threads_per_worker,
    resolve_cpu_workers,
    resolve_workers_per_gpu,
    worker_environment,
)
from chunkq.queue_worker.devices.memory_room import OomWatch
from chunkq.queue_worker.processes.dead_workers import DeadWorkers
from chunkq.queue_worker.processes.fork_client import ForkedWorker, ForkServer
from chunkq.queue_worker.processes.fork_server import MODEL_ENV as FORK_SERVER_MODEL_ENV
from chunkq.queue_worker.processes.fork_server import ForkServerError
from chunkq.queue_worker.processes.lifeline import PARENT_PID_ENV, POOL_PID_ENV, worker_dies_with_parent
from chunkq.queue_worker.processes.metrics import PoolMetrics, serve
from chunkq.queue_worker.processes.restart import RestartPolicy
from chunkq.queue_worker.processes.standby import NOTIFY_FD_ENV, WAIT_FOR_PID_ENV, parse_announcements
from chunkq.queue_worker.processes.stopping import wait_or_kill
from chunkq.queue_worker.worker_args import WORKER_MODULE, worker_argv

log = logging.getLogger("chunkq.queue_worker.processes.pool")  # one name, run as a module too

WorkerProcess = subprocess.Popen[bytes] | ForkedWorker

POLL_SECONDS = 0.2


def jittered_max_jobs(max_jobs: int | None, fraction: float, rng: random.Random) -> int | None:
    """Spread recycles: workers that all reload after exactly N chunks would reload at once."""
    if max_jobs is None:
        return None
    spread = round(max_jobs * fraction)
    return max(1, max_jobs + rng.randint(-spread, spread))


@dataclass
class Slot:
    """One worker position: a GPU (or the CPU) and whichever process currently fills it."""

    key: str
    gpu: GpuInfo | None
    proc: WorkerProcess | None = None
    worker_name: str = ""
    notify_fd: int | None = None  # read end of the pipe on which the worker announces its last job
    standby: tuple[WorkerProcess, str, int] | None = None  # (process, name, notify fd)
    generation: int = 0
    retired: bool = False
    not_before: float = 0.0
    redis_losses: int = 0  # workers in a row that exited because Redis was away: the back-off grows

    @property
    def device(self) -> str:
        return "cpu" if self.gpu is None else f"gpu{self.gpu.key}"


class Pool:
    """Starts, watches and restarts the workers of one host."""

    def __init__(self, settings: PoolSettings, gpus: list[GpuInfo], rng: random.Random | None = None) -> None:
        self.settings = settings
        self.policy = RestartPolicy(settings.restart_delay, settings.crash_limit, settings.crash_window)
        if gpus:
            per_gpu = resolve_workers_per_gpu(
                settings.workers_per_gpu,
                gpus,
                settings.preload,
                settings.precision,
                settings.standby,
                parse_size(settings.gpu_memory_limit),
            )
            self.slots = [
                Slot(key=f"gpu{gpu.key}-w{n}", gpu=gpu)
                for gpu in gpus
                for n in range(1 if gpu.exclusive else per_gpu)  # EXCLUSIVE_PROCESS: one context
            ]
        else:
            workers = resolve_cpu_workers(settings.cpu_workers, settings.preload)
            self.slots = [Slot(key=f"cpu-w{n}", gpu=None) for n in range(workers)]
        self.connection = connect(settings.redis_url)
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not security
        self._signals = 0
        self._crashes: dict[str, tuple[float, ...]] = {}  # each device's recent deaths (RestartPolicy)
        self.dead = DeadWorkers(self.connection, settings.name, settings.queue, settings.hung_grace)
        self.oom = OomWatch()
        self.exits: list[tuple[str, int]] = []
        self.started_at = process_started_at()  # its interpreter's start-up included
        self.metrics = PoolMetrics(settings.name, [gpu.key for gpu in gpus])
        server_env = dict(os.environ)
        if settings.preload:
            server_env[FORK_SERVER_MODEL_ENV] = settings.preload
        self.fork_server = (
            ForkServer(server_env, settings.fork_server_socket) if settings.fork_server else None
        )

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only count: logging or killing inside a handler can deadlock on locks the loop holds.
        self._signals += 1

    def _command(self, name: str) -> list[str]:
        spread = self.settings.max_jobs_jitter
        jittered = {
            "max_jobs": jittered_max_jobs(self.settings.max_jobs, spread, self.rng),
            "recycle_after": round(self.settings.recycle_after * (1 + self.rng.uniform(-spread, spread)), 1),
        }
        argv = worker_argv(self.settings, **jittered)
        return [sys.executable, "-m", WORKER_MODULE, "--name", name, *argv]

    def _spawn(self, slot: Slot, wait_for: int | None = None) -> tuple[WorkerProcess, str, int]:
        slot.generation += 1
        name = f"{self.settings.name}-{slot.key}-g{slot.generation}"
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        base = dict(os.environ, **{env_of("redis_url"): self.settings.redis_url})
        base[PARENT_PID_ENV] = base[POOL_PID_ENV] = str(os.getpid())
        base[POOL_STARTED_ENV] = str(self.started_at)
        base[NOTIFY_FD_ENV] = str(write_fd)
        if wait_for is not None:
            base[WAIT_FOR_PID_ENV] = str(wait_for)
        threads = cpu_threads_per_worker(len(self.slots)) if slot.gpu is None else 2
        env = worker_environment(base, slot.gpu, threads)
        self.metrics.worker_started(slot.device)
        try:
            return self._start_process(self._command(name), env, write_fd), name, read_fd
        finally:
            os.close(write_fd)

    def _stop_forking(self, why: str) -> None:
        if self.fork_server is not None:
            log.warning("fork server unusable (%s); starting each worker with a fresh interpreter", why)
            self.fork_server.close()
            self.fork_server = None

    def _start_process(self, cmd: list[str], env: dict[str, str], notify_fd: int) -> WorkerProcess:
        if self.fork_server is not None:
            try:
                return self.fork_server.spawn(cmd[3:], env, notify_fd)
            except (ForkServerError, OSError) as exc:
                self._stop_forking(str(exc))
        return subprocess.Popen(
            cmd, env=env, start_new_session=True, preexec_fn=worker_dies_with_parent, pass_fds=(notify_fd,)
        )

    def start_worker(self, slot: Slot) -> None:
        slot.proc, slot.worker_name, slot.notify_fd = self._spawn(slot)
        log.info("started worker %s (pid %d) on %s", slot.worker_name, slot.proc.pid, self._where(slot))

    def _start_standby(self, slot: Slot, predecessor: int) -> None:
        slot.standby = self._spawn(slot, wait_for=predecessor)
        log.info(
            "started standby %s (pid %d) for %s, which is on its last job",
            slot.standby[1],
            slot.standby[0].pid,
            slot.worker_name,
        )

    def _check_announcements(self, stopping: bool) -> None:
        """Start a standby for each worker that has announced its last job."""
        for slot in self.slots:
            if slot.notify_fd is None:
                continue
            try:
                said = os.read(slot.notify_fd, 4096)
            except BlockingIOError:
                continue
            last, loads = parse_announcements(said)
            for seconds in loads:
                self.metrics.model_loaded(slot.device, seconds)
            # On an EXCLUSIVE_PROCESS GPU a standby could not create its context beside the worker.
            standby = self.settings.standby and not (slot.gpu is not None and slot.gpu.exclusive)
            if last and standby and slot.standby is None and self._work_waiting():
                if not (stopping or slot.retired or slot.proc is None):
                    self._start_standby(slot, slot.proc.pid)

    def _work_waiting(self) -> bool:
        """Whether jobs wait in the queue: at a run's end a standby would load its model beside the
        last chunks (on a CPU, on the same cores) and take nothing. The slot is refilled anyway
        when its worker exits, should work come."""
        pools = self.settings.queue
        try:
            names = [name for name, _ in run_queues.listed(self.connection, pools)] + [pools]
            return any_waiting(self.connection, names)
        except redis.RedisError:
            return True  # cannot tell: the standby costs less than a cold start would

    def _check_standbys(self, stopping: bool) -> None:
        for slot in self.slots:
            code = None if slot.standby is None else slot.standby[0].poll()
            if slot.standby is not None and code is not None:
                _, name, fd = slot.standby
                level = logging.INFO if stopping else logging.WARNING
                log.log(level, "standby %s %s before it was needed", name, exit_codes.describe(code))
                os.close(fd)
                slot.standby = None

    def _promote(self, slot: Slot) -> bool:
        """Let the waiting standby take the slot; False if there is none."""
        if slot.notify_fd is not None:
            os.close(slot.notify_fd)
            slot.notify_fd = None
        if slot.standby is None:
            return False
        slot.proc, slot.worker_name, slot.notify_fd = slot.standby
        slot.standby = None
        log.info("standby %s (pid %d) takes over %s", slot.worker_name, slot.proc.pid, slot.key)
        return True

    @staticmethod
    def _where(slot: Slot) -> str:
        return "CPU" if slot.gpu is None else f"{slot.gpu.label} ({slot.gpu.name})"

    def _processes(self) -> list[WorkerProcess]:
        procs = [slot.proc for slot in self.slots if slot.proc is not None]
        return procs + [slot.standby[0] for slot in self.slots if slot.standby is not None]

    def _signal_all(self, sig: signal.Signals) -> None:
        for proc in self._processes():
            if proc.poll() is None:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _retire_device(self, slot: Slot, why: str) -> None:
        log.error("%s: %s; taking it out of this pool (the other devices go on)", self._where(slot), why)
        for other in self.slots:
            if other.device == slot.device:
                other.retired = True

    def _reap(self, stopping: bool, now: float) -> None:
        for slot in self.slots:
            code = None if slot.proc is None else slot.proc.poll()
            if code is None:
                continue
            self.exits.append((slot.key, code))
            self.metrics.worker_exited(slot.device, code, hung=slot.worker_name in self.dead.hung)
            reason = self.dead.hung.pop(slot.worker_name, None) or exit_codes.describe(code)
            reason = f"{reason} {oom}" if (oom := self.oom.reason(code)) else reason
            dead = slot.worker_name
            slot.proc = None
            verdict = self.policy.judge(
                code, slot.redis_losses, self._crashes.get(slot.device, ()), now, stopping
            )
            slot.redis_losses, self._crashes[slot.device] = verdict.redis_losses, verdict.crashes
            if verdict.stop_forking:
                self._stop_forking("a forked worker could not create its CUDA context; its log says why")
            if verdict.abandon_job:
                self.dead.add(dead, reason)
            if verdict.retire_device:
                crashes = f"{len(verdict.crashes)} worker deaths within {self.settings.crash_window:.0f} s"
                self._retire_device(slot, reason if exit_codes.of(code).retires_device else crashes)
            if not slot.retired and self._promote(slot):
                log.log(verdict.level, "worker %s %s", dead, reason)
            elif stopping:
                log.info("worker %s on %s %s", slot.worker_name, self._where(slot), reason)
            elif not verdict.may_restart:
                slot.retired = True
                log.error("worker %s %s; not restarting slot %s", slot.worker_name, reason, slot.key)
            elif slot.retired:
                log.error("worker %s %s; its device is out of service", slot.worker_name, reason)
            else:
                slot.not_before = now + verdict.delay
                log.log(verdict.level, "worker %s %s; starting a fresh one", slot.worker_name, reason)

    def _fill(self, now: float) -> None:
        for slot in self.slots:
            if slot.proc is None and not slot.retired and now >= slot.not_before:
                self.start_worker(slot)

    def _alive(self) -> bool:
        return any(slot.proc is not None or slot.standby is not None for slot in self.slots)

    def _step(self, handled: int, now: float) -> int | None:
        """One turn of the loop; an exit code once the pool is done."""
        self._check_announcements(stopping=handled > 0)
        self._check_standbys(stopping=handled > 0)
        self._reap(stopping=handled > 0, now=now)
        self.metrics.set_running(sum(1 for proc in self._processes() if proc.poll() is None))
        if self.dead.pending:
            self.dead.release(now)
        if handled:
            if self._alive():
                return None
            if self.dead.pending:  # Redis is away; the supervisor's heartbeat check will catch these
                log.warning(
                    "pool exiting with %d dead worker(s) whose jobs it could not release",
                    len(self.dead.pending),
                )
            return 0
        live = ((s.worker_name, s.proc) for s in self.slots if s.proc is not None and s.proc.poll() is None)
        self.dead.watchdog(now, live)  # read only on the watchdog's turns
        self._fill(now)
        if all(slot.retired for slot in self.slots) and not self._alive():
            log.error("pool %s: no device left to run workers on; giving up", self.settings.name)
            return exit_codes.EXIT_CONFIG
        return None

    def run(self) -> int:
        """Run until signalled: first signal drains (finish current chunk), second stops at once."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, _wake_only)
        woken, wakes = os.pipe()
        os.set_blocking(woken, False)
        os.set_blocking(wakes, False)
        previous_wakeup = signal.set_wakeup_fd(wakes, warn_on_full_buffer=False)
        handled = 0
        kill_at: float | None = None
        drained_at = 0.0
        stop_now_at: float | None = None
        if self.settings.metrics_port is not None:
            serve(self.metrics.registry, self.settings.metrics_port)
        try:
            self.dead.release_predecessors()
            self._fill(time.monotonic())
            while True:
                now = time.monotonic()
                if self._signals > handled:
                    what = "stopping now" if self._signals > 1 else "draining"
                    log.info("pool %s: %s", self.settings.name, what)
                    if handled == 0:
                        self._signal_all(signal.SIGTERM)
                        drained_at = now
                    if self._signals > 1 and kill_at is None:
                        # Sooner, a worker would take it for the drain delivered twice.
                        stop_now_at = max(now, drained_at + SIGNAL_REPEAT_SECONDS)
                        kill_at = now + self.settings.kill_grace
                    handled = self._signals
                if stop_now_at is not None and now >= stop_now_at:
                    self._signal_all(signal.SIGTERM)
                    stop_now_at = None
                if kill_at is not None and now >= kill_at:
                    self._signal_all(signal.SIGKILL)
                code = self._step(handled, now)
                if code is not None:
                    return code
                self._pause(POLL_SECONDS, woken)
        finally:
            self._shutdown_leftovers()
            signal.set_wakeup_fd(previous_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(woken)
            os.close(wakes)

    def _pause(self, seconds: float, woken: int) -> None:
        """Wait up to ``seconds``, less when there is something to do: a signal (a drain, a child's
        exit) or a forked worker's exit report. A poll alone made every command's end wait up to
        twice its length (the drain, then the last worker's exit)."""
        fork_server = self.fork_server
        server = fork_server.sock if fork_server is not None else None
        ready = select.select([woken] + ([server] if server is not None else []), [], [], seconds)[0]
        if woken in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(woken, 512):
                    pass
        if fork_server is not None and server in ready:
            fork_server.collect()

    def _shutdown_leftovers(self) -> None:
        """Whatever way the loop ended, leave no worker running, and no fork server."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.kill_grace
        for proc in self._processes():
            wait_or_kill(proc, max(0.1, deadline - time.monotonic()))
        if self.fork_server is not None:
            self.fork_server.close()


def _wake_only(signum: int, frame: FrameType | None) -> None:
    """A child's exit only wakes the loop (signal.set_wakeup_fd); the loop itself reaps it."""


def start(settings: PoolSettings, chosen: list[GpuInfo] | None = None) -> int:
    """Run a pool with ``settings`` on the devices they choose (``chosen``: already chosen by the
    command that started it), until signalled: its exit code."""
    if chosen is None:
        chosen = choose(settings.gpus, settings.min_free_memory, settings.busy_gpus)
    if not chosen:
        check_precision(settings.precision, "cpu")  # every chunk would be refused: say it once, now
        log.info("no GPU in use; running CPU workers")
        if parse_size(settings.gpu_memory_limit):
            log.warning("--gpu-memory-limit %s: no GPU in use, nothing to limit", settings.gpu_memory_limit)
    return Pool(settings, chosen).run()


def main() -> int:
    """``python -m chunkq.queue_worker``: a pool whose settings come whole, as JSON in
    CHUNKQ_POOL_SETTINGS_JSON, as ``chunkq run`` starts its own (the Redis password stays off the
    command line). People start one with ``chunkq pool``."""
    guard_process()  # the settings hold the Redis URL: never in a line the pool writes
    forbid_pickle()
    raw = os.environ.get(SETTINGS_JSON_ENV)
    if not raw:
        print(f"python -m chunkq.queue_worker: set {SETTINGS_JSON_ENV}, or run: chunkq pool", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    try:
        settings = PoolSettings.from_json(raw)
        logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr, format=LOG_FORMAT)
        devices = os.environ.get(DEVICES_JSON_ENV)
        return start(settings, None if devices is None else devices_from_json(devices))
    except ChunkqError as exc:  # one line, as every chunkq command reports it
        log.error("%s", exc)
        return exit_codes.EXIT_CONFIG
