"""One standing fork server per test process (``chunkq serve-forks``), started on first use, which
every chunkq command a test starts through ``helpers.cli_env`` forks its workers from.

Most tests that start a run only need "a run": paying torch's and sentence-transformers' import
and the bundled model's load in each run's own fork server was most of the suite's CPU. Sharing
this one server cannot make one test's result depend on another's:
- what is shared is an interpreter that has imported modules and loaded the bundled model on the
  CPU, then only forks; nothing a worker does returns to it (each worker is a copy-on-write fork);
- each run keeps everything else of its own: its command, pool and supervisor processes, its
  embedded Redis, store, run id and queue; each worker is still a fresh process with its pool's
  environment (faults, devices, threads), arguments and working directory, and exits as before;
- a pool whose import-time environment, python or chunkq code differ from the server's does not use
  it (it says why and starts its own), so a test that changes those gets what it would alone;
- a pool that dies takes its workers with it as before: the server signals them once it is dead.
Tests whose claim is about the pool's own fork server start their pools without it
(``CHUNKQ_FORK_SERVER_SOCKET=""``); the server's own behaviour is tested in
``tests/queue_worker/test_standing_forks.py`` against servers of those tests' own.
"""

from __future__ import annotations

import atexit
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.settings import env_of
from chunkq.queue_worker.processes.lifeline import die_with_parent

SOCKET_ENV = env_of("fork_server_socket")
START_SECONDS = 180.0  # imports and a model load on a loaded 2-core machine
_started: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
# The server's environment: this process's before any test changed it (a test's monkeypatched HF_HOME
# must not become every later test's), as a chunkq command in a test has it.
_SESSION_ENV = {k: v for k, v in os.environ.items() if k != "CHUNKQ_REDIS_URL"}
_SESSION_ENV.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def start_standing_server(
    path: Path, env: dict[str, str], preload: str | None = BUNDLED_MODEL
) -> subprocess.Popen[bytes]:
    """``chunkq serve-forks PATH`` in the background, returned once it serves (its stderr in
    PATH.log); a failure to start fails the caller, with what the server said."""
    log = path.with_suffix(".log")
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "chunkq.cli",
                "serve-forks",
                str(path),
                *(["--preload", preload] if preload else []),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM),
        )
    assert proc.stdout is not None
    deadline = time.monotonic() + START_SECONDS
    said = b""
    while b"serving at" not in said:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            proc.kill()
            proc.wait(30)
            raise AssertionError(f"serve-forks did not start: {said!r} {log.read_text(errors='replace')}")
        if select.select([proc.stdout], [], [], left)[0]:
            said += os.read(proc.stdout.fileno(), 4096)
    return proc


def standing_socket() -> str:
    """The socket of this test process's standing fork server, started on first use."""
    if "server" not in _started:
        folder = Path(tempfile.mkdtemp(prefix="cq-forks-"))  # a socket path must stay under 108 bytes
        path = folder / "forks.sock"
        _started["server"] = (start_standing_server(path, _SESSION_ENV), path)
        atexit.register(_stop)
    return str(_started["server"][1])


def _stop() -> None:
    stop_standing_server(*_started.pop("server"))


def stop_standing_server(proc: subprocess.Popen[bytes], path: Path) -> None:
    """Stop the server ``start_standing_server`` started at ``path``, and remove the folder it made."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
    shutil.rmtree(path.parent, ignore_errors=True)
