"""What a resumed run takes from the command that resumed it: the settings that say how fast or in
what turn, never what (its identity, and what its outputs record of their producer, stay as they
were). Each is written to the manifest, so the run's later commands see it."""

from __future__ import annotations

import logging

from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run_files import RunLayout, atomic_write_json
from chunkq.jobs.contract.specs import BATCHING, EncodeOptions

log = logging.getLogger(__name__)


def with_priority(layout: RunLayout, manifest: RunManifest, asked: int | None) -> RunManifest:
    """A run resumed with another --priority takes its turns with it from now on (its supervisor
    lists its queue with the manifest's priority at each look); without one it keeps its own."""
    if asked is None or asked == manifest.priority:
        return manifest
    log.info("run %s: resumed with --priority %d (it had %d)", manifest.run_id, asked, manifest.priority)
    data = {**manifest.data, "priority": asked}
    atomic_write_json(layout.manifest, data)
    return RunManifest(data)


def with_batching(layout: RunLayout, manifest: RunManifest, encode: EncodeOptions) -> RunManifest:
    """A run resumed with other batch settings (``specs.BATCHING``: speed, not vectors) queues its
    chunks from now on with them; the chunks done keep theirs. Recorded in the manifest apart from
    the run's options, so its identity and what its outputs record of their producer stay as they
    were."""
    asked = {name: getattr(encode, name) for name in BATCHING}
    if asked == manifest.batching:
        return manifest
    log.warning(
        "run %s: resumed with --batch-size %s and --batch-tokens %s (it had %s and %s); the chunks "
        "not yet done use them",
        manifest.run_id,
        asked["batch_size"],
        asked["batch_tokens"] or "unset",
        manifest.batching.get("batch_size"),
        manifest.batching.get("batch_tokens") or "unset",
    )
    data = {**manifest.data, "batching": asked}
    atomic_write_json(layout.manifest, data)
    return RunManifest(data)
