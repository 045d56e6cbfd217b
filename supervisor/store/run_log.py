"""Where a run's log lines go: the terminal shows progress and what needs the user; a file beside
the run keeps every INFO line, its pool's and workers' included.

A 500-row demo logged 277 lines at INFO, most of them RQ's own per-job lines, and the progress was
lost among them. ``chunkq run`` and ``supervise`` therefore show the progress display and warnings
(``-v``: INFO as well, ``-vv``: DEBUG; ``--log-level`` sets the terminal's level outright), and
append everything at INFO or above to ``runs/<run>/logs/run.log`` (on this machine for an object
store). The pool's output passes through the supervisor line by line: to the file, and to the
terminal when the line's level reaches the terminal's.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
from collections import deque
from pathlib import Path
from typing import IO, Any

from chunkq.jobs.contract.settings import LOG_FORMAT
from chunkq.jobs.contract.storage import private_dirs, private_open

PROGRESS_LOGGER = "chunkq.progress"  # the plain progress lines: on the terminal at any level
LOG_NAME = "run.log"
QUIET = logging.WARNING  # the terminal's level for run and supervise unless told otherwise
_LEVEL = re.compile(rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
# An ERROR line: a worker's ("[NAME gpu=N] logger: what") or the pool's ("logger: what").
_ERROR_LINE = re.compile(r" (?:ERROR|CRITICAL) (\[[^\]]*\] )?\S+: (.*)$")


class TerminalLog(logging.StreamHandler):  # type: ignore[type-arg]
    """The log lines a user sees: at ``threshold`` or above, and the progress lines whatever it is.

    While a live progress bar runs (``live``), lines are printed through its console, above the
    bar, instead of tearing it."""

    live: Any = None  # the rich Console of the live progress bar, while one runs

    def __init__(self, threshold: int) -> None:
        super().__init__(sys.stderr)
        self.threshold = threshold
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self._progress_format = logging.Formatter("%(asctime)s %(message)s")

    def emit(self, record: logging.LogRecord) -> None:
        if TerminalLog.live is None:
            super().emit(record)
            return
        try:
            self.print_line(self.format(record))
        except Exception:
            self.handleError(record)

    @staticmethod
    def print_line(text: str) -> None:
        """A line on the terminal, above the live bar while there is one."""
        if TerminalLog.live is not None:
            from rich.text import Text

            TerminalLog.live.print(Text(text), soft_wrap=True)
        else:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    def format(self, record: logging.LogRecord) -> str:
        if record.name == PROGRESS_LOGGER:  # not a log line to the user: no level, no logger name
            return self._progress_format.format(record)
        return super().format(record)

    @property
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current sys.stderr

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno >= self.threshold or record.name == PROGRESS_LOGGER) and bool(
            super().filter(record)
        )


def terminal() -> TerminalLog:
    """The root logger's terminal handler, made on first use."""
    root = logging.getLogger()
    for handler in root.handlers:
        if isinstance(handler, TerminalLog):
            return handler
    handler = TerminalLog(root.getEffectiveLevel())
    root.addHandler(handler)
    return handler


def show_on_terminal(level: int) -> None:
    """The terminal shows ``level`` and up; the root logger lets INFO through for the run's file."""
    terminal().threshold = level
    logging.getLogger().setLevel(min(level, logging.INFO))


def log_path(state_dir: Path, run_id: str) -> Path:
    return state_dir / "runs" / run_id / "logs" / LOG_NAME


class _LogFile(logging.StreamHandler):  # type: ignore[type-arg]
    """The log file's handler: a write that fails (a full disk) stops the file, said once on the
    terminal, instead of logging's traceback on every line; the run goes on (its store decides)."""

    def __init__(self, stream: IO[str], path: Path) -> None:
        super().__init__(stream)
        self.path = path
        self.broken = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.broken:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        self.fail(sys.exc_info()[1])

    def fail(self, exc: BaseException | None) -> None:
        if not self.broken:
            self.broken = True
            sys.stderr.write(
                f"chunkq: warning: the run's log file {self.path} cannot be written ({exc}); "
                "log lines go to the terminal's level only from here\n"
            )


class RunLog:
    """The run's log file while a command works on it: the root logger's records at INFO or above
    (DEBUG when the terminal shows DEBUG), and the pool's lines through ``write``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handler: _LogFile | None = None
        self._lock = threading.RLock()
        # Set once the user stopped the run: the pool's lines about chunks it interrupts on the
        # user's own request (RQ's "SystemExit" per job) go to the file only; the supervisor says
        # what happens.
        self.terminal_muted = False
        self.errors: deque[tuple[bool, str]] = deque(
            maxlen=8
        )  # the pool's last ERROR lines: (a worker's, what)

    def __enter__(self) -> RunLog:
        private_dirs(self.path.parent)
        stream = private_open(self.path, "a", encoding="utf-8", buffering=1)
        self._handler = _LogFile(stream, self.path)
        self._handler.setFormatter(logging.Formatter(LOG_FORMAT))
        self._handler.setLevel(min(terminal().threshold, logging.INFO))
        self._handler.lock = self._lock  # one lock for both writers
        logging.getLogger().addHandler(self._handler)
        return self

    def write(self, line: bytes) -> None:
        """One line of the pool's output, as it wrote it."""
        handler = self._handler
        if handler is None or handler.broken:
            return
        with self._lock:
            try:
                handler.stream.write(line.decode("utf-8", "replace"))
            except OSError as exc:
                handler.fail(exc)

    def note_error(self, line: bytes) -> None:
        """Keep an ERROR line of the pool's: why it ended, for the command's last line."""
        found = _ERROR_LINE.search(line.decode("utf-8", "replace").rstrip())
        if found:
            self.errors.append((bool(found.group(1)), found.group(2)))

    def why_the_pool_ended(self) -> str | None:
        """A worker's last error where one said why (the pool's own lines say only that it gave up),
        else the pool's last; None where it said nothing at ERROR."""
        worker = [what for by_worker, what in self.errors if by_worker]
        said = worker or [what for _, what in self.errors]
        return said[-1] if said else None

    def __exit__(self, *exc: object) -> None:
        if self._handler is not None:
            logging.getLogger().removeHandler(self._handler)
            with contextlib.suppress(OSError):  # its last buffered line, on a full disk
                self._handler.stream.close()
            self._handler = None


def level_of(line: bytes, previous: int) -> int:
    """A pool line's level from its format; a line without one (a traceback's) is its record's."""
    found = _LEVEL.match(line)
    return logging.getLevelName(found.group(1).decode()) if found else previous


def relay(pipe: IO[bytes], run_log: RunLog) -> threading.Thread:
    """A thread copying the pool's output to the run's file, and to the terminal from the
    terminal's level up; it ends when the pool closes its output."""

    def copy() -> None:
        level, shown = logging.INFO, True
        with pipe:
            for line in iter(pipe.readline, b""):
                run_log.write(line)
                level = level_of(line, level)
                if level >= logging.ERROR:
                    run_log.note_error(line)
                if shown and not run_log.terminal_muted and level >= terminal().threshold:
                    try:
                        TerminalLog.print_line(line.decode("utf-8", "replace").rstrip("\n"))
                    except Exception:  # a closed terminal: keep draining the pipe
                        shown = False  # (a pool blocked on a full pipe would stall the run)

    thread = threading.Thread(target=copy, name="chunkq-pool-output", daemon=True)
    thread.start()
    return thread
