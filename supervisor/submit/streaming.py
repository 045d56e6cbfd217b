"""A new run's chunks queued while its corpus is still being split (issue 64.2: at 200,000 rows the
split took 13 s before any worker had a chunk).

``chunkq run`` starts its Redis and pool before it splits a new run's corpus. Each chunk input, once
written, is listed in ``runs/<run>/splitting.json`` (the manifest so far: the run's manifest with the
chunks written until then) and handed to a ``SplitFeed``, which queues it; a worker checks a chunk
against that file where the run has no manifest yet. The chunks are numbered and filled as the
whole split numbers and fills them, so a chunk queued early is the chunk the manifest names at the
end. The manifest is written once the split is whole, and ``splitting.json`` removed.

A split that fails (a bad row far in) first stops whatever took its chunks (``SplitFeed.abandon``),
then leaves the store as it was. A split cut short (kill -9) leaves ``splitting.json`` and no
manifest: the next command splits the corpus again from its first row, dropping what the first
one wrote and queued (``leftovers_of_a_split``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run_files import RunLayout, atomic_write_json
from chunkq.jobs.contract.storage import list_names, remove_tree

# Chunks go to the queue at once until this many are there (every worker has one), then at most
# every FEED_SECONDS: each hand-over rewrites splitting.json and asks Redis about the chunks.
FIRST_FED = 4
FEED_SECONDS = 0.25


class SplitFeed(Protocol):
    """Where a run's chunks go while its corpus is split (``chunkq run``: its queue)."""

    def queue(self, manifest: RunManifest, indices: list[int]) -> None:
        """Queue ``indices``, chunks ``manifest`` (the manifest so far) names."""

    def restart(self) -> None:
        """The corpus is split again from its first row (a split was cut short): forget what an
        earlier split queued."""

    def abandon(self) -> None:
        """The split failed: stop whatever took its chunks and forget them, before the run's files go."""


class SplitManifest:
    """The manifest so far of a run being split: ``written`` is told each chunk input as it lands."""

    def __init__(self, layout: RunLayout, base: dict[str, Any], feed: SplitFeed) -> None:
        self.layout, self.base, self.feed = layout, base, feed
        self.plan: dict[str, Any] | None = None  # what the plan knows before the split (its producer)
        self.extra: dict[str, Any] = {}  # other fields known before the split (chunk_options)
        self.rows = self.chunks = 0
        self.pending: list[int] = []
        self.fed_at = 0.0

    def written(self, index: int, rows: int) -> None:
        self.rows += rows
        self.chunks = index + 1
        self.pending.append(index)
        if self.chunks <= FIRST_FED or time.monotonic() - self.fed_at >= FEED_SECONDS:
            self.feed_pending()

    def feed_pending(self) -> None:
        if not self.pending:
            return
        data = {**self.base, **self.extra, "rows": self.rows, "chunks": self.chunks, "splitting": True}
        if self.plan is not None:
            # Every row so far is a text to encode, in the chunks' own order; what the final plan
            # adds (cached texts, duplicates, the row map) names no chunk queued before it.
            data["plan"] = {**self.plan, "corpus_rows": self.rows, "encode_rows": self.rows, "cached_rows": 0}
        atomic_write_json(self.layout.splitting, data)
        self.feed.queue(RunManifest(data), self.pending)
        self.pending, self.fed_at = [], time.monotonic()

    def finished(self) -> None:
        """The manifest is written: what was the split's own file goes."""
        with contextlib.suppress(FileNotFoundError):
            self.layout.splitting.unlink()


def leftovers_of_a_split(layout: RunLayout) -> bool:
    """Whether the run's folder holds what a split cut short left (``splitting.json``, no manifest):
    then it is removed, all but the run's lock, so the corpus is split again from its first row."""
    if layout.manifest.is_file() or not layout.splitting.is_file():
        return False
    # The split's own file last: a command killed meanwhile leaves it, and the next one goes on.
    names = sorted(
        (n for n in list_names(layout.root) if n != layout.owner.name),
        key=lambda n: n == layout.splitting.name,
    )
    for name in names:
        path = layout.root / name
        if path.is_dir():
            remove_tree(path)
        else:
            path.unlink(missing_ok=True)
    return True
