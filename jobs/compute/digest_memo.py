"""A model folder's digest, remembered on this host for as long as its files' stamp holds.

``model_identity`` hashes every byte of a local model folder. Within a process it hashes a folder
once while the folder's stamp (each file's device, inode, size, modification and change time) is
unchanged; every ``chunkq run`` is a new process, though, and so is its pool's fork server, so a
run hashed the same unchanged weights twice (0.1 s for the bundled 92 MB model, seconds for a
model of gigabytes). This module carries the digest across processes, under the same rule: a file
cannot change without its change time moving, and that time cannot be set back by a user.

One caveat of any stamp, which git calls "racy": a file written twice within one tick of the
filesystem's clock keeps its stamp. A digest is therefore remembered only when every file was last
changed ``SETTLED_SECONDS`` before its hashing began (a model fresh from a download is hashed again
by the next run, and remembered then). Only the bytes' digest is remembered: what the identity adds
for code in installed packages is read again by every process (``model_reads``).

The memo lives in the user's cache (``user_cache_dir()/model-digests``, owner-only), one small
file per host and stamp, and may be deleted at any time: a missing or unreadable entry is hashed again. A
cache that cannot be written (a read-only home) costs the hashing, never the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import socket
from pathlib import Path
from typing import Any

from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.run_files import atomic_write_bytes
from chunkq.jobs.contract.storage import user_cache_dir

log = logging.getLogger(__name__)

SETTLED_SECONDS = 2.0  # file times tick coarsely (ms; FAT: 2 s): a file this fresh may change in its tick
_DIGEST = re.compile(r"files:[0-9a-f]{64}")


def memo_dir() -> Path | None:
    """Where digests are kept; None where this host has no cache folder (the digest is then read
    from the bytes each time, as before)."""
    try:
        return user_cache_dir() / "model-digests"
    except ConfigError:
        return None


def _entry(stamp: tuple[Any, ...]) -> tuple[Path | None, list[Any]]:
    # With the host's name: a home folder is often shared by the hosts of a cluster, whose local
    # disks number devices and inodes alike.
    as_json = json.loads(json.dumps([socket.gethostname(), *stamp]))  # as lists: what an entry holds
    key = hashlib.sha256(json.dumps(as_json, separators=(",", ":")).encode()).hexdigest()
    folder = memo_dir()
    return None if folder is None else folder / f"{key}.json", as_json


def recall(stamp: tuple[Any, ...]) -> str | None:
    """The digest remembered for exactly ``stamp``, or None."""
    path, as_json = _entry(stamp)
    if path is None:
        return None
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("stamp") != as_json:
        return None  # not an entry this module wrote, or another stamp under a colliding name
    digest = data.get("digest")
    return digest if isinstance(digest, str) and _DIGEST.fullmatch(digest) else None


def settled(stamp: tuple[Any, ...], hashing_began_ns: int) -> bool:
    """Whether every file of ``stamp`` was last changed well before its hashing began (``time.time_ns()``,
    the wall clock the kernel stamps files by)."""
    newest = max((max(mtime, ctime) for *_, mtime, ctime in stamp[1:]), default=0)  # [0]: the folder
    return newest < hashing_began_ns - SETTLED_SECONDS * 1e9


def remember(stamp: tuple[Any, ...], digest: str, hashing_began_ns: int) -> None:
    """Keep ``digest`` for ``stamp`` if its files had settled when they were hashed (see above)."""
    if not settled(stamp, hashing_began_ns):
        return
    path, as_json = _entry(stamp)
    if path is None:
        return
    try:
        atomic_write_bytes(path, json.dumps({"stamp": as_json, "digest": digest}).encode())
    except OSError as exc:
        log.debug("model digest not remembered in %s: %s", path.parent, exc)
