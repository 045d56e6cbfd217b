"""The fork server: one process that has imported torch and sentence-transformers forks each worker.

Importing torch, transformers and sentence-transformers costs about 5 s of CPU (measured on the
CI machine), against 0.4 s to load a small model. A worker recycled every few chunks paid that
import every time, on the same cores that were encoding. The fork server pays it once per pool.

It never touches CUDA (no ``torch.cuda`` call, no NVML), so every forked worker creates its own
CUDA context and destroys it when it exits: recycling still cures a broken context. Each worker is
a new process in its own session, gets its environment (``CUDA_VISIBLE_DEVICES`` and the rest)
before it could initialise CUDA, gets a parent-death signal when the fork server dies (it stops
at once if its pool is gone too, else drains; lifeline.ORPHANED_SIGNAL), and shows its worker
command line in ``ps``. The fork server dies with the pool and ignores the SIGTERM a batch system
sends every process of its job.

Requests and replies are JSON over a Unix socket pair (no pickle); the worker's notify pipe travels
as SCM_RIGHTS. ``ForkServer`` and ``ForkedWorker`` offer the pool what it used of ``subprocess.Popen``.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, NoReturn

import psutil
import setproctitle

from chunkq.jobs.compute import cuda
from chunkq.jobs.compute.model_reads import no_working_directory_imports
from chunkq.jobs.compute.runtime import DEVICE_ENV
from chunkq.jobs.contract import errors
from chunkq.queue_worker.exit_codes import EXIT_FORKED_NO_CUDA, EXIT_NO_CONTEXT
from chunkq.queue_worker.lifeline import (
    ORPHANED_SIGNAL,
    PARENT_PID_ENV,
    killed_with_parent,
    worker_dies_with_parent,
)
from chunkq.queue_worker.standby import NOTIFY_FD_ENV
from chunkq.queue_worker.stopping import wait_or_kill
from chunkq.queue_worker.worker_args import WORKER_MODULE

SOCKET_FD_ENV = "CHUNKQ_FORK_SERVER_FD"
PRELOAD = ("torch", "sentence_transformers", WORKER_MODULE)
PRELOAD_ENV = "CHUNKQ_FORK_SERVER_PRELOAD"  # more modules to import once, e.g. your own job functions
MODEL_ENV = "CHUNKQ_FORK_SERVER_MODEL"  # the pool's --preload model, loaded once on the CPU
TEMPLATE_MEMORY_SHARE = 0.25  # of host memory; a larger model is loaded by each worker instead
# torch.cuda.is_available() and device_count() then ask NVML, not the driver (whose cuInit a forked
# child would inherit), should an import call them in the fork server.
NVML_BASED_CUDA_CHECK = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
START_TIMEOUT = 300.0  # imports on a cold disk
MESSAGE_BYTES = 1 << 20
REAP_SECONDS = 0.05

log = logging.getLogger(__name__)


class ForkServerError(RuntimeError):
    """The fork server could not be started or stopped answering."""


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    socket.send_fds(sock, [json.dumps(message).encode()], fds or [])


def _receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the fds that came with it; (None, []) when the other end has closed."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MESSAGE_BYTES, 4)
    if not data:
        return None, list(fds)
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ForkServerError(f"unexpected message {message!r}")
    return message, list(fds)


# ---- the server process -------------------------------------------------------------------------


def _run_worker(request: dict[str, Any], fds: list[int], server_pid: int) -> int:
    os.setsid()
    worker_dies_with_parent()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, ORPHANED_SIGNAL):
        signal.signal(sig, signal.SIG_DFL)
    env = {str(k): str(v) for k, v in request["env"].items()}
    if fds:
        env[NOTIFY_FD_ENV] = str(fds[0])
    # The pid from before the fork: had the server died since, getppid() would name the reaper and
    # the worker's orphan check would pass.
    env[PARENT_PID_ENV] = str(server_pid)
    os.environ.clear()
    os.environ.update(env)
    args = [str(a) for a in request["args"]]
    import torch

    from chunkq.jobs.compute import faults
    from chunkq.queue_worker.worker import main

    setproctitle.setproctitle(" ".join([sys.executable, "-m", WORKER_MODULE, *args]))
    faults.reload()  # parsed at import, in the fork server's environment
    # OpenMP read OMP_NUM_THREADS when torch was imported, in the fork server.
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    _apply_allocator_settings(env)
    problem = forked_cuda_problem(env)
    if problem is not None:
        code, why = problem
        print(f"chunkq: a forked worker cannot create its CUDA context: {why}", file=sys.stderr)
        return code
    return main(args)


def _apply_allocator_settings(env: dict[str, str]) -> None:
    """Hand PYTORCH_CUDA_ALLOC_CONF to the allocator directly: whether torch read the variable
    lazily or while the fork server imported it, the worker's own setting is the one in force."""
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF")
    if not conf or env.get(DEVICE_ENV) != "cuda":
        return
    import torch

    # torch >= 2.9 names it torch._C._accelerator_setAllocatorSettings; the old name still works there
    # but warns in every worker's log.
    setter = (
        getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        or torch.cuda.memory._set_allocator_settings
    )
    try:
        setter(conf)
    except (AttributeError, RuntimeError) as exc:  # a CPU build of torch, or an older one
        print(f"chunkq: could not apply PYTORCH_CUDA_ALLOC_CONF={conf!r}: {exc}", file=sys.stderr)


