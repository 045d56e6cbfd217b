"""Progress display: a live rich bar on a terminal, plain log lines anywhere else."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from chunkq.jobs.compute.device_busy import GPU_SOURCES
from chunkq.supervisor.store.run_log import PROGRESS_LOGGER, TerminalLog
from chunkq.supervisor.watch.snapshot import Snapshot

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

log = logging.getLogger(PROGRESS_LOGGER)  # reaches the terminal at any log level (run_log)

PLAIN_EVERY_SECONDS = 5.0
WIDE_COLUMNS = 120  # narrower terminals get the narrow bar
WIDE_FIELDS = (
    "rows {task.fields[rows]}  chunks {task.fields[chunks]}  {task.fields[rate]}  "
    "ETA {task.fields[eta]}  [red]{task.fields[failed]} failed"
)
NARROW_BAR = 10
NARROW_FIELDS = (
    "{task.percentage:>3.0f}% {task.fields[rows]} rows {task.fields[chunks]} chunks {task.fields[rate]} "
    "ETA {task.fields[eta]} [red]{task.fields[failed]} failed"
)


def _short(n: int) -> str:
    """A count in at most 5 characters: 999, 12.3k, 512k, 1.0M."""
    for unit, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            value = n / size
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return str(n)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def describe(snap: Snapshot) -> str:
    """One line: chunks and rows done, rows/s, ETA, failures, and every chunk that needs attention."""
    rate = f"{snap.rows_per_second:,.0f} rows/s" if snap.rows_per_second else "- rows/s"
    if snap.live:
        states = f"{snap.chunks_running} running, {snap.chunks_queued} queued, "
        if snap.chunks_waiting:
            states += f"{snap.chunks_waiting} waiting in the store, "
    else:
        waiting = snap.chunks - snap.chunks_done - snap.chunks_quarantined - snap.chunks_retrying
        states = f"{waiting} not done (from the store alone: give --redis-url for what runs and waits), "
    trouble = "".join(
        f", {len(chunks)} {what} ({_chunk_list(chunks)})"
        for what, chunks in (
            ("lost from Redis (queued again)", snap.lost),
            ("stale (their worker stopped beating)", snap.stale),
            ("abandoned (their worker and its pool died on this host)", sorted(snap.gone)),
            ("stranded (taken by a worker that died)", snap.stranded),
        )
        if chunks
    )
    eta = "" if snap.settled else f"; ETA {_duration(snap.eta_seconds)}"
    if snap.starting:
        eta = "; starting: workers are loading the model"
    if snap.idle_seconds and snap.own_pool_seconds is not None:
        eta = (
            f"; its pool is starting ({snap.own_pool_seconds:.0f} s)"
            if snap.chunks_done == 0
            else f"; its pool has taken no job for {snap.idle_seconds:.0f} s"
        )
    elif snap.idle_seconds:
        eta = f"; no worker has taken a job from queue {snap.queue!r} for {snap.idle_seconds:.0f} s"
    if not snap.settled and not snap.owned:
        eta = "; not running: no process supervises it (`chunkq run` with the same corpus resumes it)"
    encoding = f" (+{snap.rows_encoding:,} encoding)" if snap.rows_encoding else ""
    busy = snap.device_busy
    if busy and busy["source"] in GPU_SOURCES:  # an idle GPU is the thing to see; a CPU is always busy
        rate += f", GPU busy {100 * busy['share']:.0f} %"
    return (
        f"run {snap.run_id}: chunks {snap.chunks_done}/{snap.chunks} done, {states}"
        f"{snap.chunks_retrying} retrying, {snap.chunks_quarantined} quarantined{trouble}; "
        f"rows {snap.corpus_rows_done:,}/{snap.corpus_rows:,}{encoding}; {rate}{eta}"
    )


def _chunk_list(chunks: list[int], shown: int = 10) -> str:
    more = f" and {len(chunks) - shown} more" if len(chunks) > shown else ""
    return "chunk " + ", ".join(str(i) for i in chunks[:shown]) + more


class ProgressDisplay:
    """``update()`` with each snapshot; a context manager so the live bar is always closed."""

    def __init__(self, live: bool | None = None, console: Console | None = None) -> None:
        """``console``: where the bar is drawn (stderr's terminal unless given)."""
        self.live = sys.stderr.isatty() if live is None else live
        self._console = console
        self._last_plain = 0.0
        self._last_line = ""
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._wide = True
        self._shown = 0  # rows the bar has shown: a look from the store alone never moves it back
        self._source: Callable[[], Snapshot] | None = None

    def __enter__(self) -> ProgressDisplay:
        if self.live:
            # Here, not at the top: rich costs 0.1 s of CPU to import, and a run whose stderr is a
            # pipe or a file (a script, a batch job) draws no bar.
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            console = self._console or Console(stderr=True)
            # An 80-column terminal cut the one line of the wide layout off mid-field ("ETA 0:…");
            # the narrow one drops the run's name (every log line says it) and shortens the counts.
            self._wide = console.width >= WIDE_COLUMNS
            wide = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn(WIDE_FIELDS)]
            narrow = [BarColumn(bar_width=NARROW_BAR), TextColumn(NARROW_FIELDS)]
            columns = [*wide, TimeElapsedColumn()] if self._wide else narrow
            # Started at the first snapshot, not here: a bar started before its task drew a blank
            # first frame.
            self._progress = Progress(*columns, console=console)
        return self

    def follow(self, source: Callable[[], Snapshot]) -> None:
        """Where the bar looks between the watch's own looks: the store, while a pool drains after
        Ctrl+C (the bar stayed at the count of the first signal while the drain finished more)."""
        self._source = source

    def tick(self, eta: str = "stopping") -> None:
        """Draw the bar from ``follow``'s source, its ETA field saying ``eta``."""
        if self._progress is None or self._task is None or self._source is None:
            return
        try:
            snap = self._source()
        except Exception:  # a frame not drawn must never stop a run's clean-up
            log.debug("progress: the store could not be read for the bar", exc_info=True)
            return
        self.update(snap, eta)

    def update(self, snap: Snapshot, eta: str | None = None) -> None:
        """One snapshot drawn (``eta``: what the ETA field says instead of the snapshot's own)."""
        if self._progress is not None:
            self._draw(self._progress, snap, eta)
            return
        line = describe(snap)
        now = time.monotonic()
        if snap.settled or (line != self._last_line and now - self._last_plain >= PLAIN_EVERY_SECONDS):
            log.info("%s", line)
            self._last_plain, self._last_line = now, line

    def _draw(self, progress: Progress, snap: Snapshot, eta: str | None) -> None:
        # The bar moves with the rows running chunks have encoded, not only when a chunk is published.
        done = self._shown = max(self._shown, snap.rows_done + snap.rows_encoding)
        count = (lambda n: f"{n:,}") if self._wide else _short
        rate = snap.rows_per_second
        fields: dict[str, Any] = {
            "rows": f"{count(done)}/{count(snap.rows)}",
            "chunks": f"{snap.chunks_done}/{snap.chunks}",
            "rate": f"{count(round(rate))}/s" if rate else "-/s",
            "eta": eta if eta is not None else ("done" if snap.settled else _eta(snap)),
            "failed": snap.chunks_retrying + snap.chunks_quarantined,
        }
        if self._task is None:  # the task before the start: a bar started without one drew a blank frame
            self._task = progress.add_task(f"run {snap.run_id}", total=snap.rows, completed=done, **fields)
            progress.start()
            TerminalLog.live = progress.console  # log lines print above the bar
        else:
            progress.update(self._task, completed=done, **fields)
        progress.refresh()  # now, not at the next tick of rich's own timer: the last frame is this one

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None and self._task is not None:
            if exc_type is not None:  # the last frame is what the store holds, not the last look's
                self.tick("stopped")
            TerminalLog.live = None
            self._progress.stop()


def _eta(snap: Snapshot) -> str:
    if snap.idle_seconds:
        return "no worker"
    return "starting" if snap.starting else _duration(snap.eta_seconds)
