"""What a chunk spec may name on this worker: its store, its model, and whether that model's own
code may run.

The function allow-list (``jobs.queue.allowlist``) stops a job from calling anything but ``embed_chunk``;
this stops a legitimate function from being pointed elsewhere: at another store (reading or
overwriting files outside the worker's runs) or at a model the operator never chose (loading
weights from a path the attacker wrote). Run ids are validated by ``ChunkSpec`` itself, so
paths stay under ``<store>/runs/<run>/``.
"""

from __future__ import annotations

from chunkq.jobs.compute.runtime import WorkerContext
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.specs import ChunkSpec
from chunkq.jobs.contract.storage import open_store

ANY_MODEL = "*"


def check_spec(chunk: ChunkSpec, ctx: WorkerContext) -> None:
    """Raise ConfigError unless ``chunk`` names this worker's store and one of its models."""
    if ctx.store is not None and str(open_store(chunk.store)) != ctx.store:
        raise ConfigError(
            f"chunk {chunk.job_id} names store {chunk.store!r}; this worker serves only {ctx.store!r}"
        )
    if ctx.models is not None and ANY_MODEL not in ctx.models and chunk.model not in ctx.models:
        raise ConfigError(
            f"chunk {chunk.job_id} asks for model {chunk.model!r}, which this worker may not load "
            f"(allowed: {', '.join(sorted(ctx.models))}); start the pool with --allow-model {chunk.model}"
        )
    if chunk.options.trust_remote_code and ctx.models is not None and not ctx.remote_code:
        raise ConfigError(
            f"chunk {chunk.job_id} asks to run model {chunk.model!r} with its own code "
            "(trust_remote_code), which this worker does not allow: a job's options come through Redis, "
            "so only the pool's operator can allow that (chunkq pool --trust-remote-code, or "
            "CHUNKQ_TRUST_REMOTE_CODE=1)"
        )
