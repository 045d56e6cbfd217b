"""The store on an object store (s3://), where nothing can be renamed atomically.

The server is moto's S3 server, a real HTTP server on a loopback port started from the binary that
the dev dependencies install; chunkq talks to it through s3fs exactly as it would to S3.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from chunkq.jobs.contract.chunk_output import verify_output
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout, save_npy_atomic, write_output
from chunkq.jobs.contract.storage import open_store
from tests.helpers import make_texts, max_abs_diff, result_of, run_cli, run_in_process, wait_for, write_corpus

# Real pools, workers and CLI runs as subprocesses: the slow tier.
pytestmark = pytest.mark.slow

pytest.importorskip("s3fs")
BUCKET = "chunkq-test"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """A moto S3 server with one bucket; the environment that points fsspec at it."""
    binary = Path(sys.executable).parent / "moto_server"
    if not binary.exists():
        pytest.skip("moto_server is not installed (pip install -e '.[dev]')")
    port = _free_port()
    quiet = subprocess.DEVNULL
    proc = subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port)], stdout=quiet, stderr=quiet)
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "chunkq-test",
        "AWS_SECRET_ACCESS_KEY": "chunkq-test",  # moto accepts any key
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    # fsspec keeps one filesystem per set of arguments in the process: one made for an earlier
    # instance of this fixture (xdist can run the module's tests in two stretches) would still
    # point at that fixture's server, now gone (seen at load 10, issue 37.1: connection refused).
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        wait_for(lambda: _listening(port), 120, "the moto S3 server to listen")  # its imports, at load 10
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        proc.terminate()
        proc.wait(timeout=30)
        s3fs.S3FileSystem.clear_instance_cache()


def test_a_sharded_ragged_result_goes_to_the_object_store_and_reads_back_whole(
    s3_env: dict[str, str], tmp_path: Path
) -> None:
    """A sparse result in shards on S3 (each uploaded when whole) reads back equal to the same run
    published as one block on disk; assembled again as one block, its shard folder goes."""
    from chunkq.api import RunResult
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.supervisor.result.assemble import assemble
    from chunkq.supervisor.result.reader import check_published
    from tests.helpers import write_ragged_run

    local = write_ragged_run(tmp_path / "store", "sparse")
    remote = write_ragged_run(open_store(f"s3://{BUCKET}/ragged-{time.time_ns()}"), "sparse")
    assemble(Run.of(local))
    made = assemble(Run.of(remote), shard_bytes=4096, keep_outputs=True)  # assembled again below
    assert len(made["ragged"]["shards"]) > 2
    assert check_published(remote, load_manifest(remote)) == []
    one, many = (RunResult(x.run_id, x.store, 200, 1000, 0.0, 1, None).ragged() for x in (local, remote))
    assert np.array_equal(one.offsets, many.offsets)
    assert np.array_equal(one.arrays["indices"], many.arrays["indices"])
    assert np.array_equal(one.arrays["values"], many.arrays["values"])
    (remote.result / "manifest.json").write_text("{")
    assemble(Run.of(remote))
    names = {p.name for p in remote.result.iterdir()}
    assert names == {"offsets.npy", "indices.npy", "values.npy", "ids.jsonl", "manifest.json"}, names


def _names(layout: RunLayout) -> set[str]:
    return {p.name for p in layout.outputs.iterdir()}


def test_a_chunk_output_counts_only_once_its_metadata_is_uploaded(s3_env: dict[str, str]) -> None:
    layout = RunLayout(f"s3://{BUCKET}/unit-{time.time_ns()}", "r1")
    assert type(layout.store).__name__ == "S3Path"
    embeddings = np.random.default_rng(0).standard_normal((7, 4)).astype(np.float32)

    save_npy_atomic(layout.output_npy(0), embeddings)  # a worker that died between the two uploads
    assert layout.done_chunks() == set()
    assert verify_output(layout, 0, 7) == (None, "output metadata missing")

    write_output(layout, 0, embeddings, {"run_id": "r1", "chunk": 0})
    assert layout.done_chunks() == {0}
    meta, why = verify_output(layout, 0, 7)
    assert why == "" and meta is not None and meta["rows"] == 7
    ((index, committed),) = list(layout.committed_outputs())
    assert index == 0 and abs(committed - time.time()) < 120
    assert _names(layout) == {"000000.npy", "000000.json"}  # no temporary objects left behind

    # A corrupted object is caught by the checksum, as on a filesystem.
    layout.output_npy(0).write_bytes(layout.output_npy(0).read_bytes()[:-4] + b"\0\0\0\0")
    assert verify_output(layout, 0, 7)[1] == "000000.npy checksum does not match its metadata"


def test_an_unknown_protocol_is_refused_clearly() -> None:
    with pytest.raises(Exception, match=r"no filesystem for nosuch://"):
        open_store("nosuch://bucket/prefix")


@pytest.mark.timeout(900)  # a dozen commands, each starting Python and torch: past 300 s at load 15
def test_run_end_to_end_on_s3(s3_env: dict[str, str], tmp_path: Path, reference_model: Any) -> None:
    ids, texts = make_texts(120, seed=7)
    corpus = write_corpus(tmp_path / "corpus.jsonl", ids, texts, "jsonl")
    store = f"s3://{BUCKET}/e2e-{time.time_ns()}"
    args = ("run", str(corpus), "--chunk-size", "30", "--max-jobs", "2", "--store", store)
    args += ("--run-id", "s3run")
    env = {**s3_env, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    first = run_cli(*args, cwd=tmp_path, timeout=600, **env)
    assert first.returncode == 0, first.stderr[-3000:]

    layout = RunLayout(store, "s3run")
    matrix = np.load(io.BytesIO((layout.result / "embeddings.npy").read_bytes()), allow_pickle=False)
    assert max_abs_diff(matrix, reference_model.encode(texts)) <= 1e-5
    assert [json.loads(x) for x in (layout.result / "ids.jsonl").read_text().splitlines()] == ids
    result = json.loads((layout.result / "manifest.json").read_text())
    assert result["complete"] and result["rows"] == 120
    assert layout.done_chunks() == {0, 1, 2, 3}
    # Nothing that must stay local went to the bucket, nor into the working directory.
    assert not (tmp_path / "chunkq-store").exists()
    assert list((tmp_path / "cache" / "chunkq").glob("*/redis/appendonlydir"))

    again = run_cli(*args, cwd=tmp_path, **env)
    assert again.returncode == 0 and "already complete" in again.stdout, again.stderr[-3000:]

    # The store is the record on an object store too: list, look, export and free its outputs.
    (listed,) = json.loads(run_cli("runs", "--store", store, "--json", **env).stdout)
    assert (listed["run_id"], listed["state"], listed["rows_done"]) == ("s3run", "published", 120)
    assert listed["bytes"] > matrix.nbytes
    status = json.loads(run_cli("status", "s3run", "--store", store, "--json", **env).stdout)
    assert status["chunks_done"] == 4 and status["rows_per_second"] > 0
    out = tmp_path / "s3run.parquet"
    exported = run_cli("export", "s3run", "--store", store, "--out", str(out), **env)
    assert exported.returncode == 0, exported.stderr
    assert pq.read_table(out).column("id").to_pylist() == ids
    freed = run_cli("clean", "s3run", "--store", store, "--outputs-only", **env)
    assert freed.returncode == 0, freed.stderr
    assert not [p for p in layout.outputs.iterdir() if p.name.endswith(".npy")]
    assert run_cli(*args, cwd=tmp_path, **env).returncode == 0  # the published result still stands


def test_a_corpus_in_the_object_store_runs_as_the_same_corpus_on_disk(
    s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 22.4: `chunkq run s3://bucket/corpus/*.parquet` reads the corpus where it is, streaming,
    with the same checks and fingerprint as the same files on disk, and the same result."""
    import s3fs

    ids, texts = make_texts(40, seed=8)
    local = tmp_path / "corpus"
    local.mkdir()
    write_corpus(local / "a.parquet", ids[:25], texts[:25], "parquet")
    write_corpus(local / "b.parquet", ids[25:], texts[25:], "parquet")
    prefix = f"{BUCKET}/corpus-{time.time_ns()}"
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    for name in ("a.parquet", "b.parquet"):
        fs.put_file(str(local / name), f"{prefix}/{name}")
    env = {**s3_env, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    results = {}
    for where, pattern in (("disk", str(local / "*.parquet")), ("s3", f"s3://{prefix}/*.parquet")):
        store = tmp_path / f"store-{where}"
        done = run_cli("run", pattern, "--chunk-size", "10", "--store", str(store), **env)
        assert done.returncode == 0, done.stderr[-3000:]
        (run_dir,) = (store / "runs").iterdir()
        manifest = json.loads((run_dir / "manifest.json").read_text())
        results[where] = (
            run_dir.name,
            manifest["fingerprint"],
            (run_dir / "result" / "embeddings.npy").read_bytes(),
        )
        if where == "s3":
            assert [i["path"] for i in manifest["inputs"]] == [
                f"s3://{prefix}/a.parquet",
                f"s3://{prefix}/b.parquet",
            ]
            ids_out = [json.loads(x) for x in (run_dir / "result" / "ids.jsonl").read_text().splitlines()]
            assert ids_out == ids
    assert results["s3"] == results["disk"]  # same run id, fingerprint and bytes

    missing = run_cli("run", f"s3://{prefix}/*.jsonl", "--store", str(tmp_path / "s"), **env)
    assert missing.returncode == 3 and "no file matches this pattern" in missing.stderr


def test_a_sharded_result_goes_to_the_object_store_a_shard_at_a_time(
    s3_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22.3: each shard is uploaded as soon as it is whole, so local scratch never holds more
    than one; the manifest, uploaded last, names the shard folder; a later assembly removes what its
    manifest no longer names."""
    import tempfile

    from chunkq.api import RunResult
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import load_npy
    from chunkq.supervisor.result import reader as result_module
    from chunkq.supervisor.result import writer
    from chunkq.supervisor.result.assemble import assemble
    from tests.helpers import write_encoded_run

    dim, shard_rows = 16, 300
    store = open_store(f"s3://{BUCKET}/shards-{time.time_ns()}")
    layout = write_encoded_run(store, "big", rows=2000, chunk_size=128, dim=dim)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    held: list[int] = []
    upload = writer.publish_file

    def measured(local: Path, remote: Any) -> None:
        held.append(sum(p.stat().st_size for p in scratch.rglob("*") if p.is_file()))
        upload(local, remote)

    monkeypatch.setattr(writer, "publish_file", measured)
    made = assemble(
        Run.of(layout), shard_bytes=shard_rows * dim * 4, keep_outputs=True
    )  # read and assembled again

    assert [s["rows"] for s in made["shards"]] == [300] * 6 + [200]
    one_shard = shard_rows * dim * 4 + 128 + shard_rows * len('"r1999"\n')  # array, header, ids
    assert len(held) == 2 * 7 + 1 and max(held) <= one_shard, (max(held), one_shard)
    manifest = load_manifest(layout)
    assert result_module.check_published(layout, manifest) == []
    whole = np.concatenate([load_npy(layout.output_npy(i)) for i in range(manifest.chunks)])
    view = RunResult(layout.run_id, store, 2000, dim, 0.0, 1, None).embeddings()
    assert np.array_equal(np.asarray(view), whole) and np.array_equal(
        view[[1999, 5, 600]], whole[[1999, 5, 600]]
    )

    # Assembled again (a damaged manifest), then as one file: nothing the new manifest does not name stays.
    (layout.result / "manifest.json").write_text("{")
    again = assemble(Run.of(layout), shard_bytes=shard_rows * dim * 4, keep_outputs=True)
    folders = {p.name for p in layout.result.iterdir() if p.is_dir()}
    assert folders == {again["shard_dir"]} != {made["shard_dir"]}
    (layout.result / "manifest.json").write_text("{")
    single = assemble(Run.of(layout))
    assert "shards" not in single and result_module.check_published(layout, manifest) == []
    assert {p.name for p in layout.result.iterdir()} == {"embeddings.npy", "ids.jsonl", "manifest.json"}


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "csv", "parquet"])
def test_every_corpus_format_reads_from_the_object_store_as_from_disk(
    s3_env: dict[str, str], tmp_path: Path, fmt: str
) -> None:
    """Issue 37.9: `chunkq run s3://bucket/c.jsonl` died with `readline() takes 1 positional argument`
    (fsspec's buffered files take no size); only Parquet had been tried."""
    import s3fs

    from chunkq.supervisor.corpus.records import CorpusOptions, read_corpus

    ids, texts = make_texts(30, seed=9)
    local = write_corpus(tmp_path / f"c.{fmt}", ids, texts, fmt)
    remote = f"{BUCKET}/formats-{time.time_ns()}/c.{fmt}"
    s3fs.S3FileSystem(skip_instance_cache=True).put_file(str(local), remote)
    options = CorpusOptions(fmt)
    on_disk = [(r.id, r.text) for r in read_corpus(local, options)]
    from_s3 = [(r.id, r.text) for r in read_corpus(open_store(f"s3://{remote}"), options)]
    assert from_s3 == on_disk and len(on_disk) == 30


def test_an_unreachable_store_or_a_missing_bucket_is_one_line_and_a_documented_code(
    s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 37.10: object-store failures were exit 70, "a bug in chunkq"."""
    corpus = write_corpus(tmp_path / "c.jsonl", ["1"], ["a text"], "jsonl")
    env = {**s3_env, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    closed = {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_free_port()}", "AWS_MAX_ATTEMPTS": "1"}
    unreachable = run_cli("run", str(corpus), "--store", f"s3://{BUCKET}/x", **closed)
    assert unreachable.returncode == 11, unreachable.stderr[-2000:]
    assert "the object store could not be reached or refused the request: EndpointConnectionError" in (
        unreachable.stderr
    )
    missing = run_cli("run", str(corpus), "--store", "s3://no-such-bucket-here/x", **env)
    assert missing.returncode in (6, 11), missing.stderr[-2000:]
    for done in (unreachable, missing):
        assert "internal error" not in done.stderr and "Traceback" not in done.stderr


def test_the_vector_cache_on_an_object_store(
    s3_env: dict[str, str], tmp_path: Path, connection: Any, reference_model: Any
) -> None:
    """Issue 32: the cache's shards are objects; a look-up reads their hashes, a hit its vectors'
    blocks by range; a tampered object is set aside and its texts encoded again."""
    from chunkq.jobs.compute.vector_cache import VectorCache

    store = open_store(f"s3://{BUCKET}/cache-{time.time_ns()}")
    ids, texts = make_texts(40, seed=11)
    run_in_process(tmp_path, store, connection, ids, texts, "v1")
    v2_texts = [*texts[:-1], texts[-1] + " changed", "an added text", texts[0]]  # 1 changed, 1 added, 1 copy
    v2_ids = [*ids, "new", "again"]
    layout, manifest, encoded = run_in_process(tmp_path, store, connection, v2_ids, v2_texts, "v2")
    assert encoded == 2 and manifest.plan["cached_rows"] == 39 and manifest.plan["duplicate_rows"] == 1
    matrix, got = result_of(layout)
    assert got == v2_ids and max_abs_diff(matrix, reference_model.encode(v2_texts)) <= 1e-5

    cache = VectorCache(store, manifest.plan["producer"])
    first = cache.shards()[0]
    vectors = first.path(".vectors.npy")
    vectors.write_bytes(vectors.read_bytes()[:-4] + np.float32(0.25).tobytes())
    layout, manifest, encoded = run_in_process(
        tmp_path, store, connection, v2_ids, v2_texts, "v2", chunk_size=9
    )
    assert manifest.plan["cache_damaged_rows"] > 0 and encoded == manifest.plan["cache_damaged_rows"]
    assert first.name not in {s.name for s in cache.shards()}
    assert max_abs_diff(result_of(layout)[0], reference_model.encode(v2_texts)) <= 1e-5


def test_the_users_cache_folder_is_absolute_or_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative XDG_CACHE_HOME is ignored (the XDG spec); a user with no home folder (a container
    under an arbitrary uid) has no cache, said in one line, rather than one made in the working
    directory (Python 3.11 left "~" as it was, 3.12 raises)."""
    from chunkq.jobs.contract.storage import user_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert user_cache_dir() == tmp_path / "cache" / "chunkq"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "chunkq"
    monkeypatch.setenv("HOME", "relative-home")
    with pytest.raises(ConfigError, match="no folder for this host's cache"):
        user_cache_dir()
