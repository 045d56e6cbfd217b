"""Every place ``chunkq export`` writes a result, in one table, as ``jobs/kinds`` holds the kinds.

A destination is a file format (``--out PATH --format NAME``, written whole by ``sinks/files.py``) or
a store named by a URL's scheme (``--to URL``, a ``Sink`` of its own module). The table gives the
CLI its ``--format`` choices, ``open_sink`` the sink for a scheme, the refusal of an unknown one its
list, and both paths their one check that nothing is written inside the store.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.redaction import redacted
from chunkq.jobs.contract.storage import inside_the_store

if TYPE_CHECKING:
    from chunkq.sinks import Sink


@dataclass(frozen=True)
class Destination:
    name: str
    usage: str  # how a user names it, as the refusal of an unknown one lists it
    schemes: tuple[str, ...] = ()  # a store's URL schemes; () for a file format
    sink: str = ""  # a store's "module:Class", made with (url, options); imported only when used
    suffixes: tuple[str, ...] = ()  # a file format's names' endings, which choose it without --format

    def open(self, url: str, options: dict[str, Any]) -> Sink:
        module, name = self.sink.split(":")
        made: Sink = getattr(importlib.import_module(module), name)(url, options)
        return made


DESTINATIONS = (
    Destination("parquet", "--format parquet", suffixes=(".parquet", ".pq")),
    Destination("npy", "--format npy (the ids beside it, PATH.ids.jsonl)", suffixes=(".npy",)),
    Destination("jsonl", "--format jsonl", suffixes=(".jsonl", ".ndjson")),
    Destination("lancedb", "lancedb://PATH/TABLE", ("lancedb",), "chunkq.sinks.lance:LanceSink"),
    Destination("faiss", "faiss:PATH", ("faiss",), "chunkq.sinks.faiss_index:FaissSink"),
    Destination(
        "postgresql",
        "postgresql://.../DB?table=T",
        ("postgresql", "postgres"),
        "chunkq.sinks.pgvector:PgvectorSink",
    ),
)
FILE_FORMATS = tuple(d.name for d in DESTINATIONS if not d.schemes)


def file_format(out: Path, asked: str | None) -> str:
    """The file format of ``--out OUT`` (``asked``: ``--format``'s, None where not given): the one
    its name's ending says, else ``asked``, else the first. A name that says another format than
    ``asked``, or one chunkq does not write (``.csv``) with none asked, is refused: a file named
    e.jsonl held Parquet, said nothing."""
    files = [d for d in DESTINATIONS if not d.schemes]
    suffix = out.suffix.lower() if out.name not in ("", "-") else ""
    named = next((d.name for d in files if suffix in d.suffixes), None)
    if asked is not None and named is not None and named != asked:
        raise ConfigError(f"--out {out} names a {named} file, and --format is {asked}: give one of them")
    if asked is None and named is None and suffix:
        endings = ", ".join(f"{d.suffixes[0]} ({d.name})" for d in files)
        raise ConfigError(
            f"--out {out}: chunkq writes {endings} files, and {suffix} is none of them; "
            "name the file so, or give --format"
        )
    return asked or named or files[0].name


def for_url(url: str) -> Destination:
    """The store ``url`` names by its scheme; ConfigError listing those chunkq writes."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    for destination in DESTINATIONS:
        if scheme in destination.schemes:
            return destination
    known = [d.usage for d in DESTINATIONS if d.schemes]
    raise ConfigError(f"--to {redacted(url)}: chunkq writes to {', '.join(known[:-1])} and {known[-1]}")


def outside_the_store(store: Any, paths: Iterable[str | Path], named: str) -> None:
    """Refuse a destination whose files lie inside the store (chunkq's own); ``named``: how the
    message names it (``--to URL``, the ``--out`` path)."""
    if inside_the_store(store, list(paths)) is not None:
        raise ConfigError(f"{named} is inside the store {store}, which is chunkq's; export somewhere else")
