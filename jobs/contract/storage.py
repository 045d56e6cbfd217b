"""Where the store lives and how a file lands there whole: a local or network path, or an object store.

A store is a plain local path (``/mnt/shared/chunkq``) or an fsspec URL (``s3://bucket/prefix``,
``gs://bucket/prefix``; their filesystems come from the ``chunkq[s3]`` and ``chunkq[gcs]`` extras).
Paths are ``pathlib.Path`` for local stores and ``upath.UPath`` for the others, so the layout code
is the same for both.

Atomic publication differs, the guarantee does not:
- local and network filesystems: write a temporary file in the same directory, fsync, rename;
- object stores have no atomic rename, but a single PUT (or a completed multipart upload) makes an
  object appear whole or not at all. A file is written locally, then uploaded as one object; a group
  of files (a chunk output, a run result) is committed by a marker object uploaded after the others.

Credentials and endpoints come from each host's environment the way fsspec reads them
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``FSSPEC_S3_*``),
never from the job data in Redis.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from chunkq.jobs.contract.errors import ConfigError

_LOCAL_PROTOCOLS = ("", "file", "local")


OWNER_ONLY = 0o077  # the umask of chunkq's own processes (CLI, servers, pool, workers)
# The umask the command line found before it set OWNER_ONLY: what a file written for the user
# outside the store (an export) is created with, as any other tool would create it.
caller_umask: int | None = None
PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600  # modes set explicitly where chunkq runs in a caller's process


def user_cache_dir() -> Path:
    """chunkq's folder in the user's cache: what a host keeps for itself, and may lose. ConfigError
    where there is none: a relative XDG_CACHE_HOME is ignored, as the XDG spec says, and a process
    whose user has no home folder (a container run under an arbitrary uid) must not write into
    whatever folder it was started in."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    try:
        cache = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    except RuntimeError:  # Python 3.12+: no HOME and no password entry (3.11 leaves "~" as it is)
        cache = Path("~")
    if not cache.is_absolute():
        raise ConfigError("no folder for this host's cache: set XDG_CACHE_HOME or HOME to an absolute path")
    return cache / "chunkq"


def private_dirs(path: Path) -> None:
    """``mkdir -p`` with every folder it creates owner-only, whatever the process's umask: the API
    runs in the caller's process, whose umask is not chunkq's to change (threads share it)."""
    missing = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, PRIVATE_DIR)


def as_the_caller_would(path: Path) -> None:
    """Give a file chunkq wrote outside the store the mode the caller's umask gives new files."""
    if caller_umask is not None:
        os.chmod(path, 0o666 & ~caller_umask)


