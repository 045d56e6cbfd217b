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

Requests and replies are JSON over a Unix socket pair (no pickle), or for a standing server over a
Unix socket every pool connects to (``standing_forks.py``); the worker's notify pipe, stdout and
stderr travel as SCM_RIGHTS. The pool's side is ``fork_client.py``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import select
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import setproctitle

from chunkq.jobs.compute import cuda
from chunkq.jobs.compute.model_reads import no_working_directory_imports
from chunkq.jobs.compute.runtime import DEVICE_ENV
from chunkq.jobs.contract import environment, errors
from chunkq.queue_worker.devices.memory_room import memory_room
from chunkq.queue_worker.exit_codes import EXIT_FORKED_NO_CUDA, EXIT_NO_CONTEXT
from chunkq.queue_worker.processes import standing_forks
from chunkq.queue_worker.processes.lifeline import (
    ORPHANED_SIGNAL,
    PARENT_PID_ENV,
    fork_holding_stop_signals,
    process_alive,
    worker_dies_with_parent,
)
from chunkq.queue_worker.processes.standby import NOTIFY_FD_ENV
from chunkq.queue_worker.worker_args import WORKER_MODULE, worker_title

SERVER_MODULE = "chunkq.queue_worker.processes.fork_server"
SOCKET_FD_ENV = environment.FORK_SERVER_FD
PRELOAD = ("torch", "sentence_transformers", WORKER_MODULE)
PRELOAD_ENV = environment.FORK_SERVER_PRELOAD  # more modules to import once, e.g. your own job functions
MODEL_ENV = environment.FORK_SERVER_MODEL  # the pool's --preload model, loaded once on the CPU
# Of the memory this process may use (a cgroup's limit where one binds); a larger model is loaded by
# each worker instead.
TEMPLATE_MEMORY_SHARE = 0.25
# torch.cuda.is_available() and device_count() then ask NVML, not the driver (whose cuInit a forked
# child would inherit), should an import call them in the fork server.
NVML_BASED_CUDA_CHECK = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
START_TIMEOUT = 300.0  # imports on a cold disk
MESSAGE_BYTES = 1 << 20
REAP_SECONDS = 0.05
# How long a standing server waits for a pool that hung up unannounced to be dead, before its
# workers are told anyway (a pool's exit closes its sockets a moment before it is dead).
ORPHAN_WAIT_SECONDS = 5.0

log = logging.getLogger(__name__)


class ForkServerError(RuntimeError):
    """The fork server could not be started or stopped answering."""


def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    socket.send_fds(sock, [json.dumps(message).encode()], fds or [])