def _fork_worker(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> int:
    server_pid = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        sock.close()
        code = _run_worker(request, fds, server_pid)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _cuda_initialised() -> bool:
    """Whether this process initialised CUDA, which a forked child could then not use.

    Importing a CUDA build of torch maps libcuda without initialising CUDA: measured on an H100,
    ``torch.cuda.is_initialized()`` stays False through ``import transformers, sentence_transformers``
    and a child forked then creates its context and computes correctly. A driver call made during
    an import (``torch.cuda.is_available()`` reaches ``cuInit``) is kept off the driver by
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` in this process; whether a child would be a bad fork is
    asked of a child (``_forks_are_clean``), and each forked GPU worker still checks that it can
    create its context (``forked_cuda_problem``) before it takes a job.
    """
    import torch

    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def forked_cuda_problem(env: dict[str, str]) -> tuple[int, str] | None:
    """Why this forked GPU worker cannot create its CUDA context, with the exit code that tells the
    pool what it means; None when it can (always on the CPU).

    A bad fork (torch's fork handler ran: something in the fork server reached
    ``_cuda_getDeviceCount``) or a failure of unknown cause sends the pool to fresh interpreters
    (EXIT_FORKED_NO_CUDA). A GPU out of memory or busy costs only this fork (EXIT_NO_CONTEXT): a
    fresh interpreter would have failed the same way.
    """
    if env.get(DEVICE_ENV) != "cuda":
        return None
    import torch

    if torch.cuda._is_in_bad_fork():
        return EXIT_FORKED_NO_CUDA, "torch marks this process a bad fork: the fork server touched CUDA"
    exc = cuda.open_context("cuda")
    if exc is None:
        return None
    why = f"{type(exc).__name__}: {errors.first_line(str(exc))}"
    return (EXIT_NO_CONTEXT if errors.context_unavailable_now(exc) else EXIT_FORKED_NO_CUDA), why


def _forks_are_clean() -> bool:
    """Whether a child forked now could use CUDA. torch's ``poison_fork`` (torch/csrc/cuda/Module.cpp)
    registers a fork handler the first time anything reaches ``_cuda_getDeviceCount`` (e.g.
    ``torch.cuda.is_available()`` with the NVML-based check off), and that handler marks every
    later child a bad fork while ``torch.cuda.is_initialized()`` stays False here: only a child can
    tell. One is forked and asked."""
    pid = os.fork()
    if pid == 0:
        try:
            import torch

            os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _load_model_template(ref: str) -> dict[str, Any]:
    """Load the workers' model once: a forked worker then only moves it to its device (about 0.3 s
    of CPU less per worker on a small model, and no read of the weights per worker on a large one).
    A model that fails here is left to each worker, which reports why in its chunk's failure."""
    from chunkq.jobs.compute import models

    try:
        limit = int(psutil.virtual_memory().total * TEMPLATE_MEMORY_SHARE)
        return {"model_seconds": models.load_template(ref, limit)}
    except Exception as exc:  # any failure: workers load it themselves
        return {"model_error": f"{type(exc).__name__}: {exc}"}


def serve(sock: socket.socket) -> None:
    """Import the heavy modules, say ready, then fork a worker per request until the pool hangs up."""
    extra = [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
    for name in (*PRELOAD, *extra):
        importlib.import_module(name)
    ready: dict[str, Any] = {"ready": os.getpid()}
    model = os.environ.get(MODEL_ENV)
    if model:
        ready.update(_load_model_template(model))
    if _cuda_initialised():
        _send(
            sock, {"refused": "torch.cuda was initialised while importing; forked workers could not use it"}
        )
        return
    if not _forks_are_clean():
        _send(sock, {"refused": "a child forked now is a bad fork for torch: an import reached CUDA"})
        return
    # Objects that exist now are shared by every worker: keep the collector from writing to them,
    # which would copy their pages into each worker.
    gc.freeze()
    _send(sock, ready)
    while True:
        readable, _, _ = select.select([sock], [], [], REAP_SECONDS)
        if readable:
            request, fds = _receive(sock)
            if request is None:
                return
            pid = _fork_worker(sock, request, fds)
            for fd in fds:
                os.close(fd)
            _send(sock, {"started": pid})
        _reap(sock)


def server_main() -> NoReturn:
    # The title's room, claimed in the kernel's environment block: a worker's new os.environ has none.
    setproctitle.setproctitle(setproctitle.getproctitle())
    no_working_directory_imports()  # before a model loads: the workers inherit the path
    sock = socket.socket(fileno=int(os.environ.pop(SOCKET_FD_ENV)))
    # The pool decides when workers stop, and this server goes when the pool hangs up or dies. A
    # batch system signals every process of its job: had this server died of Slurm's SIGTERM, its
    # workers would have taken their parent's death for their pool's, and dropped their chunks.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the pool is gone; the workers follow through their parent-death signal
    os._exit(0)


# ---- the pool's side ----------------------------------------------------------------------------


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
    """Starts the fork server on first use and again if it dies; forks workers through it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.workers: dict[int, ForkedWorker] = {}

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chunkq.queue_worker.fork_server"],
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

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def _next(self, timeout: float) -> dict[str, Any] | None:
        """The next message that is not an exit report (those are applied), or None on timeout/EOF."""
        deadline = time.monotonic() + timeout
        while self.sock is not None:
            if not select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            message, _ = _receive(self.sock)
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
        """The fork server died: its workers get SIGTERM from their parent-death signal; wait for
        them to go (they are no longer ours to reap) and report them killed by it."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            self.proc.wait()
            self.proc = None
        for pid in list(self.workers):
            deadline = time.monotonic() + 30
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
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
        sock = self.sock or self._start()
        try:
            _send(sock, {"args": args, "env": env}, [notify_fd])
        except OSError:
            self._lost()
            sock = self._start()
            _send(sock, {"args": args, "env": env}, [notify_fd])
        reply = self._next(30.0)
        if reply is None or "started" not in reply:
            raise ForkServerError(f"the fork server did not fork a worker (it said {reply!r})")
        worker = ForkedWorker(self, int(reply["started"]))
        self.workers[worker.pid] = worker
        return worker

    def close(self) -> None:
        """Hang up; the fork server exits, and any worker still alive gets its parent-death signal."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            wait_or_kill(self.proc, 10)
            self.proc = None


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


if __name__ == "__main__":
    server_main()