def private_open(path: Path, mode: str = "wb", **kw: Any) -> Any:
    """``open(path, mode)`` for writing a new file, created owner-only whatever the umask."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, PRIVATE_FILE), mode, **kw)


class StoreLinkError(ConfigError):
    """A path chunkq would write, replace or delete is reached through a symbolic link."""


def no_links_below(root: Path, path: Path) -> Path:
    """``path`` if no folder or file from below ``root`` down to it is a symbolic link; else
    StoreLinkError. The store is a closed world: a link in it could send a delete, a replace or a
    write anywhere the user can reach (seen: ``clean --outputs-only`` deleting a linked folder's files)."""
    if not is_local(path):
        return path  # object stores have no links
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        raise StoreLinkError(f"{path} is outside the store {root}") from None
    current = root
    for part in parts:
        current = current / part
        if current.is_symlink():
            raise StoreLinkError(
                f"{current} is a symbolic link; chunkq never writes, replaces or deletes anything "
                "through a link in its store (replace the link with the folder or file itself)"
            )
    return path


def open_store(store: str | os.PathLike[str] | Path) -> Path:
    """The store root: a ``Path`` for a local path or ``file://`` URL, a ``UPath`` for an object store."""
    text = str(store)  # an object-store UPath is not os.PathLike, but str() is its URL
    protocol, sep, rest = text.partition("://")
    if not sep or protocol in _LOCAL_PROTOCOLS:
        return Path(rest if sep else text).expanduser().resolve()
    try:
        from upath import UPath

        # Listings are not cached: the supervisor polls for objects that other hosts upload.
        root = UPath(text, use_listings_cache=False)
        root.fs  # noqa: B018 - resolves the filesystem now, so a missing extra fails here, clearly
    except (ImportError, ValueError) as exc:
        raise ConfigError(
            f"store {text!r}: no filesystem for {protocol}:// ({exc}); "
            "install chunkq[s3] for s3://, chunkq[gcs] for gs://"
        ) from exc
    return cast(Path, root)  # UPath offers pathlib's interface; the layout code needs no more


def _fs(path: Path) -> tuple[Any, str]:
    """The fsspec filesystem of an object-store path, and the path within it."""
    remote: Any = path
    return remote.fs, remote.path


def inside_the_store(store: Path, paths: list[Any]) -> Any:
    """The first of ``paths`` that lies in the store ``store`` (links resolved), or None: no export
    writes there (with --force it could replace a published file; a FAISS index written over
    ``result/embeddings.npy`` lost the result)."""
    if not is_local(store):
        return None
    root = os.path.realpath(store)
    for path in paths:
        where = os.path.realpath(path)
        if where == root or where.startswith(root + os.sep):
            return path
    return None


def is_local(path: Path) -> bool:
    return getattr(path, "protocol", "") in _LOCAL_PROTOCOLS


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a local temporary file; on success publish it at ``path`` whole (rename, or one upload)."""
    if is_local(path):
        private_dirs(path.parent)
        directory: str | None = str(path.parent)
    else:
        directory = None
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        exc.filename = str(path)
        raise
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        if directory is not None:
            os.replace(tmp, path)
        else:
            _upload(tmp, path)
    except OSError as exc:
        if exc.filename is None or str(exc.filename).startswith(str(tmp)):
            exc.filename = str(path)  # a full disk while writing names the file chunkq was writing
        raise
    finally:
        tmp.unlink(missing_ok=True)


def _upload(local: Path, remote: Path) -> None:
    fs, where = _fs(remote)
    fs.put_file(str(local), where)


def publish_file(local: Path, path: Path) -> None:
    """Move a finished local file to ``path``: a rename on the same filesystem, else one upload."""
    if is_local(path):
        private_dirs(path.parent)
        os.replace(local, path)
    else:
        _upload(local, path)
        local.unlink()


_RENAME_EXCHANGE = 2  # linux/fs.h


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported.

    Replacing a directory otherwise takes two renames, between which it does not exist.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # no exchange on this kernel or filesystem
        return False
    raise OSError(err, os.strerror(err), str(b))


def remove_tree(path: Path) -> None:
    if is_local(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            fs, where = _fs(path)
            fs.rm(where, recursive=True)


@contextlib.contextmanager
def local_scratch(path: Path) -> Iterator[Path]:
    """A local directory for files that must be local (SQLite) while working on ``path``: ``path``
    itself on a filesystem store, a temporary directory removed afterwards on an object store."""
    if is_local(path):
        private_dirs(path)
        yield path
        return
    scratch = Path(tempfile.mkdtemp(prefix="chunkq-"))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _mtime(info: dict[str, Any]) -> float:
    # Each fsspec filesystem names the modification time its own way.
    for key in ("mtime", "LastModified", "updated", "last_modified", "created"):
        value = info.get(key)
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return 0.0


def list_names(directory: Path) -> Iterator[str]:
    """The name of each file in ``directory``, without a stat of each where the listing says the
    type (one listing call on object stores)."""
    if not is_local(directory):
        for name, _ in list_with_mtime(directory):
            yield name
        return
    if not directory.is_dir():
        return
    for entry in os.scandir(directory):
        try:
            if entry.is_file(follow_symlinks=False):
                yield entry.name
        except FileNotFoundError:  # a writer renamed its temporary file since the listing
            continue


def list_with_mtime(directory: Path) -> Iterator[tuple[str, float]]:
    """(name, modification time) of each file in ``directory``; one listing call on object stores."""
    if is_local(directory):
        if not directory.is_dir():
            return
        for entry in os.scandir(directory):
            try:
                if not entry.is_file():
                    continue
                mtime = entry.stat().st_mtime
            except FileNotFoundError:  # a writer renamed its temporary file since the listing
                continue
            yield entry.name, mtime
        return
    fs, where = _fs(directory)
    try:
        infos = fs.ls(where, detail=True, refresh=True)
    except FileNotFoundError:
        return
    for info in infos:
        if info.get("type") == "file":
            yield info["name"].rstrip("/").rsplit("/", 1)[-1], _mtime(info)


def list_dirs(directory: Path) -> list[str]:
    """Names of the folders directly in ``directory`` (none if it does not exist)."""
    if is_local(directory):
        if not directory.is_dir():
            return []
        return [entry.name for entry in os.scandir(directory) if entry.is_dir(follow_symlinks=False)]
    fs, where = _fs(directory)
    try:
        infos = fs.ls(where, detail=True, refresh=True)
    except FileNotFoundError:
        return []
    return [info["name"].rstrip("/").rsplit("/", 1)[-1] for info in infos if info.get("type") == "directory"]


def temp_beside(path: Path) -> Path:
    """Where a file or folder for ``path`` is built before it is renamed into place: hidden beside
    it, named by this process (``remove_leftovers_beside`` knows a dead writer's by that)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def remove_leftovers_beside(path: Path) -> int:
    """Remove what a killed writer left building ``path`` (``temp_beside``: a FAISS index, a result,
    an export of hundreds of MB), where its process is gone from this host; how many were removed.
    A live writer's stays: two exports to one place at once are that user's to sort out."""
    prefix = f".{path.name}.tmp-"
    removed = 0
    try:
        names = os.listdir(path.parent)
    except OSError:
        return 0
    for name in names:
        pid = name[len(prefix) :]
        if not name.startswith(prefix) or not pid.isdigit() or _alive(int(pid)):
            continue
        leftover = path.parent / name
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
        removed += 1
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
