"""Issue 45.2: a pool started without `--allow-model` quarantined every chunk of a non-bundled model;
after the pool was restarted with it, `chunkq supervise RUN` exited 1 at once with the same list and
only a second `chunkq submit` (said nowhere) requeued them. A new supervisor now gives chunks
quarantined for a reason the operator can fix new attempts, and the quarantine says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from chunkq.jobs.contract.run_files import RunLayout
from chunkq.queue_worker.exit_codes import EXIT_CHUNKS_FAILED
from chunkq.supervisor.store.attempts import failed_attempts
from tests.helpers import make_texts, max_abs_diff, result_of, run_cli, start_cli, stop_tree, write_corpus
from tests.tiny_models import bundled_copy


@pytest.mark.slow
def test_a_chunk_quarantined_for_a_fixed_cause_is_tried_again_by_the_next_supervisor(
    tmp_path: Path, redis_url: str, connection: redis.Redis, reference_model: Any
) -> None:
    model = bundled_copy(tmp_path / "model")
    ids, texts = make_texts(30, seed=52)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_STORE": str(store), "CHUNKQ_QUEUE": "fixable"}
    submitted = run_cli("submit", str(corpus), "--model", str(model), "--chunk-size", "10", **env)
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.strip()
    pool = start_cli(tmp_path / "pool.log", "pool", "--gpus", "none", **env)  # the bundled model only
    try:
        refused = run_cli("supervise", run_id, "--poll", "0.2", **env, timeout=180)
    finally:
        stop_tree(pool)
    assert refused.returncode == EXIT_CHUNKS_FAILED, refused.stderr[-3000:]
    assert "3 chunk(s) quarantined:" in refused.stderr and "which this worker may not load" in refused.stderr
    assert f"then `chunkq supervise {run_id}` or the same `chunkq run` command" in refused.stderr
    # Refused before it began encoding, each attempt is still the refusing worker's (it was '?').
    refusals = failed_attempts(RunLayout(store, run_id))
    assert len(refusals) >= 3 and all("?" not in (a.worker, a.host, a.device) for a in refusals), refusals
    pool = start_cli(tmp_path / "pool2.log", "pool", "--gpus", "none", "--allow-model", str(model), **env)
    try:
        done = run_cli("supervise", run_id, "--poll", "0.2", **env, timeout=240)
    finally:
        stop_tree(pool)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "chunk(s) [0, 1, 2] were quarantined by an earlier supervisor" in done.stderr
    got, got_ids = result_of(RunLayout(store, run_id))
    assert got_ids == ids and max_abs_diff(got, reference_model.encode(texts)) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("cut", ["pool SIGKILL", "worker SIGKILL", "worker SIGSTOP"])
def test_a_chunk_cut_off_after_its_quarantine_was_lifted_is_retried_not_quarantined_again(
    tmp_path: Path, redis_url: str, connection: redis.Redis, reference_model: Any, cut: str
) -> None:
    """Issue 53.1, the sequence as it was seen: quarantined (config), new attempts from the next
    supervisor, then the attempt in hand cut off (the pool killed, or its worker): the chunk was
    quarantined with the earlier attempt's config error, and the kill was counted as that class. Its
    fate now follows its latest attempt, each attempt keeps its own record, and the cut is abandoned."""
    import json
    import signal

    import psutil

    from chunkq.supervisor.store.attempts import by_class
    from tests.helpers import wait_for, worker_processes

    model = bundled_copy(tmp_path / "model")
    ids, texts = make_texts(30, seed=53)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    queue = f"cut-{cut.replace(' ', '-')}"
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_STORE": str(store), "CHUNKQ_QUEUE": queue}
    run_id = run_cli("submit", str(corpus), "--model", str(model), "--chunk-size", "10", **env).stdout.strip()
    layout = RunLayout(store, run_id)
    pool = start_cli(tmp_path / "pool.log", "pool", "--gpus", "none", **env)  # not allowed: config
    try:
        refused = run_cli("supervise", run_id, "--poll", "0.2", **env, timeout=180)
    finally:
        stop_tree(pool)
    assert refused.returncode == EXIT_CHUNKS_FAILED and "3 chunk(s) quarantined" in refused.stderr
    slow = json.dumps(
        [{"kind": "slow", "chunks": [1], "attempts": [2], "seconds": 120}]
    )  # the new round's first
    log = tmp_path / "pool2.log"
    allowed = ("pool", "--gpus", "none", "--allow-model", str(model))
    pool = start_cli(log, *allowed, **env, CHUNKQ_FAULTS=slow)
    # --stale-after: the SIGSTOPped worker's chunk is abandoned after 12 s of silence, not the 60 s default
    watcher = start_cli(
        tmp_path / "supervise.log", "supervise", run_id, "--poll", "0.2", "--stale-after", "12", **env
    )
    try:
        wait_for(
            lambda: "FAULT slow: this chunk takes" in log.read_text(errors="replace"), 180, "chunk 1 held"
        )
        if cut == "pool SIGKILL":
            psutil.Process(pool.pid).send_signal(signal.SIGKILL)  # its worker learns its pool is gone
        else:
            (held,) = worker_processes(pool)
            held.send_signal(signal.SIGKILL if cut == "worker SIGKILL" else signal.SIGSTOP)
        wait_for(
            lambda: any(a.chunk == 1 and a.error_class == "abandoned" for a in failed_attempts(layout)),
            150,
            "the cut attempt recorded",
        )  # fmt: skip  (SIGSTOP: a heartbeat 12 s stale)
        stop_tree(pool)
        pool = start_cli(tmp_path / "pool3.log", *allowed, **env)
        assert watcher.wait(timeout=240) == 0, (tmp_path / "supervise.log").read_text()[-3000:]
    finally:
        stop_tree(pool)
        stop_tree(watcher)
    said = (tmp_path / "supervise.log").read_text()
    assert "quarantined: config errors are not retried" not in said.split("they get new attempts")[-1]
    attempts = failed_attempts(layout)
    mine = sorted((a.attempt, a.error_class) for a in attempts if a.chunk == 1)
    assert mine == [(1, "config"), (2, "abandoned")], mine  # its own number, its own class
    if cut == "worker SIGSTOP":  # nothing died: only the silence past --stale-after says it is stuck
        (cut_off,) = [a for a in attempts if a.chunk == 1 and a.error_class == "abandoned"]
        assert "no heartbeat for over 12 s" in cut_off.error, cut_off
    assert by_class(attempts) == {"config": 3, "abandoned": 1}
    status = run_cli("status", run_id, "--json", **env)
    listed = json.loads(status.stdout)["failed_attempts"]
    assert sorted(a["error_class"] for a in listed) == ["abandoned", "config", "config", "config"]
    got, got_ids = result_of(layout)
    assert got_ids == ids and max_abs_diff(got, reference_model.encode(texts)) <= 1e-5


@pytest.mark.slow
def test_the_model_named_once_in_chunkq_model_is_the_one_a_plain_pool_loads(
    tmp_path: Path, redis_url: str, reference_model: Any
) -> None:
    """Issue 53.2: `export CHUNKQ_MODEL=...`, then a plain `chunkq submit` and `chunkq pool`: the pool
    allowed only the bundled model, and every chunk was quarantined within 2 s."""
    model = bundled_copy(tmp_path / "model")
    ids, texts = make_texts(20, seed=54)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    env = {
        "CHUNKQ_REDIS_URL": redis_url,
        "CHUNKQ_STORE": str(tmp_path / "store"),
        "CHUNKQ_QUEUE": "named-once",
        "CHUNKQ_MODEL": str(model),
    }
    run_id = run_cli("submit", str(corpus), "--chunk-size", "10", **env).stdout.strip()
    pool = start_cli(tmp_path / "pool.log", "pool", "--gpus", "none", **env)
    try:
        done = run_cli("supervise", run_id, "--poll", "0.2", **env, timeout=240)
    finally:
        stop_tree(pool)
    assert done.returncode == 0, done.stderr[-3000:] + (tmp_path / "pool.log").read_text()[-2000:]
    assert f"CHUNKQ_MODEL names the run's model, {model}" in (tmp_path / "pool.log").read_text()
    got, got_ids = result_of(RunLayout(tmp_path / "store", run_id))
    assert got_ids == ids and max_abs_diff(got, reference_model.encode(texts)) <= 1e-5


@pytest.mark.slow
def test_lifted_quarantines_are_queued_as_the_window_has_room_and_number_their_attempts_on(
    tmp_path: Path, redis_url: str, connection: redis.Redis, reference_model: Any
) -> None:
    """Issue 53.4: re-supervising queued every quarantined chunk at once, whatever --queue-window.
    Those past the window's room wait in the store; when the window queues them, their job is new
    and its attempt is numbered on from the chunk's records."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.specs import chunk_job_id
    from chunkq.jobs.queue.enqueue import job_statuses, retry_quarantined

    model = bundled_copy(tmp_path / "model")
    ids, texts = make_texts(50, seed=55)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_STORE": str(store), "CHUNKQ_QUEUE": "windowed"}
    args = ("--model", str(model), "--chunk-size", "10", "--queue-window", "2")
    run_id = run_cli("submit", str(corpus), *args, **env).stdout.strip()
    layout = RunLayout(store, run_id)
    pool = start_cli(tmp_path / "pool.log", "pool", "--gpus", "none", **env)
    try:
        refused = run_cli("supervise", run_id, "--poll", "0.2", **env, timeout=180)
    finally:
        stop_tree(pool)
    assert "5 chunk(s) quarantined" in refused.stderr, refused.stderr[-2000:]
    manifest = load_manifest(layout)
    assert retry_quarantined(connection, layout, manifest, room=2) == [0, 1, 2, 3, 4]
    statuses = job_statuses(connection, [chunk_job_id(run_id, i) for i in range(5)])
    assert statuses == ["queued", "queued", None, None, None], statuses
    assert Queue(manifest.queue, connection=connection, serializer=JSONSerializer).count == 2
    pool = start_cli(tmp_path / "pool2.log", "pool", "--gpus", "none", "--allow-model", str(model), **env)
    try:
        done = run_cli("supervise", run_id, "--poll", "0.2", **env, timeout=240)
    finally:
        stop_tree(pool)
    assert done.returncode == 0, done.stderr[-3000:]
    got, got_ids = result_of(layout)
    assert got_ids == ids and max_abs_diff(got, reference_model.encode(texts)) <= 1e-5
    assert sorted((a.chunk, a.attempt) for a in failed_attempts(layout)) == [(i, 1) for i in range(5)]
