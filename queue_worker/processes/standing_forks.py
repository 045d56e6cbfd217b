"""A standing fork server: one that outlives the pools it forks for (``chunkq serve-forks``).

A pool's own fork server imports torch and sentence-transformers (~4 s of CPU on the project's
machines) and loads the model each time a pool starts: for a host that runs many small runs one
after another (a test suite, a notebook's loop, a service embedding small batches) that is most of
each run's cost. A standing server pays it once; each pool connects to its Unix socket and has its
workers forked there, each still a fresh process with the pool's own environment, arguments and
working directory, so nothing one run does reaches the next.

What it shares with its pools, here: where its socket lives and who may connect (the owner only:
the socket is created owner-only, and a peer of another user is refused by its credentials, since
whoever connects has code run as the server's user), and whether a pool can use it at all. Its
interpreter imported modules once, in its own environment: a pool whose python, chunkq code,
library versions or import-time environment differ would get workers that are not what it would
have started, so it is refused and starts a fork server of its own instead (``unlike``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import stat
import struct
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from chunkq.jobs.contract import environment

# The variables read while the modules are imported (huggingface_hub's HF_HUB_OFFLINE and HF_HOME,
# Python's own, the dynamic loader's): a worker forked there lives with the values the server had.
# Those applied to each worker after the fork (OMP_NUM_THREADS, PYTORCH_CUDA_ALLOC_CONF,
# CUDA_VISIBLE_DEVICES, chunkq's own faults) are not among them.
IMPORT_TIME_ENV_PREFIXES = (
    "PYTHON",
    "HF_",
    "TRANSFORMERS_",
    "SENTENCE_TRANSFORMERS_",
    "TORCH_",
    "LD_",
    environment.FORK_SERVER_PRELOAD,
    environment.KINDS,
)
LIBRARIES = ("torch", "transformers", "sentence-transformers", "tokenizers", "numpy", "rq", "redis")
CONNECT_SECONDS = 10.0  # a server that accepted but does not say it is ready is not used
_PEERCRED = struct.Struct("3i")  # pid, uid, gid of a Unix socket's peer


def peer(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a Unix socket."""
    pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


# A Unix socket's address holds at most this many bytes of path (sun_path's 108, less its NUL).
SOCKET_PATH_BYTES = 107


def _said(path: Path | str, exc: OSError) -> OSError:
    """``exc`` in words that name the socket's path and what to do (the kernel's say neither: "AF_UNIX
    path too long", "[Errno 2] No such file or directory")."""
    length = len(os.fsencode(str(path)))
    if length > SOCKET_PATH_BYTES:
        return OSError(
            f"{path}: a Unix socket's path holds at most {SOCKET_PATH_BYTES} bytes, this one {length}; "
            "give a shorter one (e.g. /tmp/chunkq-forks.sock)"
        )
    if isinstance(exc, FileNotFoundError):
        folder = os.path.dirname(os.path.abspath(path))
        missing = f"its folder {folder} does not exist" if not os.path.isdir(folder) else "no such socket"
        return FileNotFoundError(f"{path}: {missing}")
    return exc if str(path) in str(exc) else type(exc)(f"{path}: {exc.strerror or exc}")


def listen(path: Path) -> socket.socket:
    """A listening socket at ``path`` that only its owner can connect to. A socket left there by a
    server that died is replaced; one a live server answers on is not (ConfigError's cousin: OSError)."""
    try:
        return _listen(path)
    except OSError as exc:
        raise _said(path, exc) from None


def _listen(path: Path) -> socket.socket:
    if len(os.fsencode(str(path))) > SOCKET_PATH_BYTES:
        raise OSError("AF_UNIX path too long")
    if path.is_socket():
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
                probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink()  # nobody listens: a dead server's
        else:
            raise FileExistsError(f"{path}: another fork server serves there")
    elif path.exists():
        raise FileExistsError(f"{path}: exists and is not a socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)  # created owner-only, never for a moment open to others
    try:
        listener.bind(str(path))
    finally:
        os.umask(old)
    listener.listen(16)
    return listener


def connect(path: str) -> socket.socket:
    """A connection to the standing server at ``path``: OSError when none serves there, or when the
    socket is not its owner's alone (someone else could have put a server of theirs there)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise _said(path, exc) from None
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{path}: not a socket of this user's alone")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
        _pid, uid = peer(sock)
        if uid != os.getuid():
            raise PermissionError(f"{path}: served by another user (uid {uid})")
    except OSError as exc:
        sock.close()
        raise _said(path, exc) from None
    return sock


def _code_stamp() -> str:
    """chunkq's own source as this process would import it: its files' names, sizes and times."""
    digest = hashlib.sha256()
    # the package, loaded before any of its modules: its files, without importing the front door
    root = Path(str(sys.modules[__name__.split(".")[0]].__file__)).parent
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                info = os.stat(path)
                digest.update(f"{os.path.relpath(path, root)}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _versions() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV_PREFIXES)}


def identity(env: dict[str, str]) -> dict[str, Any]:
    """What a pool must share with the server whose workers it takes (``env``: the one the modules
    were, or would be, imported in)."""
    return {
        "executable": sys.executable,
        "code": _code_stamp(),
        "versions": _versions(),
        "env": import_time_env(env),
    }


def unlike(server: dict[str, Any], env: dict[str, str]) -> str | None:
    """Why a pool whose fork server would be started in ``env`` cannot use the standing ``server``
    (its ready message); None when it can."""
    ours = identity(env)
    if server.get("executable") != ours["executable"]:
        return f"it runs {server.get('executable')}, this pool {ours['executable']}"
    if server.get("code") != ours["code"]:
        return "its chunkq code is not this pool's (changed since it started?)"
    if server.get("versions") != ours["versions"]:
        return f"its libraries differ ({server.get('versions')} against {ours['versions']})"
    theirs = server.get("env") or {}
    differ = sorted(k for k in {*theirs, *ours["env"]} if theirs.get(k) != ours["env"].get(k))
    if differ:
        return f"it imported its modules with other values of {', '.join(differ)}"
    return None
