"""``chunkq serve-redis``: the store's Redis for every host that shares the store (Slurm jobs,
several hosts without a Redis of their own)."""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path

import click

from chunkq.cli.common import redis_option, store_option
from chunkq.cli.group import command
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.storage import is_local
from chunkq.supervisor.store.embedded_redis import LOOPBACK, WILDCARDS
from chunkq.supervisor.store.store_redis import URL_FILE, embedded_redis_dir, serve
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
        except KeyboardInterrupt:  # SIGTERM too (interrupt_on_sigterm): the way it is meant to stop
            click.echo("serve-redis: stopping; the server flushes its append-only file", err=True)
            return
        raise RedisGoneError(server.failure)
