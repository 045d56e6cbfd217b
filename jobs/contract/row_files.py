"""Reading the file a row names (an image's path or URL), bounded: a size cap, a time limit, and only
what can end. Each failure is a ``RowReadError`` whose message is the row's true reason.

Before these bounds a 3 GB file took 3.6 GB of the worker's memory, ``/dev/zero`` had no end, a FIFO
blocked the chunk until it was killed as hung (with its good rows), and a URL that never answered
cost ten minutes a row. What a row may name: a regular local file; an http(s) URL; an object in a
store fsspec reads (``s3://``, ``gs://``, ``az://``), whose size the store says before it is read.
"""

from __future__ import annotations

import errno
import os
import stat
import time
import urllib.error
import urllib.request
from typing import Any

from chunkq.jobs.contract.units import size_text

MAX_BYTES = 64 << 20  # an image file larger than this is a bad row: photos are a few MB, scans tens
READ_SECONDS = 30.0  # for the whole read of one row's URL, connection included
_BLOCK = 1 << 16
OBJECT_STORES = ("s3", "gs", "gcs", "az", "abfs")


class RowReadError(OSError):
    """A row's file cannot be read; the message says why, for the row's entry in the result."""


def read_row_file(ref: str, max_bytes: int = MAX_BYTES, seconds: float = READ_SECONDS) -> bytes:
    """The bytes of the file or URL ``ref`` names, at most ``max_bytes``, within ``seconds``."""
    scheme = ref.partition("://")[0].lower() if "://" in ref else ""
    if scheme in ("http", "https"):
        return _read_url(ref, max_bytes, seconds)
    if scheme in OBJECT_STORES:
        return _read_object(ref, max_bytes)
    if scheme:
        raise RowReadError(f"{scheme}:// is not read (a local path, http(s):// or an object store URL)")
    return _read_local(ref, max_bytes)


def _too_large(size: int, max_bytes: int) -> RowReadError:
    return RowReadError(f"{size_text(size)}, larger than the {size_text(max_bytes)} a row's file may be")


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (it may never end)",
    stat.S_IFCHR: "a character device (it may never end)",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _read_local(path: str, max_bytes: int) -> bytes:
    try:
        # Non-blocking: opening a FIFO with no writer would wait forever; fstat then says what it is.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise RowReadError("no such file") from None
    except PermissionError:
        raise RowReadError("permission denied") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise RowReadError(f"not a regular file: {_KINDS.get(stat.S_IFMT(info.st_mode), 'not a file')}")
    with os.fdopen(fd, "rb") as fh:
        if info.st_size > max_bytes:
            raise _too_large(info.st_size, max_bytes)
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew while read
        raise _too_large(len(data), max_bytes)
    return data


class _HttpRedirectsOnly(urllib.request.HTTPRedirectHandler):
    """A few redirects, each to http(s) only (urllib would follow one to ftp://)."""

    max_redirections = 5

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        if not newurl.lower().startswith(("http://", "https://")):
            raise RowReadError(f"redirected to {newurl.partition(':')[0]}://, which is not read")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _read_url(url: str, max_bytes: int, seconds: float) -> bytes:
    deadline = time.monotonic() + seconds
    opener = urllib.request.build_opener(_HttpRedirectsOnly())
    try:
        # http(s) only: the scheme was checked by read_row_file, and each redirect by the handler.
        request = urllib.request.Request(url, headers={"User-Agent": "chunkq"})  # noqa: S310
        with opener.open(request, timeout=seconds) as reply:
            length = reply.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > max_bytes:
                raise _too_large(int(length), max_bytes)
            parts, total = [], 0
            while block := reply.read(_BLOCK):
                parts.append(block)
                total += len(block)
                if total > max_bytes:
                    raise _too_large(total, max_bytes)
                if time.monotonic() > deadline:
                    raise RowReadError(f"not read within {seconds:g} s ({total} bytes so far)")
            return b"".join(parts)
    except urllib.error.HTTPError as exc:
        if 300 <= exc.code < 400:
            raise RowReadError(f"too many redirects (HTTP {exc.code}): a redirect loop") from None
        raise RowReadError(f"HTTP {exc.code} {exc.reason}") from None
    except TimeoutError:
        raise RowReadError(f"no answer within {seconds:g} s") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, TimeoutError):
            raise RowReadError(f"no answer within {seconds:g} s") from None
        if isinstance(reason, OSError) and reason.errno == errno.ECONNREFUSED:
            raise RowReadError("connection refused") from None
        raise RowReadError(f"cannot be fetched: {reason}") from None


def _read_object(ref: str, max_bytes: int) -> bytes:
    from chunkq.jobs.contract.storage import open_store

    path = open_store(ref)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise RowReadError("no such object") from None
    if size > max_bytes:
        raise _too_large(size, max_bytes)
    return path.read_bytes()
