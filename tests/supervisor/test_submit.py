"""Submit against a real Redis: chunks in the store, one JSON job per chunk, idempotent."""

from __future__ import annotations

import json
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
from rq.job import Job

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.errors import CorpusError, RunConflictError
from chunkq.jobs.contract.run_files import RunLayout, read_chunk_input, read_json
from chunkq.jobs.contract.specs import EncodeOptions, chunk_job_id
from chunkq.jobs.queue.allowlist import EMBED_CHUNK
from chunkq.jobs.queue.enqueue import chunk_queue
from chunkq.supervisor.corpus.records import CorpusOptions
from chunkq.supervisor.submit.identity import SubmitRequest
from chunkq.supervisor.submit.submission import submit
from tests.helpers import make_texts, queued, write_corpus


def _request(corpus: Path, store: Path, **kw: object) -> SubmitRequest:
    base = SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=10, queue="t")
    return replace(base, **kw)  # type: ignore[arg-type]


def test_submit_writes_chunks_manifest_and_jobs(tmp_path: Path, store: Path, connection: redis.Redis) -> None:
    ids, texts = make_texts(35)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    result = submit(_request(corpus, store), connection)
    assert (result.rows, result.chunks, result.counts.enqueued, result.created) == (35, 4, 4, True)
    layout = RunLayout(store, result.run_id)
    manifest = read_json(layout.manifest)
    assert manifest["rows"] == 35 and manifest["chunk_size"] == 10 and manifest["model"] == BUNDLED_MODEL
    assert len(manifest["corpus"]["sha256"]) == 64 and manifest["created_at"]
    assert read_chunk_input(layout, 3) == (ids[30:], texts[30:])
    queue = chunk_queue(connection, "t")
    assert queued(connection, "t") == 4
    job = Job.fetch(chunk_job_id(result.run_id, 1), connection=connection, serializer=queue.serializer)
    assert job.func_name == EMBED_CHUNK and job.timeout == 600
    assert job.args[0]["first_row"] == 10 and job.args[0]["rows"] == 10
    assert job.meta == {"run_id": result.run_id, "chunk": 1, "rows": 10, "first_row": 10, "attempt": 1}
    # The job hash holds JSON, not pickle: anyone reading Redis sees plain data.
    raw = connection.hget(job.key, "data")
    assert raw is not None
    func, _, args, _ = json.loads(zlib.decompress(raw))  # RQ zlib-compresses the serialized call
    assert func == EMBED_CHUNK and args[0]["index"] == 1


def test_resubmit_enqueues_nothing_new(tmp_path: Path, store: Path, connection: redis.Redis) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(35), "jsonl")
    first = submit(_request(corpus, store), connection)
    again = submit(_request(corpus, store), connection)
    assert again.run_id == first.run_id and not again.created
    assert (again.counts.enqueued, again.counts.in_flight) == (0, 4)
    assert queued(connection, "t") == 4


def test_lost_jobs_are_enqueued_again_on_resubmit(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(35), "jsonl")
    first = submit(_request(corpus, store), connection)
    queue = chunk_queue(connection, "t")
    Job.fetch(chunk_job_id(first.run_id, 2), connection=connection, serializer=queue.serializer).delete()
    again = submit(_request(corpus, store), connection)
    assert (again.counts.enqueued, again.counts.in_flight) == (1, 3)
    assert queued(connection, "t") == 4


def test_two_stores_sharing_one_redis_and_a_run_id_never_take_each_others_jobs(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """Issue 63.5: the second store's submit counted the first's jobs as its own ("1 already had a
    job in Redis") and requeued a failed one as its own; now refused before anything is queued."""
    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(35), "jsonl")
    first = submit(_request(corpus, store, run_id="shared"), connection)
    other_store = tmp_path / "other-store"
    with pytest.raises(
        RunConflictError, match=r"this Redis holds jobs of a run of that id from another store"
    ):
        submit(_request(corpus, other_store, run_id="shared"), connection)
    assert not (other_store / "runs" / "shared").exists()  # the refused store is as it was
    queue = chunk_queue(connection, "t")
    assert queued(connection, "t") == first.chunks
    for index in range(first.chunks):
        job = Job.fetch(chunk_job_id("shared", index), connection=connection, serializer=queue.serializer)
        assert job.args[0]["store"] == str(store)


