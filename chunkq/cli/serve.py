"""``chunkq serve-redis``: the store's Redis for every host that shares the store (Slurm jobs,
several hosts without a Redis of their own). ``chunkq serve-forks``: one warm fork server for the
many runs of one host."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from pathlib import Path

import click

from chunkq.cli.common import redis_option, store_option
from chunkq.cli.group import command
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.storage import is_local
from chunkq.supervisor.server.embedded_redis import LOOPBACK, WILDCARDS
from chunkq.supervisor.server.store_redis import URL_FILE, embedded_redis_dir, serve
from chunkq.supervisor.watch.supervise import RedisGoneError

WATCH_SECONDS = 1.0  # how often the command looks for a server that is gone for good


@command("serve-redis")
@click.option(
    "--bind",
    default=LOOPBACK,
    show_default=True,
    help="Address to listen on besides loopback (0.0.0.0: every interface). A password is always required.",
)
@click.option("--port", type=click.IntRange(0, 65535), default=0, help="Port (default: a free one).")
@click.option(
    "--advertise",
    default=None,
    help="Host name other hosts reach the server by (default: this host's name when --bind is not loopback).",
)
@click.option("--wait", is_flag=True, help="If another process serves this store, wait for it to stop.")
@store_option
@redis_option("serves")
def serve_redis_cmd(
    bind: str, port: int, advertise: str | None, wait: bool, store: Path, redis_url: str | None
) -> None:
    """Serve the store's Redis until stopped (SIGTERM or Ctrl+C): Valkey with a generated password
    and append-only persistence in the store, restarted if it dies.

    Its URL, password included, is written owner-only beside its data; `submit`, `pool`,
    `supervise` and `dashboard` given no --redis-url on the same store use it while it is served.
    The password is kept from one start to the next, so a restarted server at the same address
    serves the same clients.
    """
    if not is_local(store):
        raise ConfigError(
            "serve-redis: the store is an object store, where other hosts cannot find the server's "
            "URL; start it on a shared filesystem, or give every host --redis-url"
        )
    if advertise is None:
        advertise = LOOPBACK if bind == LOOPBACK else (socket.getfqdn() if bind in WILDCARDS else bind)
    with contextlib.ExitStack() as stack:
        server = serve(
            store, stack, wait=wait, bind=bind, advertise=advertise, port=port or None, keep_password=True
        ).server
        click.echo(
            f"serving the Redis of {store} on {bind}:{server.port}, reached as {advertise}:{server.port}; "
            f"its URL (with the password) is in {embedded_redis_dir(store) / URL_FILE}",
            err=True,
        )
        try:
            while server.failure is None:
                time.sleep(WATCH_SECONDS)
        except KeyboardInterrupt:  # SIGTERM too (supervisor/stop_signals.py): the way it is meant to stop
            click.echo("serve-redis: stopping; the server flushes its append-only file", err=True)
            return
        raise RedisGoneError(server.failure)


@command("serve-forks")
@click.argument("socket_path", metavar="SOCKET", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--preload",
    default=None,
    help="Model to load once for every worker, named as the runs name it (e.g. the bundled one).",
)
@redis_option("forks")
def serve_forks_cmd(socket_path: Path, preload: str | None, redis_url: str | None) -> None:
    """Keep one fork server warm for the runs of this host: torch and sentence-transformers imported
    (and --preload's model loaded) once, then each worker of every pool given
    --fork-server-at SOCKET (CHUNKQ_FORK_SERVER_SOCKET) is forked here, still a fresh process with
    its pool's environment. Until SIGTERM or Ctrl+C.

    The socket is its owner's alone. A pool whose python, chunkq code, libraries or import-time
    environment (PYTHON*, HF_*, TRANSFORMERS_*, ...) differ from this server's uses a fork server of
    its own instead, and says why.
    """
    from chunkq.queue_worker.processes.fork_server import MODEL_ENV, NVML_BASED_CUDA_CHECK, SERVER_MODULE

    env = dict(os.environ, **NVML_BASED_CUDA_CHECK)
    if preload:
        env[MODEL_ENV] = preload
    path = str(socket_path.absolute())
    sys.stdout.flush()
    sys.stderr.flush()
    # The server itself, in this process (no interpreter left waiting on it): what signals this
    # command reaches the server.
    os.execve(sys.executable, [sys.executable, "-m", SERVER_MODULE, "--listen", path], env)  # noqa: S606
