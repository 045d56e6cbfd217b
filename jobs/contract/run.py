"""A run, opened once: where its files are, its manifest, and its published result's manifest.

Every command that reads a run opens it here once and passes the value on, so nothing below reads
the manifest again (``tests/whole/test_run_reads.py`` counts the reads of each command). The result's
manifest (``result/manifest.json``, written last by assembly, so its presence commits the result)
is a typed record: readers ask it for the facts below rather than by string key; ``fields`` keeps
the JSON as written, for the checks that compare what it says with what the run's manifest says it
should (``supervisor/result/published.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from chunkq.jobs.contract.manifest import RunManifest, load_manifest
from chunkq.jobs.contract.run_files import RunLayout, read_json


@dataclass(frozen=True)
class Run:
    """A run's layout and manifest; its result manifest read on first use and kept."""

    layout: RunLayout
    manifest: RunManifest

    @classmethod
    def open(cls, store: str | os.PathLike[str], run_id: str) -> Run:
        """The run ``run_id`` of ``store``; RunNotFoundError when it has no manifest."""
        layout = RunLayout(store, run_id)
        return cls(layout, load_manifest(layout))

    @classmethod
    def of(cls, layout: RunLayout) -> Run:
        return cls(layout, load_manifest(layout))

    @property
    def run_id(self) -> str:
        return self.layout.run_id

    @cached_property
    def result(self) -> ResultManifest | None:
        """The published result's manifest as it was when first asked; None when none is published."""
        return ResultManifest.read(self.layout)


@dataclass(frozen=True)
class ResultManifest:
    """A parsed result manifest; ``unreadable`` says why one torn or not a JSON object has no ``fields``."""

    fields: dict[str, Any]
    unreadable: str = ""

    @classmethod
    def read(cls, layout: RunLayout) -> ResultManifest | None:
        """The run's published result manifest; None when none is published."""
        path = layout.result_manifest
        if not path.is_file():
            return None
        try:
            data = read_json(path)
        except (OSError, ValueError) as exc:  # torn or truncated: `assemble --verify` says the same
            return cls({}, unreadable=f"result/manifest.json is unreadable ({exc})")
        if not isinstance(data, dict):
            return cls({}, unreadable="result/manifest.json is not a JSON object")
        return cls(data)

    def _int(self, key: str) -> int | None:
        value = self.fields.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def rows(self) -> int | None:
        return self._int("rows")

    @property
    def dim(self) -> int | None:
        return self._int("dim")

    @property
    def corpus_rows(self) -> int | None:
        return self._int("corpus_rows")

    @property
    def complete(self) -> bool:
        """False for a partial result published under --allow-partial (quarantined chunks missing)."""
        return bool(self.fields.get("complete", True))

    @property
    def missing(self) -> list[dict[str, Any]]:
        """The quarantined chunks a partial result lacks: ``chunk`` and ``rows`` each."""
        return [m for m in self.fields.get("missing") or [] if isinstance(m, dict)]

    @property
    def bad_rows(self) -> list[Any]:
        """Rows left out under --allow-missing."""
        return list(self.fields.get("bad_rows") or [])

    @property
    def shards(self) -> list[Any] | None:
        """The shard list of a sharded result; None for one file."""
        shards = self.fields.get("shards")
        return shards if isinstance(shards, list) else None

    @property
    def ragged(self) -> Any:
        """A ragged result's description (sparse, multi-vector); None for a matrix."""
        return self.fields.get("ragged")

    @property
    def fingerprint(self) -> str | None:
        value = self.fields.get("fingerprint")
        return value if isinstance(value, str) else None

    @property
    def assembled_at(self) -> Any:
        return self.fields.get("assembled_at")

    def partial_note(self) -> str:
        """What a partial result lacks, in one line."""
        rows = sum(int(m.get("rows", 0)) for m in self.missing)
        chunks = [m.get("chunk") for m in self.missing]
        return (
            f"the result holds {self.rows} of {self.corpus_rows} rows; "
            f"{len(self.missing)} quarantined chunk(s) ({rows} rows) are missing: {chunks[:10]}"
        )
