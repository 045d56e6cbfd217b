"""The vector cache a new run reads: found for its model and options (refused where the model's own
code behaves otherwise than when the cache was filled), and what the run took from it, recorded."""

from __future__ import annotations

import logging
from typing import Any

from chunkq.jobs.compute.vector_cache import VectorCache, producer, producer_key
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.supervisor.submit.identity import SubmitRequest

log = logging.getLogger(__name__)


def vector_cache(
    req: SubmitRequest, identity: str | None, canary: list[list[float]] | None = None
) -> tuple[VectorCache | None, dict[str, Any] | None]:
    """The store's cache for this run's model and options, and what they are; (None, None) when the
    model's files are not on this host, so its identity cannot be known (duplicates are still
    encoded once)."""
    if identity is None:
        log.warning("model %s: its files are not on this host; the vector cache is not used", req.model)
        return None, None
    described = producer(req.model, identity, req.encode)
    cache = VectorCache(req.store, producer_key(described))
    if canary is not None:
        moved = cache.check_canary(canary)  # a model that brings its own code: what it does now
        if moved is not None:
            raise ConfigError(
                f"model {req.model}: its code behaves differently than when the store's vector cache "
                f"was filled from these files and options (its vectors of chunkq's canary texts moved "
                f"by up to {moved:.3g}), a change chunkq cannot see in the files it lists (an "
                "environment variable, a file its native code reads); give --no-cache to encode every "
                "row, and `chunkq cache clean --producer KEY` drops what the cache holds of it"
            )
    return cache, described


def record_cache_use(layout: RunLayout, manifest: RunManifest) -> None:
    """What the run took from the cache, for ``chunkq cache`` (once the run exists: a failed submit
    leaves no trace in the store)."""
    plan = manifest.plan or {}
    if not plan.get("producer"):
        return
    try:
        VectorCache(layout.store, str(plan["producer"])).record_use(
            manifest.run_id,
            rows=int(plan["corpus_rows"]),
            distinct=int(plan["distinct_rows"]),
            hits=int(plan["cached_rows"]),
            damaged=int(plan["cache_damaged_rows"]),
        )
    except OSError as exc:  # derived data: a cache that cannot be written costs time, not the run
        log.warning("the vector cache cannot be written (%s); the run goes on without adding to it", exc)