def receive_message(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
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
    # The pool's stdout and stderr: a standing server's own are not where the pool's log goes.
    for fd, target in zip(fds[1:3], (1, 2), strict=False):
        os.dup2(fd, target)
        os.close(fd)
    # The pid from before the fork: had the server died since, getppid() would name the reaper and
    # the worker's orphan check would pass.
    env[PARENT_PID_ENV] = str(server_pid)
    os.environ.clear()
    os.environ.update(env)
    args = [str(a) for a in request["args"]]
    import torch

    from chunkq.jobs.drills import faults
    from chunkq.queue_worker.worker import main

    setproctitle.setproctitle(worker_title(" ".join(args)))
    faults.reload()  # parsed at import, in the fork server's environment
    # OpenMP read OMP_NUM_THREADS when torch was imported, in the fork server.
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if env.get(DEVICE_ENV) == "cuda" and env.get("PYTORCH_CUDA_ALLOC_CONF"):
        cuda.apply_allocator_settings(env["PYTORCH_CUDA_ALLOC_CONF"])
    problem = forked_cuda_problem(env)
    if problem is not None:
        code, why = problem
        print(f"chunkq: a forked worker cannot create its CUDA context: {why}", file=sys.stderr)
        return code
    return main(args)


def _fork_worker(sockets: list[socket.socket], request: dict[str, Any], fds: list[int]) -> int:
    """Fork a worker for ``request``; the child closes ``sockets`` (every pool's connection and the
    listener: a worker holding another pool's would hide that pool's hang-up)."""
    server_pid = os.getpid()
    pid = fork_holding_stop_signals()
    if pid:
        return pid
    code = 1
    try:
        for sock in sockets:
            sock.close()
        if request.get("cwd"):
            os.chdir(request["cwd"])
        if isinstance(request.get("umask"), int):
            os.umask(request["umask"])
        code = _run_worker(request, fds, server_pid)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


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
        limit = int(memory_room().total * TEMPLATE_MEMORY_SHARE)
        return {"model_seconds": models.load_template(ref, limit)}
    except Exception as exc:  # any failure: workers load it themselves
        return {"model_error": f"{type(exc).__name__}: {exc}"}


def _prepare() -> dict[str, Any]:
    """Import the heavy modules and load the model: the message that says ready, or why not.

    The collector is off meanwhile, as Python's gc documentation advises for a process that forks
    without exec: the imports create ~470,000 objects, and it walked them again and again (about
    1 s of a 6-7 s start, the plain script's import of sentence-transformers pays it too); then
    they are frozen, so no collection in the server or a worker writes to their pages. The cyclic
    garbage of the imports (~10,000 objects) stays, frozen: collecting it would cost 0.4 s."""
    gc.disable()
    try:
        return _imported_and_loaded()
    finally:
        gc.freeze()  # what exists now is shared by every worker: never written to by a collection
        gc.enable()  # for the server's own life, and every worker's


def _imported_and_loaded() -> dict[str, Any]:
    extra = [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
    for name in (*PRELOAD, *extra):
        importlib.import_module(name)
    ready: dict[str, Any] = {"ready": os.getpid()}
    model = os.environ.get(MODEL_ENV)
    if model:
        ready.update(_load_model_template(model))
    if _cuda_initialised():
        return {"refused": "torch.cuda was initialised while importing; forked workers could not use it"}
    if not _forks_are_clean():
        return {"refused": "a child forked now is a bad fork for torch: an import reached CUDA"}
    return ready


class _Client:
    """A pool this server forks for: its connection, its pid, and the workers forked for it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid, _uid = standing_forks.peer(sock)
        self.workers: set[int] = set()


class _Serving:
    """Fork a worker per request and report each one's exit to the pool that asked for it.

    A pool's own server (no ``listener``) serves its one pool and ends when it hangs up: its workers
    then get their parent-death signal. A standing one serves every pool that connects, until it is
    stopped; a pool that hangs up leaves it running, so its workers are sent the same signal
    (ORPHANED_SIGNAL) by hand: at once when the pool said goodbye (it lives: they drain), else once
    the pool is dead (they stop at once), as they would have seen it with a server of its own.
    """

    def __init__(self, ready: dict[str, Any], listener: socket.socket | None = None) -> None:
        self.ready, self.listener = ready, listener
        self.clients: dict[socket.socket, _Client] = {}
        self.owners: dict[int, _Client] = {}
        self.gone: list[tuple[_Client, float]] = []  # hung up unannounced: signalled once dead

    def add(self, sock: socket.socket) -> None:
        client = _Client(sock)
        self.clients[sock] = client
        self._tell(client, self.ready)

    def _sockets(self) -> list[socket.socket]:
        return [*self.clients, *([self.listener] if self.listener is not None else [])]

    def run(self) -> None:
        while self.clients or self.listener is not None:
            for sock in select.select(self._sockets(), [], [], REAP_SECONDS)[0]:
                if sock is self.listener:
                    self._accept()
                elif sock in self.clients:
                    self._serve(self.clients[sock])
            self._reap()
            self._signal_the_dead()

    def _accept(self) -> None:
        if self.listener is None:
            return
        sock, _ = self.listener.accept()
        _pid, uid = standing_forks.peer(sock)
        if uid != os.getuid():  # whoever connects has code run as this user
            log.warning("fork server: refused a connection from uid %d", uid)
            sock.close()
            return
        self.add(sock)

    def _serve(self, client: _Client) -> None:
        try:
            request, fds = receive_message(client.sock)
        except (OSError, ValueError):
            request, fds = None, []
        if request is None or request.get("goodbye"):
            for fd in fds:
                os.close(fd)
            self._hang_up(client, goodbye=request is not None)
            return
        pid = _fork_worker(self._sockets(), request, fds)
        for fd in fds:
            os.close(fd)
        client.workers.add(pid)
        self.owners[pid] = client
        self._tell(client, {"started": pid})

    def _tell(self, client: _Client, message: dict[str, Any]) -> None:
        try:
            send_message(client.sock, message)
        except OSError:  # it is gone: its hang-up is noticed here rather than on a read
            self._hang_up(client, goodbye=False)

    def _hang_up(self, client: _Client, goodbye: bool) -> None:
        if self.clients.pop(client.sock, None) is None:
            return
        client.sock.close()
        if self.listener is None:
            return  # this process ends, and with it its workers' parent
        if goodbye or not process_alive(client.pid):
            _signal_orphaned(client.workers)
        else:  # a pool SIGKILLed closes its socket before it is dead: its workers must see it dead
            self.gone.append((client, time.monotonic() + ORPHAN_WAIT_SECONDS))

    def _signal_the_dead(self) -> None:
        now = time.monotonic()
        for entry in list(self.gone):
            client, deadline = entry
            if not process_alive(client.pid) or now > deadline:
                _signal_orphaned(client.workers)
                self.gone.remove(entry)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            client = self.owners.pop(pid, None)
            if client is None:
                continue
            client.workers.discard(pid)
            if client.sock in self.clients:
                self._tell(client, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _signal_orphaned(workers: set[int]) -> None:
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, ORPHANED_SIGNAL)


def _stopped(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def server_main(argv: list[str] | None = None) -> NoReturn:
    """A pool's own fork server (its socket's fd in SOCKET_FD_ENV), or with ``--listen PATH`` a
    standing one (``chunkq serve-forks``)."""
    args = sys.argv[1:] if argv is None else argv
    # The title's room, claimed in the kernel's environment block: a worker's new os.environ has none.
    setproctitle.setproctitle(setproctitle.getproctitle())
    no_working_directory_imports()  # before a model loads: the workers inherit the path
    if args[:1] == ["--listen"] and len(args) == 2:
        _serve_standing(Path(args[1]))
    sock = socket.socket(fileno=int(os.environ.pop(SOCKET_FD_ENV)))
    # The pool decides when workers stop, and this server goes when the pool hangs up or dies. A
    # batch system signals every process of its job: had this server died of Slurm's SIGTERM, its
    # workers would have taken their parent's death for their pool's, and dropped their chunks.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        ready = _prepare()
        serving = _Serving(ready)
        serving.add(sock)
        if "ready" in ready:
            serving.run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the pool is gone; the workers follow through their parent-death signal
    os._exit(0)


def _serve_standing(path: Path) -> NoReturn:
    """Serve every pool that connects at ``path`` until SIGTERM or SIGINT; then the workers still
    running get their parent-death signal, and drain, as their pools live on."""
    code = 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stopped)
    try:
        listener = standing_forks.listen(path)
    except OSError as exc:
        print(f"chunkq serve-forks: {exc}", file=sys.stderr, flush=True)
        os._exit(2)
    try:
        ready = _prepare()
        if "ready" not in ready:
            print(f"chunkq serve-forks: cannot serve: {ready['refused']}", file=sys.stderr, flush=True)
            code = 3
        else:
            ready.update(standing_forks.identity(dict(os.environ)))
            print(f"chunkq serve-forks: pid {os.getpid()} serving at {path}", flush=True)
            _Serving(ready, listener).run()
    except SystemExit:
        pass
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    server_main()
