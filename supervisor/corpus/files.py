"""A run's corpus files: what each was when the run read it (checksum, size, version), that it is
still so, the labels that tell several apart, and the run's corpus read again in its order (export
--columns), whichever room asks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chunkq.jobs.contract.errors import CorpusError, StoreError
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run_files import file_sha256
from chunkq.jobs.contract.storage import is_local, open_store
from chunkq.supervisor.corpus.records import CorpusOptions, Record, cannot_read, read_corpus


def describe_inputs(paths: tuple[Path, ...]) -> list[dict[str, Any]]:
    """Each corpus file with its checksum and size, for the manifest and the run's identity."""
    described = []
    for path in paths:
        before = stamp(path)
        try:
            sha256 = file_sha256(path)
        except OSError as exc:
            raise cannot_read(path, exc) from exc
        unchanged(path, before)
        where = str(path.resolve()) if is_local(path) else str(path)
        described.append({"path": where, "sha256": sha256, "size": before[0], "version": before[1]})
    return described


def stamp(path: Path) -> tuple[int, str]:
    """(size, version): the modification time in ns here; an object's ETag (or time) as its store gives it."""
    if is_local(path):
        st = path.stat()
        return st.st_size, str(st.st_mtime_ns)
    remote: Any = path
    remote.fs.invalidate_cache(remote.path)
    info = remote.fs.info(remote.path)
    version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
    return int(info.get("size") or 0), str(version)


def unchanged(path: Path, before: tuple[int, str]) -> None:
    """Refuse a corpus file written to while chunkq read it: its checksum would not cover its rows."""
    if stamp(path) != before:
        raise CorpusError(
            f"{path}: the file changed while chunkq read it (size or modification time); "
            "submit it again once whatever writes it has finished"
        )


def labels(paths: tuple[Path, ...]) -> list[str]:
    """Names that tell several corpus files apart: their paths below the deepest common folder."""
    if len(paths) == 1:
        return [""]
    names = [str(p.resolve()) if is_local(p) else str(p).partition("://")[2] for p in paths]
    common = os.path.commonpath([os.path.dirname(n) for n in names])
    return [os.path.relpath(n, common) for n in names]


def run_corpus_fields(manifest: RunManifest, names: tuple[str, ...]) -> Iterator[Record]:
    """The run's corpus read again, in its order, with ``names`` in each record's ``extra`` (export
    --columns); StoreError if a file is not as the run read it (its size or version changed)."""
    corpus = manifest.data["corpus"]
    options = CorpusOptions(
        format=corpus["format"],
        text_field=corpus["text_field"],
        id_field=corpus["id_field"],
        pair_field=corpus.get("pair_field"),
        extra_fields=names,
    )
    inputs = manifest.data.get("inputs") or [corpus]
    paths = tuple(open_store(str(i["path"])) for i in inputs)
    for path, described in zip(paths, inputs, strict=True):
        if stamp(path) != (described["size"], described["version"]):
            raise StoreError(
                f"{path} has changed since run {manifest.run_id} read it; --columns needs it as it was"
            )
    for path, label in zip(paths, labels(paths), strict=True):
        yield from read_corpus(path, options, number_prefix=f"{label}:" if label else "")
