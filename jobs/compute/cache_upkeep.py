"""The whole vector cache, looked after: what each producer holds and has served
(``chunkq cache``), and removing shards by age or producer (``chunkq cache clean``). Reading and
writing a producer's shards is ``vector_cache.py``'s.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

from chunkq.jobs.compute.vector_cache import HASH_BYTES, ORPHAN_SECONDS, VectorCache
from chunkq.jobs.contract.run_files import read_json
from chunkq.jobs.contract.storage import list_names, list_with_mtime, remove_tree


def summary(cache: VectorCache) -> list[dict[str, Any]]:
    """Per producer: its model and options, shards, rows, bytes, hits and when it was last used."""
    out = []
    for key in cache.producers():
        view = VectorCache(cache.store, key)
        try:
            described = read_json(view._dir("producer.json"))
        except (OSError, ValueError):
            described = {}
        shards = view.shards()
        used = _usage(view)
        out.append(
            {
                "producer": key,
                "model": described.get("model"),
                "model_identity": described.get("model_identity"),
                "options": described.get("options"),
                "shards": len(shards),
                "rows": sum(s.rows for s in shards),
                "bytes": sum(s.rows * (s.dim * 4 + HASH_BYTES) for s in shards),
                "hits": sum(int(u.get("hits") or 0) for u in used),
                "runs": len({u.get("run_id") for u in used}),
                "last_used": max((str(u.get("at")) for u in used), default=None),
                "encode_seconds": round(sum(float(s.meta.get("encode_seconds") or 0) for s in shards), 3),
            }
        )
    return out


def _usage(view: VectorCache) -> list[dict[str, Any]]:
    folder = view._dir("usage")
    records = []
    for name in list_names(folder):
        try:
            record = read_json(folder / name)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def clean(cache: VectorCache, older_than: float | None = None, key: str | None = None) -> dict[str, int]:
    """Remove shards (of one producer, or all) written more than ``older_than`` seconds ago, or
    every shard; a producer left with no shard goes whole. A run looking the cache up meanwhile
    finds a shard gone and encodes its texts (a missing shard is damage, never a wrong vector). A
    shard whose vectors are a published result's under a second name frees nothing of the result."""
    removed = {"shards": 0, "rows": 0, "producers": 0, "orphans": 0}
    cutoff = None if older_than is None else time.time() - older_than
    for producer_key_ in [key] if key else list(cache.producers()):
        view = VectorCache(cache.store, producer_key_)
        for shard in view.shards():
            created = _timestamp(shard.meta.get("created_at"))
            if cutoff is not None and created > cutoff:
                continue
            for suffix in (".json", ".hashes.npy", ".vectors.npy"):  # the marker first
                _unlink(shard.path(suffix))
            removed["shards"] += 1
            removed["rows"] += shard.rows
        removed["orphans"] += _remove_orphans(view)
        if not view.shards():
            remove_tree(view._dir())
            removed["producers"] += 1
    return removed


def _remove_orphans(view: VectorCache) -> int:
    """Shard files with no marker, left by a writer that died, once older than ORPHAN_SECONDS
    (a live writer's files are younger: its marker follows them within the write)."""
    folder = view._dir("shards")
    files = dict(list_with_mtime(folder))
    stems = {name[: -len(".json")] for name in files if name.endswith(".json")}
    orphans = [
        name
        for name, mtime in files.items()
        if name.endswith(".npy")
        and name.split(".", 1)[0] not in stems
        and mtime < time.time() - ORPHAN_SECONDS
    ]
    for name in orphans:
        _unlink(folder / name)
    return len(orphans)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _timestamp(text: Any) -> float:
    try:
        return datetime.fromisoformat(str(text)).timestamp()
    except ValueError:
        return 0.0
