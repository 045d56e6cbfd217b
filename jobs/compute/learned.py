"""What a run learned about batch sizes on each kind of device, shared by all its workers.

``<store>/runs/<run>/learned/<device kind>.json`` holds the batch size (or token budget) that later
chunks start from. It moves like TCP's window, additive increase and multiplicative decrease:
- an out-of-memory lowers it to what fitted (the back-off halved the batch until one did);
- after GROW_AFTER chunks in a row without one, it grows by a GROW_STEPS-th of what the run asked
  for, back toward that request, so one transient OOM (a neighbour's cached memory, a standby
  loading its model) does not cap the run for ever.

``--batch-tokens auto`` keeps its own tuning fields in the same record (``token_batches``).

Every worker on every GPU of that kind updates the record, so an update is a read-modify-write
under an exclusive ``flock`` on a lock file beside it (local and network filesystems): no update
is lost to a race. An object store has no lock; there the last writer wins, which at worst costs
one more OOM (a lowering lost) or a later growth (a clean count lost), never a wrong result.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from typing import Any

from chunkq.jobs.compute import token_batches
from chunkq.jobs.contract.run_files import RunLayout, atomic_write_json, read_json
from chunkq.jobs.contract.specs import BATCH_TOKENS_AUTO, EncodeOptions
from chunkq.jobs.contract.storage import is_local, private_dirs

GROW_AFTER = 8  # clean chunks in a row before a learned limit grows again
GROW_STEPS = 8  # each growth adds this fraction of the requested limit (at least 1)
CLEAN = "clean_chunks"  # the record's count of clean chunks since its limit last moved


def read(layout: RunLayout, device_kind: str) -> dict[str, Any]:
    """The record for this kind of device ({} when nothing was learned, or it cannot be read)."""
    try:
        data = read_json(layout.learned_batch(device_kind))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _locked(layout: RunLayout, device_kind: str) -> Iterator[None]:
    path = layout.learned_batch(device_kind)
    if not is_local(path):
        yield
        return
    private_dirs(path.parent)
    # O_NOFOLLOW: a link planted as the lock file is refused, never followed out of the store.
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def update(
    layout: RunLayout, device_kind: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]
) -> dict[str, Any]:
    """Apply ``change`` (the record as it is now -> the new record, or None for no write) under the
    lock; return the record as it stands after."""
    with _locked(layout, device_kind):
        current = read(layout, device_kind)
        new = change(dict(current))
        if new is None:
            return current
        new["device"] = device_kind
        atomic_write_json(layout.learned_batch(device_kind), new)
        return new


def unit(options: EncodeOptions) -> str:
    """The record's key for the limit these options use."""
    return "batch_tokens" if options.batch_tokens is not None else "batch_size"


def requested(options: EncodeOptions) -> int | None:
    """The limit the run asked for (None for ``auto``, which finds its own)."""
    if options.batch_tokens == BATCH_TOKENS_AUTO:
        return None
    return int(options.batch_tokens) if options.batch_tokens is not None else int(options.batch_size)


def start_limit(options: EncodeOptions, learned: dict[str, Any]) -> int:
    """The batch size, or token budget, a chunk starts from."""
    if options.batch_tokens == BATCH_TOKENS_AUTO:
        return int(learned.get("batch_tokens") or token_batches.AUTO_START_TOKENS)
    asked = requested(options) or 1
    return min(asked, int(learned.get(unit(options)) or asked))


def after_chunk(
    record: dict[str, Any], options: EncodeOptions, fitted: int, backed_off: bool, chars_per_second: float
) -> dict[str, Any] | None:
    """The record after a chunk that ran at ``fitted`` (after halvings when ``backed_off``); None
    when nothing changes (a run that never hit an OOM writes nothing)."""
    if options.batch_tokens == BATCH_TOKENS_AUTO:
        return _after_auto_chunk(record, fitted, backed_off, chars_per_second)
    key, asked = unit(options), requested(options) or 1
    known = record.get(key)
    if backed_off:
        return {**record, key: min(fitted, int(known or fitted)), CLEAN: 0}
    if known is None or int(known) >= asked:
        return None
    clean = int(record.get(CLEAN, 0)) + 1
    if clean < GROW_AFTER:
        return {**record, CLEAN: clean}
    return {**record, key: min(asked, int(known) + max(1, asked // GROW_STEPS)), CLEAN: 0}


def _after_auto_chunk(
    record: dict[str, Any], fitted: int, backed_off: bool, chars_per_second: float
) -> dict[str, Any]:
    """``auto`` tunes its budget by speed under a ceiling that an OOM set; the ceiling itself grows
    by a GROW_STEPS-th after GROW_AFTER clean chunks, taking the budget along."""
    new = {**record, **token_batches.next_auto_budget(record, fitted, chars_per_second, backed_off)}
    ceiling = new.get("ceiling")
    if backed_off or ceiling is None:
        return {**new, CLEAN: 0}
    clean = int(record.get(CLEAN, 0)) + 1
    if clean < GROW_AFTER:
        return {**new, CLEAN: clean}
    step = max(1, int(ceiling) // GROW_STEPS)
    return {**new, "ceiling": int(ceiling) + step, "batch_tokens": int(new["batch_tokens"]) + step, CLEAN: 0}
