"""The names a published result's files and shard folders take: what the result's writers
(``writer.py``, ``ragged.py``) and its readers (``published.py``) agree on."""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime

SINGLE = ("embeddings.npy", "ids.jsonl")
SHARD_DIR = re.compile(r"shards-[0-9A-Za-z]{1,64}")  # what a result manifest may name as its shard folder


def new_shard_dir() -> str:
    """A shard folder's name no earlier result of the run has used (older ones are removed once
    the new manifest is in place)."""
    return f"shards-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%f')}{os.getpid()}"
