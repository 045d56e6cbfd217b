"""No password is ever shown: one redaction for every line a chunkq process writes.

A URL can carry a password in its user part (``postgresql://u:SECRET@h/db``, ``redis://:SECRET@h``),
written with or without ``//`` and with characters it should have encoded (``u:S3/cret@h``), or in
its query (``?password=SECRET``). Rather than trust each message to mask the URL it names, every
chunkq process (the CLI, the pool, a worker) calls ``guard_process()`` first: it remembers the
password of every URL among its arguments and ``CHUNKQ_*`` variables, then passes everything it
writes through ``redact``: its stdout and stderr, and every log record (the terminal, the run's log
file in the store, a crash file), tracebacks included. ``redact`` masks any URL's password by its
shape, and every remembered password wherever a message repeats it (a client quoting it back).

Passwords shorter than MIN_REMEMBERED are masked where a URL shows them, not everywhere: replacing
every "a" of every line would hide more than it protects.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from typing import IO, Any
from urllib.parse import parse_qs, unquote

from chunkq.jobs.contract.addresses import secrets_in, shown
from chunkq.jobs.contract.masking import MASK, QUERY_PASSWORD, USER_PASSWORD, redact, remember_secret

__all__ = ["MASK", "redact", "remember_secret"]  # masking.py's, where most callers look for them


def secrets_of(text: str) -> list[str]:
    """The passwords ``text`` carries where URLs do, as written and URL-decoded: as the connecting
    library reads them (``addresses``), and by their shape."""
    found = [*secrets_in(text), *(m.group(2) for m in USER_PASSWORD.finditer(text))]
    for match in QUERY_PASSWORD.finditer(text):
        found.append(match.group(0).split("=", 1)[1])
    if "?" in text:
        try:
            found += parse_qs(text.split("?", 1)[1]).get("password", [])
        except ValueError:
            pass
    return [s for s in {*found, *(unquote(s) for s in found)} if s]


def remember(*texts: str | None) -> None:
    """Mask the passwords these URLs (or any text) carry wherever they appear from now on, and the
    pieces a client may quote when it splits a URL at a character the password should have
    encoded (libpq: 'invalid integer value "S3cr" for connection option "port"')."""
    for text in texts:
        for secret in secrets_of(text or ""):
            remember_secret(secret)


def redacted(url: str) -> str:
    """A URL as a message shows it: as the library that connects reads it, without its password,
    and nothing of one it cannot read (``addresses.shown``)."""
    remember(url)
    return shown(url)


class RedactingStream(io.TextIOBase):
    """A text stream that redacts what is written before its stream gets it."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        shown = redact(text)
        try:
            self.stream.write(shown)
        except UnicodeEncodeError:  # a terminal that cannot show a character: replaced, still redacted
            encoding = str(getattr(self.stream, "encoding", None) or "ascii")
            self.stream.write(shown.encode(encoding, "replace").decode(encoding))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self.stream, "encoding", "utf-8"))

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self.stream, "errors", None)

    @property
    def buffer(self) -> Any:
        """The binary side redacts too: click writes bytes there (a terminal whose encoding cannot
        show the text), and the raw buffer printed a password on an ASCII terminal."""
        raw = getattr(self.stream, "buffer", None)
        return None if raw is None else _RedactingBuffer(raw, self.encoding)


class _RedactingBuffer(io.RawIOBase):
    """A binary stream that redacts what it is given, read as text in ``encoding``."""

    def __init__(self, raw: Any, encoding: str) -> None:
        self.raw, self._encoding = raw, encoding

    def write(self, data: Any) -> int:
        text = bytes(data).decode(self._encoding, "replace")
        self.raw.write(redact(text).encode(self._encoding, "replace"))
        return len(data)

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return int(self.raw.fileno())


_FACTORY = logging.getLogRecordFactory()


def _redacted_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
    """A log record whose message (and traceback) is redacted before any handler formats it."""
    record = _FACTORY(*args, **kwargs)
    try:
        record.msg, record.args = redact(record.getMessage()), None
    except Exception:  # noqa: S110 - a malformed message is logging's to report, as it would be
        pass
    if record.exc_info:
        record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
    if record.stack_info:
        record.stack_info = redact(record.stack_info)
    return record


def guard_process() -> None:
    """Redact everything this process writes; remember the passwords of its arguments and
    ``CHUNKQ_*`` variables (each process that may hold a URL calls this first)."""
    remember(*sys.argv, *(v for k, v in os.environ.items() if k.startswith("CHUNKQ_")))
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, RedactingStream):
            setattr(sys, name, RedactingStream(stream))
    if logging.getLogRecordFactory() is not _redacted_record:
        logging.setLogRecordFactory(_redacted_record)
