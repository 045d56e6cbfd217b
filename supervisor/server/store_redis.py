"""The store's own Redis: one embedded server per store, started under the store's lock by
``chunkq run`` (loopback, for one machine) or ``chunkq serve-redis`` (for every host that shares
the store: Slurm jobs, several hosts without a Redis of their own). Its URL, password included,
is advertised in an owner-only file beside its data, where commands that are given no
``--redis-url`` find it while the server lives.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from chunkq.jobs.contract.run_files import atomic_write_bytes
from chunkq.jobs.contract.storage import is_local, no_links_below, private_open, user_cache_dir
from chunkq.supervisor.server.embedded_redis import AUTH_FILE, LOOPBACK, EmbeddedRedis
from chunkq.supervisor.store.store_lock import StoreLock

log = logging.getLogger(__name__)

URL_FILE = "url"
LOCK_FILE = "owner.json"


def local_state_dir(store: Path) -> Path:
    """Where ``chunkq run`` keeps what must stay on this machine (the embedded Redis's data, logs):
    in the store when it is a filesystem, in the user's cache when it is an object store."""
    if is_local(store):
        return store
    return user_cache_dir() / hashlib.sha256(str(store).encode()).hexdigest()[:16]


def embedded_redis_dir(store: Path) -> Path:
    state = local_state_dir(store)
    return no_links_below(state, state / "redis")


@contextlib.contextmanager
def _advertised(path: Path, url: str) -> Iterator[None]:
    """The running server's URL (password included) in an owner-only file; removed when the
    server stops. The same folder already holds the password in ``auth.conf``."""
    try:
        with private_open(path, "w") as fh:
            fh.write(url + "\n")
    except OSError as exc:
        path.unlink(missing_ok=True)
        exc.filename = exc.filename or str(path)  # a full disk names the file
        raise
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def served_url(store: Path) -> str | None:
    """The URL of the store's Redis while a ``chunkq run`` or ``chunkq serve-redis`` serves it, else
    None. A server on another host counts while its lock is renewed (the store lock's rule), and
    only when it listens beyond that host's loopback."""
    data_dir = embedded_redis_dir(store)
    url_file = data_dir / URL_FILE
    if not url_file.is_file():
        return None
    holder = StoreLock(data_dir / LOCK_FILE, "").live_holder()
    if holder is None:
        return None
    url = url_file.read_text().strip()
    if not url or (urlsplit(url).hostname == LOOPBACK and holder.get("host") != socket.gethostname()):
        return None
    return url


PORT_FILE = "port"  # the port the store's last served Redis listened on


def _last_port(data_dir: Path) -> int | None:
    """The port the store's last served server listened on, while it is free again
    (a restarted serve-redis took a new port, and every host's URL went stale); else None."""
    try:
        port = int((data_dir / PORT_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is free
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            log.warning("the store's Redis listened on port %d last time; it is taken now, so another", port)
            return None
    return port


def stored_password(data_dir: Path) -> str | None:
    """The password an earlier server of this store used, so its clients' URLs stay valid."""
    try:
        text = (data_dir / AUTH_FILE).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "requirepass" and value.strip():
            return value.strip()
    return None


@dataclass(frozen=True)
class Served:
    server: EmbeddedRedis
    took_over: str  # whose stale lock was taken over, described, or ""


def serve(
    store: Path,
    stack: contextlib.ExitStack,
    wait: bool,
    bind: str = LOOPBACK,
    advertise: str | None = None,
    port: int | None = None,
    keep_password: bool = False,
) -> Served:
    """Start the store's server under its lock (one per store: two appending to one append-only
    file corrupt it), advertise its URL and restart it whenever it dies, until ``stack`` closes.
    ``keep_password``: reuse the password of the store's last server, so clients holding its
    URL reconnect to a restarted one at the same address."""
    data_dir = embedded_redis_dir(store)
    lock = stack.enter_context(StoreLock(data_dir / LOCK_FILE, f"the embedded Redis of {data_dir}"))
    lock.acquire(wait)
    password = stored_password(data_dir) if keep_password else None
    if port is None and keep_password:
        port = _last_port(data_dir)  # the same address again: its clients' URLs stay valid
    server = EmbeddedRedis(data_dir, password=password, port=port, bind=bind, advertise=advertise)
    stack.enter_context(server)
    if keep_password:
        with contextlib.suppress(OSError):
            atomic_write_bytes(data_dir / PORT_FILE, f"{server.port}\n".encode())
    stack.enter_context(_advertised(data_dir / URL_FILE, server.url))
    server.watch()  # restarted if it dies; the caller stops with the reason if it cannot be
    return Served(server, lock.took_over)
