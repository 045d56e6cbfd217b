"""A corpus file's bad rows, told in one error: after the first, the reader reads on for more.

A newcomer's corpus with a few bad rows took one run per row to mend. Now the first bad row stops
the records (nothing after it is yielded) but not the reading: the rest of the file is parsed for
more, up to ``SHOWN`` rows or ``SCAN_SECONDS`` of reading, and one error names them all, the first
row first (a file with one bad row gives the one-line message it always gave). Rows the reader
cannot read past (a line over the limit, malformed CSV quoting, the first record's missing
``--id-field``) end the scan there.
"""

from __future__ import annotations

import time

from chunkq.jobs.contract.errors import CorpusError

SHOWN = 20  # bad rows named in one error; a file with more has a data bug no list will explain
SCAN_SECONDS = 10.0  # reading on after the first bad row, at most: the user is waiting for the error
_CHECK_EVERY = 4096  # rows between looks at the clock while reading on


class WholeFileError(CorpusError):
    """A bad row that says the file as a whole is misread (every later row would repeat it)."""


class BadRowsError(CorpusError):
    """Several bad rows, or one and how far the reading went: each row's own error kept, so a
    later check (duplicate ids, found as the rows are split) can name its rows beside them."""

    def __init__(self, message: str, rows: list[CorpusError], cut: str) -> None:
        super().__init__(message)
        self.rows, self.cut = rows, cut


def rows_of(error: CorpusError) -> tuple[list[CorpusError], str]:
    """An error's bad rows, and how far the reading went ("" where it read to the end)."""
    return (error.rows, error.cut) if isinstance(error, BadRowsError) else ([error], "")


def stopped_at_shown() -> str:
    """How far a list that reached SHOWN rows went."""
    return f"stopped at {SHOWN} bad rows; the rest is not checked"


def read_on_to(where: str) -> str:
    """How far the reading on went once it had taken SCAN_SECONDS."""
    return f"read on for {SCAN_SECONDS:.0f} s, to {where}; the rest is not checked"


def told(rows: list[CorpusError], place: str, cut: str) -> CorpusError:
    """One error for ``rows`` of ``place`` (a file, or the corpus), the first first."""
    first, more = rows[0], rows[1:]
    if not more and not cut:
        return first
    lines = [str(first)]
    if more:
        lines.append(f"{len(more)} more bad row{'' if len(more) == 1 else 's'} in {place}:")
        lines += [f"  {error}" for error in more]
    else:
        lines.append(f"no other bad row in {place} so far:")
    if cut:
        lines.append(f"  ({cut})")
    return BadRowsError("\n".join(lines), rows, cut)


class BadRows:
    """Collects one file's bad rows; raises the combined error once it has seen enough."""

    def __init__(self, path: object) -> None:
        self.path = str(path)
        self.found: list[CorpusError] = []
        self._since = 0.0
        self._rows = 0

    def add(self, error: CorpusError) -> None:
        """One more bad row; raises where reading on must stop (enough rows, or the file is misread)."""
        if isinstance(error, WholeFileError):
            raise self.stop(error)
        self.found.append(error)
        if len(self.found) == 1:
            self._since = time.monotonic()
        if len(self.found) >= SHOWN:
            raise self._combined(stopped_at_shown())

    def stop(self, error: CorpusError) -> CorpusError:
        """``error`` as the last row read: the reader cannot go past it."""
        if not self.found:
            return error
        self.found.append(error)
        return self._combined("the reader stops at the last; the rest is not checked")

    def reading_on(self, where: str) -> bool:
        """Whether a bad row came before this good one (then it is not yielded); raises once the
        reading on has taken its time."""
        if not self.found:
            return False
        self._rows += 1
        if self._rows % _CHECK_EVERY == 0 and time.monotonic() - self._since > SCAN_SECONDS:
            raise self._combined(read_on_to(where))
        return True

    def end(self) -> None:
        """At the end of the file: the combined error, if any row was bad."""
        if self.found:
            raise self._combined("")

    def _combined(self, cut: str) -> CorpusError:
        return told(self.found, self.path, cut)
