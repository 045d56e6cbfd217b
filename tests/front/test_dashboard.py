"""``chunkq dashboard``: served for real (waitress, a real Valkey), probed over HTTP and in a real browser."""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from chunkq.jobs.contract.run_files import RunLayout
from chunkq.jobs.contract.specs import chunk_job_id
from chunkq.jobs.queue.nopickle import PickleRefusedError, forbid_pickle
from chunkq.supervisor.server.embedded_redis import free_port
from chunkq.tools.dashboard import check_bind, create_app, is_loopback
from tests.helpers import WORKER, cli_env, make_texts, run_cli, start_cli, stop_tree, wait_for, write_corpus
from tests.whole.test_security import Exploit

REGISTRIES = ("queued", "failed", "finished", "started", "deferred", "scheduled", "canceled")


def _get(
    url: str, auth: tuple[str, str] | None = None, method: str = "GET", **headers: str
) -> tuple[int, bytes]:
    request = urllib.request.Request(url, method=method, headers=headers)  # noqa: S310 - loopback test server
    if auth:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - loopback test server
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@contextmanager
def dashboard(tmp_path: Path, redis_url: str, *args: str, **env: str) -> Iterator[str]:
    port = free_port()
    proc = start_cli(
        tmp_path / "dashboard.log", "dashboard", "--port", str(port), *args, CHUNKQ_REDIS_URL=redis_url, **env
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, (tmp_path / "dashboard.log").read_text()
        try:
            return _get(base + "/favicon.ico")[0] in (200, 401)
        except OSError:
            return False

    try:
        wait_for(up, 60, "the dashboard to answer")
        yield base
    finally:
        stop_tree(proc)


def test_bind_rules() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")
    check_bind("127.0.0.1", None, None)
    check_bind("0.0.0.0", "ops", "s3cret")
    with pytest.raises(Exception, match="without authentication"):
        check_bind("0.0.0.0", None, None)
    with pytest.raises(Exception, match="both --username and --password"):
        check_bind("127.0.0.1", "ops", None)


def test_cli_refuses_a_public_bind_without_credentials(redis_url: str) -> None:
    result = run_cli("dashboard", "--bind", "0.0.0.0", CHUNKQ_REDIS_URL=redis_url, timeout=60)
    assert result.returncode != 0
    assert "refusing to serve the dashboard on 0.0.0.0 without authentication" in result.stderr


def _plant_pickles(connection: redis.Redis, marker: Path) -> None:
    """Pickle payloads everywhere rq-dashboard might read them: job data, meta, result, a worker's job."""
    payload = pickle.dumps(Exploit(marker))
    now = "2026-11-22T00:00:00.000000Z"
    connection.hset(
        "rq:job:evil-job",
        mapping={
            "status": "failed",
            "origin": "evil",
            "created_at": now,
            "enqueued_at": now,
            "description": "evil",
            "data": zlib.compress(payload),
            "meta": payload,
        },
    )
    connection.xadd(
        "rq:results:evil-job", {"type": "1", "created_at": now, "return_value": base64.b64encode(payload)}
    )
    connection.sadd("rq:queues", "rq:queue:evil")
    connection.rpush("rq:queue:evil", "evil-job")
    connection.zadd("rq:failed:evil", {"evil-job": time.time() + 3600})
    connection.zadd("rq:finished:evil", {"evil-job": time.time() + 3600})
    connection.sadd("rq:workers", "rq:worker:evil-worker")
    connection.sadd("rq:workers:evil", "rq:worker:evil-worker")
    connection.hset(
        "rq:worker:evil-worker",
        mapping={
            "birth": now,
            "last_heartbeat": now,
            "queues": "evil",
            "pid": "1",
            "hostname": "h",
            "state": "busy",
            "current_job": "evil-job",
            "current_job_working_time": "0",
        },
    )
    connection.expire("rq:worker:evil-worker", 600)
    # RQ 3 finds a worker's current job through its execution index.
    connection.sadd("rq:worker:evil-worker:executions", "evil-job:exec1")
    stamp = str(time.time())
    connection.hset(
        "rq:execution:evil-job:exec1",
        mapping={
            "id": "exec1",
            "job_id": "evil-job",
            "created_at": stamp,
            "last_heartbeat": stamp,
            "worker_name": "evil-worker",
        },
    )


def test_the_planted_worker_reaches_rqs_pickle_loader(tmp_path: Path, connection: redis.Redis) -> None:
    """Control: stock RQ, called as rq-dashboard 0.9 calls it, would unpickle the planted job."""
    from rq import Worker

    marker = tmp_path / "pwned"
    _plant_pickles(connection, marker)
    forbid_pickle()
    (worker,) = [w for w in Worker.all(connection=connection) if w.name == "evil-worker"]
    job = worker.get_current_job()
    assert job is not None and job.id == "evil-job"
    with pytest.raises(Exception) as raised:
        job.get_call_string()
    assert isinstance(raised.value.__cause__ or raised.value, PickleRefusedError)
    assert not marker.exists()


def test_no_endpoint_unpickles_what_is_in_redis(
    tmp_path: Path, connection: redis.Redis, redis_url: str
) -> None:
    marker = tmp_path / "pwned"
    _plant_pickles(connection, marker)
    with dashboard(tmp_path, redis_url) as base:
        urls = [
            f"{base}/0/data/queues.json",
            f"{base}/0/data/workers.json",
            f"{base}/0/data/job/evil-job.json",
        ]
        urls += [f"{base}/0/data/jobs/evil/{registry}/10/asc/1.json" for registry in REGISTRIES]
        urls += [
            f"{base}/0/view/workers",
            f"{base}/0/view/job/evil-job",
            f"{base}/0/view/jobs/evil/failed/10/asc/1",
        ]
        statuses = {url: _get(url)[0] for url in urls}
        workers_status, workers_body = _get(f"{base}/0/data/workers.json")
    assert not marker.exists(), "the dashboard unpickled a payload from Redis"
    # Where a planted pickle is what the endpoint reads, it says so (422); nothing fails with a 500.
    unreadable = {"/0/data/job/evil-job.json"} | {
        f"/0/data/jobs/evil/{r}/10/asc/1.json" for r in ("queued", "failed", "finished")
    }
    expected = {url: 422 if url.removeprefix(base) in unreadable else 200 for url in urls}
    assert statuses == expected
    assert workers_status == 200, workers_body
    (evil,) = [w for w in json.loads(workers_body)["workers"] if w["name"] == "evil-worker"]
    assert evil["current_job"].startswith("unreadable job")
    log = (tmp_path / "dashboard.log").read_text()
    assert "refused to unpickle" in log or "DeserializationError" in log or "UnicodeDecodeError" in log


def test_credentials_and_cross_origin_posts(tmp_path: Path, connection: redis.Redis, redis_url: str) -> None:
    with dashboard(
        tmp_path,
        redis_url,
        CHUNKQ_DASHBOARD_USERNAME="ops",
        CHUNKQ_DASHBOARD_PASSWORD="s3cret",  # noqa: S106
    ) as base:
        assert _get(f"{base}/0/data/queues.json")[0] == 401
        assert _get(f"{base}/0/data/queues.json", auth=("ops", "wrong"))[0] == 401
        assert _get(f"{base}/static/css/bootstrap.css")[0] == 401  # static files too
        status, body = _get(f"{base}/0/data/queues.json", auth=("ops", "s3cret"))
        assert status == 200 and "queues" in json.loads(body)
        # A page of another site cannot make the browser requeue or delete.
        foreign = _get(
            f"{base}/requeue/t", auth=("ops", "s3cret"), method="POST", Origin="http://evil.example"
        )
        assert foreign[0] == 403
        own = _get(f"{base}/requeue/t", auth=("ops", "s3cret"), method="POST", Origin=base)
        assert own[0] == 200


def test_only_a_same_origin_post_changes_state_and_only_our_host_is_answered(
    tmp_path: Path, connection: redis.Redis, redis_url: str
) -> None:
    """rq-dashboard requeues on ``GET /requeue/<queue>``: a link or an image on any page could."""
    from rq import Queue
    from rq.registry import FailedJobRegistry
    from rq.serializers import JSONSerializer

    queue = Queue("xs", connection=connection, serializer=JSONSerializer)
    job = queue.enqueue("chunkq.jobs.embed.embed_chunk", {})
    queue.remove(job.id)
    failed = FailedJobRegistry(queue=queue)
    failed.add(job, exc_string="quarantined on purpose")
    assert failed.get_job_ids() == [job.id]
    with dashboard(tmp_path, redis_url) as base:
        port = base.rsplit(":", 1)[1]
        for method, headers in (
            ("GET", {"Origin": "http://evil.example"}),
            ("GET", {}),  # a plain link or <img src>: no Origin at all
            ("POST", {"Origin": "http://evil.example"}),
            ("POST", {}),
        ):
            status, _ = _get(f"{base}/requeue/xs", method=method, **headers)
            assert status in (403, 405), (method, headers, status)
            assert failed.get_job_ids() == [job.id], (method, headers)
        # DNS rebinding: a page of evil.example whose name now points at 127.0.0.1.
        assert _get(f"{base}/0/data/queues.json", Host=f"evil.example:{port}")[0] == 403
        assert _get(f"{base}/0/data/queues.json", Host=f"localhost:{port}")[0] == 200
        status, _ = _get(f"{base}/requeue/xs", method="POST", Origin=base)
        assert status == 200 and failed.get_job_ids() == []
        # Issue 21.14: requeueing a job that is not failed (now queued), or is gone: no 500.
        status, body = _get(f"{base}/job/{job.id}/requeue", method="POST", Origin=base)
        assert status == 409 and b"Traceback" not in body, (status, body)
        assert _get(f"{base}/job/no-such-job/requeue", method="POST", Origin=base)[0] == 404


def test_sigterm_stops_the_dashboard_as_ctrl_c_does(tmp_path: Path, redis_url: str) -> None:
    port = free_port()
    log = tmp_path / "dashboard.log"
    proc = start_cli(log, "dashboard", "--port", str(port), CHUNKQ_REDIS_URL=redis_url)
    try:
        wait_for(lambda: b"dashboard on http" in log.read_bytes(), 60, "the dashboard to serve")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0  # waitress shuts down on the interrupt; killed it would be -15
    finally:
        stop_tree(proc) if proc.poll() is None else None
    assert "Traceback" not in log.read_text()


def test_strings_from_redis_reach_the_page_escaped(
    tmp_path: Path, connection: redis.Redis, redis_url: str
) -> None:
    """The job page inserts fields as raw HTML; a job planted with markup must not become markup."""
    connection.hset(
        "rq:job:xss",
        mapping={
            "status": "queued",
            "origin": "<img src=x onerror=alert(1)>",
            "created_at": "2026-11-22T00:00:00.000000Z",
            "description": "<script>alert(1)</script>",
            "data": json.dumps(["chunkq.jobs.embed.embed_chunk", None, [], {}]),
            "meta": json.dumps({"error": "<b>bold</b>"}),
        },
    )
    with dashboard(tmp_path, redis_url) as base:
        status, body = _get(f"{base}/0/data/job/xss.json")
    info = json.loads(body)
    assert status == 200, body
    assert info["description"] == "&lt;script&gt;alert(1)&lt;/script&gt;"
    assert info["origin"] == "&lt;img src=x onerror=alert(1)&gt;"
    assert "&lt;b&gt;bold&lt;/b&gt;" in info["metadata"] and "<b>" not in info["metadata"]


@pytest.mark.slow  # the model, in this process
def test_the_front_page_counts_finished_chunks_from_the_store(
    encoded_run: tuple[RunLayout, list[str], list[str]], store: Path, redis_url: str
) -> None:
    """Issue 37.7: after a run the dashboard showed 0 finished jobs (the supervisor deletes them)."""
    app = create_app(redis_url, store=store)
    page = app.test_client().get("/").get_data(as_text=True)
    assert f"the store {store} holds 5 of 5 chunks done in 1 run(s)" in page
    (encoded_run[0].outputs / "000002.json").unlink()  # one output gone: four of five done
    page = app.test_client().get("/").get_data(as_text=True)
    assert "holds 4 of 5 chunks done" in page


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _failed_chunk_run(tmp_path: Path, store: Path, redis_url: str) -> tuple[str, str]:
    """A run whose chunk 1 fails with an injected CUDA error; returns (run id, job id)."""
    ids, texts = make_texts(20, seed=5)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_STORE": str(store), "CHUNKQ_QUEUE": "dash"}
    submitted = run_cli("submit", str(corpus), "--chunk-size", "10", "--run-id", "dash-run", **env)
    assert submitted.returncode == 0, submitted.stderr
    faults = json.dumps([{"kind": "cuda_fatal", "chunks": [1]}])
    worker = subprocess.run(
        [*WORKER, "--queue", "dash", "--burst", "--store", str(store)],
        env=cli_env(CHUNKQ_REDIS_URL=redis_url, CHUNKQ_DEVICE="cpu", CHUNKQ_FAULTS=faults),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert "CUDA context broken" in worker.stderr, worker.stderr[-3000:]
    return "dash-run", chunk_job_id("dash-run", 1)


@pytest.mark.slow
def test_failed_chunk_page_in_a_real_browser(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str
) -> None:
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: make test installs Debian's chromium")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    run_id, job_id = _failed_chunk_run(tmp_path, store, redis_url)
    meta = json.loads(connection.hget(f"rq:job:{job_id}", "meta") or b"{}")
    assert meta["error_class"] == "cuda_fatal"
    screenshot = Path(os.environ.get("CHUNKQ_SCREENSHOT_DIR", tmp_path)) / "failed-chunk.png"
    with dashboard(tmp_path, redis_url, CHUNKQ_STORE=str(store)) as base:
        page = f"{base}/0/view/job/{job_id}"
        flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000"]
        dom = subprocess.run(
            [*flags, "--dump-dom", page], capture_output=True, text=True, timeout=120, check=False
        )
        shot = subprocess.run(
            [*flags, "--window-size=1280,1800", f"--screenshot={screenshot}", page],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        front = subprocess.run(
            [*flags, "--dump-dom", f"{base}/"], capture_output=True, text=True, timeout=120, check=False
        )
        # The shortcuts a user types (README) reach rq-dashboard's page of the queue's failed jobs.
        for shortcut in ("/0/view/jobs/dash.dash-run/failed", "/failed"):
            status, _ = _get(base + shortcut)
            assert status == 200, shortcut
        assert _get(base + "/no/such/page")[0] == 404
    # The front page's first line links to the failed chunks (issue 24.6).
    assert front.returncode == 0, front.stderr[-2000:]
    # Each run's chunks are in a queue of their own (jobs/queue/run_queues.py).
    link = 'href="/0/view/jobs/dash.dash-run/failed/20/asc/1">1 failed chunk(s) in queue dash.dash-run</a>'
    assert link in front.stdout
    # Finished jobs leave Redis: the page says so, with the count from the store (issue 37.7).
    assert f"the store {store} holds 1 of 2 chunks done in 1 run(s)" in front.stdout
    assert dom.returncode == 0, dom.stderr[-2000:]
    text = dom.stdout
    assert '"chunk": 1<br>' in text and '"error_class": "cuda_fatal"<br>' in text  # a line a field
    for needle in (
        f'"run_id": "{run_id}"',
        '"chunk": 1',
        '"rows": 10',
        '"attempt": 1',
        f'"worker": "{meta["worker"]}"',
        f'"host": "{meta["host"]}"',
        '"gpu": null',
        '"error_class": "cuda_fatal"',
        "CudaFatalError",
        "illegal memory access",
        "Traceback (most recent call last)",
    ):
        assert needle in text, needle
    assert shot.returncode == 0 and screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", shot.stderr[-2000:]


def test_a_port_in_use_is_a_users_error_naming_the_port_and_its_holder(tmp_path: Path) -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run_cli("dashboard", "--redis-url", "redis://127.0.0.1:1", "--port", str(port))
    assert result.returncode == 6, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"port {port} on 127.0.0.1 is in use, held by " in line and f"(pid {os.getpid()})" in line
    assert "internal error" not in line and "finished chunk" not in line
