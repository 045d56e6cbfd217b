"""The embed job as a plain function: real model, real store, no queue."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkq.jobs.contract.chunk_output import verify_output
from chunkq.jobs.contract.errors import BadInputError, ConfigError
from chunkq.jobs.contract.run_files import RunLayout, write_chunk_input
from chunkq.jobs.contract.specs import ChunkSpec, EncodeOptions
from chunkq.jobs.embed import embed_chunk
from tests.helpers import make_texts, max_abs_diff, write_test_run


def _chunk(store: Path, rows: int = 20, **options: Any) -> tuple[ChunkSpec, list[str]]:
    return write_test_run(store, "job-test", 0, rows, 11, EncodeOptions(**options))


def test_output_equals_plain_encode(store: Path, reference_model: Any) -> None:
    spec, texts = _chunk(store)
    meta = embed_chunk(spec.to_dict())
    layout = RunLayout(store, spec.run_id)
    got = np.load(layout.output_npy(0))
    assert got.dtype == np.float32 and got.shape == (20, 384)
    assert max_abs_diff(got, reference_model.encode(texts)) <= 1e-5
    assert meta["skipped"] is False
    assert {
        "rows",
        "dim",
        "dtype",
        "sha256",
        "worker",
        "host",
        "device",
        "seconds",
        "batch_size",
    } <= meta.keys()
    assert meta["rows"] == 20 and meta["device"] == "cpu" and meta["batch_size"] == 32
    assert meta["peak_rss_bytes"] >= meta["rss_bytes"] > 50 << 20  # the CPU stand-in for GPU peak memory
    assert verify_output(layout, 0, 20)[0] is not None


def test_options_normalize_and_max_seq_length(store: Path, reference_model: Any) -> None:
    spec, texts = _chunk(store, normalize_embeddings=True, max_seq_length=8, batch_size=4)
    embed_chunk(spec.to_dict())
    got = np.load(RunLayout(store, spec.run_id).output_npy(0))
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    reference_model.max_seq_length = 8
    try:
        want = reference_model.encode(texts, normalize_embeddings=True, batch_size=4)
    finally:
        reference_model.max_seq_length = 256
    assert max_abs_diff(got, want) <= 1e-5


def test_valid_output_is_not_encoded_again(store: Path) -> None:
    spec, _ = _chunk(store)
    first = embed_chunk(spec.to_dict())
    npy = RunLayout(store, spec.run_id).output_npy(0)
    mtime = npy.stat().st_mtime_ns
    again = embed_chunk(spec.to_dict())
    assert again["skipped"] is True and again["sha256"] == first["sha256"]
    assert npy.stat().st_mtime_ns == mtime


def test_corrupt_output_is_encoded_again(store: Path) -> None:
    spec, _ = _chunk(store)
    first = embed_chunk(spec.to_dict())
    npy = RunLayout(store, spec.run_id).output_npy(0)
    npy.write_bytes(npy.read_bytes()[:-8])
    again = embed_chunk(spec.to_dict())
    assert again["skipped"] is False and again["sha256"] == first["sha256"]


def test_row_count_mismatch_is_bad_input(store: Path) -> None:
    spec, _ = _chunk(store)
    ids, texts = make_texts(19, seed=11)
    write_chunk_input(RunLayout(store, spec.run_id), 0, list(zip(ids, texts, strict=True)))
    with pytest.raises(BadInputError, match="input holds 19 rows, the spec says 20"):
        embed_chunk(spec.to_dict())
    assert not RunLayout(store, spec.run_id).output_meta(0).exists()


def test_half_precision_is_refused_on_cpu(store: Path) -> None:
    spec, _ = _chunk(store, precision="fp16")
    with pytest.raises(ConfigError, match="fp16 needs a GPU"):
        embed_chunk(spec.to_dict())


def test_a_chunk_whose_redis_dies_under_it_fails_with_its_own_error(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Seen in CI: the store's disk filled, Redis died of it, and the job's write of the chunk's
    failure to Redis replaced the chunk's own error (the full disk) with a ConnectionError, chained
    under logging's traceback dump. The chunk's error is what the job raises; the lost record is
    one warning. Real rq job, real server stopped mid-job; the encode is replaced by its failure."""
    import redis
    from rq.job import Job
    from rq.serializers import JSONSerializer

    import chunkq.jobs.embed as embed
    from chunkq.supervisor.server.embedded_redis import EmbeddedRedis

    spec, _ = _chunk(store)
    server = EmbeddedRedis(tmp_path / "redis").start()

    def disk_full_after_redis_died(chunk: Any) -> dict[str, Any]:
        server.stop()
        raise OSError(28, "No space left on device", str(store / "runs" / chunk.run_id / "outputs"))

    monkeypatch.setattr(embed, "_embed", disk_full_after_redis_died)
    try:
        connection = redis.Redis.from_url(server.url, socket_connect_timeout=2)
        job = Job.create(embed_chunk, args=[spec.to_dict()], connection=connection, serializer=JSONSerializer)
        with pytest.raises(OSError, match="No space left on device") as raised:
            job.perform()
    finally:
        server.stop()
    assert not isinstance(raised.value, redis.exceptions.RedisError)
    (warning,) = [r.getMessage() for r in caplog.records if "Redis cannot record it" in r.getMessage()]
    assert "No space left on device" in warning and "Connection refused" in warning, warning