def test_run_id_follows_corpus_and_options(tmp_path: Path, store: Path, connection: redis.Redis) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(35), "jsonl")
    a = submit(_request(corpus, store), connection).run_id
    b = submit(_request(corpus, store, chunk_size=7), connection).run_id
    c = submit(_request(corpus, store, encode=EncodeOptions(normalize_embeddings=True)), connection).run_id
    assert len({a, b, c}) == 3 and all(r.startswith("c-") for r in (a, b, c))


def test_different_options_under_a_taken_run_id_are_refused(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(35), "jsonl")
    submit(_request(corpus, store, run_id="mine"), connection)
    with pytest.raises(RunConflictError, match=r"run mine already exists .*chunk_size: stored 10, given 7"):
        submit(_request(corpus, store, run_id="mine", chunk_size=7), connection)
    other = write_corpus(tmp_path / "d.jsonl", *make_texts(35, seed=5), "jsonl")
    with pytest.raises(RunConflictError, match="corpus_sha256"):
        submit(_request(other, store, run_id="mine"), connection)
    assert queued(connection, "t") == 4


def test_bad_corpus_leaves_store_and_redis_untouched(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    ids, texts = make_texts(35)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    with open(corpus, "a") as fh:
        fh.write("{not json\n")
    with pytest.raises(CorpusError, match=r"c.jsonl:36: invalid JSON"):
        submit(_request(corpus, store, run_id="bad"), connection)
    assert not RunLayout(store, "bad").root.exists()
    assert queued(connection, "t") == 0
    corpus.write_text(
        "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids, texts, strict=True))
    )
    assert submit(_request(corpus, store, run_id="bad"), connection).counts.enqueued == 4


def test_empty_corpus_is_refused(tmp_path: Path, store: Path, connection: redis.Redis) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n")
    with pytest.raises(CorpusError, match="holds no texts"):
        submit(_request(corpus, store), connection)
    assert not (store / "runs").exists() or not any((store / "runs").iterdir())


def test_duplicate_ids_are_named_with_both_places(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    ids, texts = make_texts(35)
    ids[27] = ids[3]
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    with pytest.raises(CorpusError, match=r"c.jsonl:28: duplicate id 'doc-0-3' \(first at .*c.jsonl:4\)"):
        submit(_request(corpus, store, run_id="dup"), connection)
    assert not RunLayout(store, "dup").root.exists()
    assert queued(connection, "t") == 0


def test_a_corpus_appended_while_submit_reads_it_is_refused(
    tmp_path: Path, store: Path, connection: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 21.4: the checksum is taken in one pass and the rows copied in another; a writer that
    appends between the two must not leave a manifest whose checksum does not cover its rows."""
    from chunkq.supervisor.submit import submission as submit_module

    ids, texts = make_texts(30)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    reading = submit_module.read_inputs

    def appended_while_read(req: SubmitRequest) -> Any:
        for n, record in enumerate(reading(req)):
            if n == 5:
                with open(corpus, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps({"id": "late", "text": "appended meanwhile"}) + "\n")
            yield record

    monkeypatch.setattr(submit_module, "read_inputs", appended_while_read)
    with pytest.raises(CorpusError, match=r"c\.jsonl: the file changed while chunkq read it"):
        submit(_request(corpus, store), connection)
    assert not store.exists()  # a failed first submit leaves nothing
    monkeypatch.setattr(submit_module, "read_inputs", reading)
    again = submit(_request(corpus, store), connection)  # the file as it now is
    assert again.rows == 31


def test_submit_records_whether_the_vectors_are_unit_length(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """Issue 54.2: submit knows from the model's files whether its vectors are unit length, and
    records it for the exports (FAISS's metric) rather than leave them to read the model again."""
    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(12), "jsonl")
    recorded = {}
    for name, encode in (
        ("model's Normalize", EncodeOptions()),  # the bundled model ends in a Normalize module
        ("truncated after it", EncodeOptions(truncate_dim=64)),
        ("scaled again", EncodeOptions(truncate_dim=64, normalize_embeddings=True)),
    ):
        result = submit(_request(corpus, store, encode=encode, queue=f"q{len(recorded)}"), connection)
        recorded[name] = read_json(RunLayout(store, result.run_id).manifest)["unit_length"]
    assert recorded == {"model's Normalize": True, "truncated after it": False, "scaled again": True}


def test_another_batch_size_resumes_the_run_and_the_chunks_left_use_it(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """Issue 54.5: batch size and batch tokens say how fast, not what, so they are not the run's
    identity. The same command with another --batch-size (by default run id or under --run-id) is the
    same run; the chunks queued from then on carry the new value, a job queued before keeps its own
    and still agrees with the manifest; what the outputs record of their producer is unchanged."""
    from chunkq.jobs.contract.manifest import load_manifest

    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(35), "jsonl")
    first = submit(_request(corpus, store), connection)
    layout = RunLayout(store, first.run_id)
    producer = load_manifest(layout).producer()
    queue = chunk_queue(connection, "t")
    Job.fetch(chunk_job_id(first.run_id, 2), connection=connection, serializer=queue.serializer).delete()
    smaller = EncodeOptions(batch_size=8, batch_tokens=2048)
    again = submit(_request(corpus, store, encode=smaller), connection)
    assert (again.run_id, again.created, again.counts.enqueued, again.counts.in_flight) == (
        first.run_id,
        False,
        1,
        3,
    )
    manifest = load_manifest(layout)
    assert manifest.batching == {"batch_size": 8, "batch_tokens": 2048}
    assert (
        manifest.producer() == producer and manifest.fingerprint == read_json(layout.manifest)["fingerprint"]
    )
    specs = {
        i: Job.fetch(chunk_job_id(first.run_id, i), connection=connection, serializer=queue.serializer).args[
            0
        ]
        for i in range(4)
    }
    assert specs[2]["options"]["batch_size"] == 8 and specs[2]["options"]["batch_tokens"] == 2048
    assert specs[1]["options"]["batch_size"] == 32 and "batch_tokens" not in specs[1]["options"]
    from chunkq.jobs.contract.specs import ChunkSpec

    assert manifest.spec_mismatch(ChunkSpec.from_dict(specs[1])) == ""
    normalised = {**specs[1], "options": {**specs[1]["options"], "normalize_embeddings": True}}
    assert "normalize_embeddings" in manifest.spec_mismatch(ChunkSpec.from_dict(normalised))
    # Under a --run-id of one's own, likewise: not refused as other options.
    mine = submit(_request(corpus, store, run_id="mine"), connection)
    assert not submit(_request(corpus, store, run_id="mine", encode=smaller), connection).created
    assert mine.created


def test_a_run_resumed_with_another_priority_takes_its_turns_with_it_and_without_one_keeps_its_own(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """Issue 65.1: --priority given again to a resumed run is its priority from then on (the
    manifest, and the score its queue is listed with for the workers); left out, the run keeps the
    one it had (a resume without it put a priority-5 run back to 1)."""
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.queue.run_queues import listed

    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(35), "jsonl")
    first = submit(_request(corpus, store, priority=5), connection)
    layout = RunLayout(store, first.run_id)
    own = load_manifest(layout).queue
    assert load_manifest(layout).priority == 5 and listed(connection, "t") == [(own, 5)]
    submit(_request(corpus, store), connection)
    assert load_manifest(layout).priority == 5 and listed(connection, "t") == [(own, 5)]
    again = submit(_request(corpus, store, priority=9), connection)
    assert (again.run_id, again.created) == (first.run_id, False)
    assert load_manifest(layout).priority == 9 and listed(connection, "t") == [(own, 9)]
    other = submit(_request(write_corpus(tmp_path / "d.jsonl", *make_texts(5), "jsonl"), store), connection)
    assert load_manifest(RunLayout(store, other.run_id)).priority == 1  # a new run's default


def test_a_run_begun_with_its_batch_size_in_its_identity_is_resumed_by_the_same_command(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """A run that an earlier release began, when the batch settings were part of the identity (and
    so of the default run id), is found and resumed by the same command, not started again."""
    from chunkq.jobs.contract.run_files import atomic_write_json
    from chunkq.jobs.contract.specs import fingerprint
    from chunkq.supervisor.submit.identity import default_run_id

    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(35), "jsonl")
    req = _request(corpus, store, encode=EncodeOptions(batch_size=16), queue="old")
    now = submit(req, connection)
    # The run as the earlier release wrote it: its options whole in its identity, its id from that.
    data = read_json(RunLayout(store, now.run_id).manifest)
    identity = {**data["identity"], "options": {**data["identity"]["options"], "batch_size": 16}}
    old_id = default_run_id(corpus, fingerprint(identity))
    (store / "runs" / now.run_id).rename(store / "runs" / old_id)
    old = {**data, "run_id": old_id, "identity": identity, "fingerprint": fingerprint(identity)}
    atomic_write_json(RunLayout(store, old_id).manifest, old)
    again = submit(replace(req, queue="old2"), connection)
    assert (again.run_id, again.created) == (old_id, False)


def test_a_glob_that_reaches_into_the_store_leaves_the_store_out(tmp_path: Path) -> None:
    """Issue 63.5: `data/**/*.jsonl` with the store in data/store matched the store's own files and
    was refused for a ledger line's missing text field."""
    from chunkq.supervisor.request import expand_corpora

    data = tmp_path / "data"
    (data / "more").mkdir(parents=True)
    write_corpus(data / "a.jsonl", *make_texts(3), "jsonl")
    write_corpus(data / "more" / "b.jsonl", *make_texts(3, seed=1), "jsonl")
    store = data / "store"
    (store / "runs" / "r" / "ledger").mkdir(parents=True)
    (store / "runs" / "r" / "ledger" / "done.jsonl").write_text('{"chunk": 0}\n')
    found = expand_corpora([f"{data}/**/*.jsonl"], store)
    assert found == (data / "a.jsonl", data / "more" / "b.jsonl")
    with pytest.raises(CorpusError, match="only inside the store"):
        expand_corpora([f"{store}/**/*.jsonl"], store)
    with pytest.raises(CorpusError, match="is inside the store"):
        expand_corpora([str(store / "runs" / "r" / "ledger" / "done.jsonl")], store)


def test_a_failed_job_queued_again_by_a_resubmit_is_recorded_first(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """A run stopped before its supervisor settled a failure (a worker's own write on a full disk,
    Ctrl-C then kill -9 during the drain) left the job failed in Redis; the next submit queued it
    again without a record, and `status` said "failed attempts: 0" (the sixteenth hostile pass)."""
    from chunkq.jobs.queue.abandon import mark_abandoned
    from chunkq.jobs.queue.rq_api import JobStatus
    from chunkq.supervisor.store.attempts import failed_attempts

    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(35), "jsonl")
    first = submit(_request(corpus, store), connection)
    queue = chunk_queue(connection, "t")
    job_id = chunk_job_id(first.run_id, 2)
    Job.fetch(job_id, connection=connection, serializer=queue.serializer).set_status(JobStatus.STARTED)
    assert mark_abandoned(connection, job_id, "its worker died with the previous chunkq run")
    again = submit(_request(corpus, store), connection)
    assert (again.counts.requeued, again.counts.in_flight) == (1, 3)
    recorded = [
        (a.chunk, a.attempt, a.error_class, a.error) for a in failed_attempts(RunLayout(store, first.run_id))
    ]
    assert recorded == [(2, 1, "abandoned", "its worker died with the previous chunkq run")]
    assert Job.fetch(job_id, connection=connection, serializer=queue.serializer).get_status() == "queued"


def test_status_calls_a_failure_no_supervisor_has_settled_neither_quarantined_nor_lost(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str
) -> None:
    """The hostile pass: with no supervisor running, `status --redis-url` said "1 chunk(s)
    quarantined: ... attempt 1" for a first attempt that had only failed."""
    from chunkq.jobs.queue.abandon import mark_abandoned
    from chunkq.jobs.queue.rq_api import JobStatus
    from tests.helpers import run_cli

    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(35), "jsonl")
    first = submit(_request(corpus, store), connection)
    job_id = chunk_job_id(first.run_id, 2)
    Job.fetch(job_id, connection=connection, serializer=chunk_queue(connection, "t").serializer).set_status(
        JobStatus.STARTED
    )
    assert mark_abandoned(connection, job_id, "its worker died")
    said = run_cli("status", first.run_id, "--store", str(store), "--redis-url", redis_url)
    assert said.returncode == 0, said.stderr[-2000:]
    assert "1 chunk(s) failed, waiting for a supervisor to retry them:" in said.stdout, said.stdout
    assert f"job {job_id}, abandoned, attempt 1): its worker died" in said.stdout
    assert "quarantined:" not in said.stdout
