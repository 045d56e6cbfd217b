"""The chunkq exception tree: which failures are whose fault, and what should happen next."""

from __future__ import annotations


class ChunkqError(Exception):
    """Base of every error chunkq raises on purpose."""


class ConfigError(ChunkqError):
    """The settings cannot work (unknown GPU, bad option); fix the command, not the data."""


class BadInputError(ChunkqError):
    """The input cannot be encoded as given; retrying will not help."""


class CorpusError(BadInputError):
    """A corpus file is malformed; the message names the file and line or row."""


class RunConflictError(ChunkqError):
    """A run id is already taken by a different corpus or different options."""


class StoreError(ChunkqError):
    """The store holds something missing or inconsistent for a run."""


class AssemblyError(StoreError):
    """Assembly found missing or corrupt chunk outputs; ``problems`` lists every one."""

    def __init__(self, run_id: str, problems: list[str]) -> None:
        self.run_id = run_id
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"run {run_id}: cannot assemble, {len(problems)} problem(s):\n{lines}")


class JobNotAllowedError(ChunkqError):
    """A job named a function, callback or webhook outside the allow-list."""
