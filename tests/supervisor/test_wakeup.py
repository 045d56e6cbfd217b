"""The supervisor wakes when a chunk settles instead of sleeping out its poll interval.

A real Redis, a real worker and the bundled model: with a 60 s poll interval the supervisor can
only finish within the test's bound if the worker's announcements wake it.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.events import announce_settled
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.supervisor.corpus.records import CorpusOptions
from chunkq.supervisor.submit.identity import SubmitRequest
from chunkq.supervisor.submit.submission import submit
from chunkq.supervisor.watch.wakeup import Wakeup
from tests.helpers import WORKER, cli_env, make_texts, start_cli, stop_tree, write_corpus


def test_a_wait_ends_when_a_chunk_of_its_queue_settles_and_only_then(connection: redis.Redis) -> None:
    wakeup = Wakeup(connection, "wq")
    try:
        assert wakeup.wait(0.01) is False  # subscribes
        announce_settled(connection, "another-queue", "x__c000000")
        started = time.monotonic()
        assert wakeup.wait(0.5) is False
        assert time.monotonic() - started >= 0.5
        announce_settled(connection, "wq", "x__c000001")
        announce_settled(connection, "wq", "x__c000002")
        started = time.monotonic()
        assert wakeup.wait(30) is True
        assert time.monotonic() - started < 5
        assert wakeup.wait(0.2) is False  # the burst was one wake-up, not two
        assert wakeup.woken == 1
    finally:
        wakeup.close()


@pytest.mark.slow
def test_the_supervisor_finishes_as_the_last_chunk_does_not_a_poll_interval_later(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str
) -> None:
    ids, texts = make_texts(40, seed=71)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    run = submit(
        SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=20, queue="wake"),
        connection,
    )
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_QUEUE": "wake", "CHUNKQ_STORE": str(store)}
    supervisor = start_cli(tmp_path / "sup.log", "supervise", run.run_id, "--poll", "60", **env)
    worker_cmd = [*WORKER, "--queue", "wake", "--burst"]
    worker_cmd += ["--store", str(store)]
    try:
        worker = subprocess.run(
            worker_cmd,
            env=cli_env(CHUNKQ_REDIS_URL=redis_url, CHUNKQ_DEVICE="cpu"),
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert worker.returncode == 0, worker.stderr[-3000:]
        done = time.monotonic()
        assert supervisor.wait(timeout=30) == 0, (tmp_path / "sup.log").read_text()[-3000:]
        assert time.monotonic() - done < 30
    finally:
        if supervisor.poll() is None:
            stop_tree(supervisor)
    assert (RunLayout(store, run.run_id).result / "embeddings.npy").exists()
