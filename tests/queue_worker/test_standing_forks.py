"""A standing fork server (``chunkq serve-forks``): many runs fork their workers from one warm
process, each worker still fresh, each run's result its own; a pool that cannot use it says why and
starts its own; its socket is its owner's alone.

Real processes, each test with a server of its own (not the test process's, tests/warm_forks.py),
and the bundled model on the CPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from chunkq.jobs.contract.run_files import read_json
from chunkq.queue_worker.processes import standing_forks
from chunkq.queue_worker.processes.fork_client import ForkServer
from tests import warm_forks
from tests.helpers import (
    cli_env,
    make_texts,
    only_run,
    result_matches,
    run_cli,
    start_cli,
    stop_tree,
    wait_for,
    write_corpus,
)

BUNDLED_TAKEN = "took model bundled:all-MiniLM-L6-v2 from the fork server"
JOINED = "workers forked by the standing fork server at"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    path = Path(tmp_path / "f.sock")
    proc = warm_forks.start_standing_server(path, cli_env(**{warm_forks.SOCKET_ENV: ""}))
    try:
        yield proc, path
    finally:
        stop_tree(proc)


def _run(tmp_path: Path, name: str, socket_path: Path, rows: int, **env: str) -> tuple[Any, list[str], str]:
    ids, texts = make_texts(rows, seed=len(name))
    corpus = write_corpus(tmp_path / f"{name}.jsonl", ids, texts, "jsonl")
    store = tmp_path / name
    done = run_cli(
        "run", str(corpus), "--store", str(store), "--chunk-size", "10", "--max-jobs", "2",
        **{warm_forks.SOCKET_ENV: str(socket_path), **env},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return only_run(store), texts, done.stderr


@pytest.mark.slow  # real servers, pools and runs
def test_runs_fork_their_workers_from_one_standing_server(
    tmp_path: Path, server: tuple[subprocess.Popen[bytes], Path], reference_model: Any
) -> None:
    proc, path = server
    for name in ("first", "second"):
        layout, texts, said = _run(tmp_path, name, path, rows=40)
        assert result_matches(layout, texts, reference_model)
        assert JOINED in said
        # Every worker (max-jobs 2: two for four chunks at least) took the server's loaded model
        # and none loaded its own: they were forked there, and their logs reached the run's terminal.
        assert said.count(BUNDLED_TAKEN) >= 2 and "loaded model bundled" not in said, said[-3000:]
        assert "fork server loaded" not in said  # the pool started no fork server of its own
        pids = {read_json(layout.output_meta(i))["pid"] for i in range(4)}
        assert proc.pid not in pids and len(pids) >= 2  # fresh processes, not the server itself
    assert proc.poll() is None  # it serves on
    wait_for(lambda: not psutil.Process(proc.pid).children(), 30, "the runs' workers to be reaped")


@pytest.mark.slow  # real servers, pools and runs
def test_a_pool_unlike_the_server_says_why_and_forks_its_own(
    tmp_path: Path, server: tuple[subprocess.Popen[bytes], Path], reference_model: Any
) -> None:
    _proc, path = server
    # huggingface_hub reads HF_HOME as it is imported: a worker forked there would use the server's.
    layout, texts, said = _run(tmp_path, "other", path, rows=20, HF_HOME=str(tmp_path / "hf"))
    assert result_matches(layout, texts, reference_model)
    assert f"cannot use the standing fork server at {path}" in said
    assert "it imported its modules with other values of HF_HOME" in said
    assert JOINED not in said


@pytest.mark.slow  # real servers, pools and runs
def test_a_dead_standing_server_leaves_the_pool_on_its_own(
    tmp_path: Path, server: tuple[subprocess.Popen[bytes], Path], reference_model: Any
) -> None:
    proc, path = server
    ids, texts = make_texts(60, seed=5)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    slow = json.dumps([{"kind": "slow", "chunks": [0], "attempts": [1], "seconds": 4}])
    log = tmp_path / "run.log"
    run = start_cli(
        log, "run", str(corpus), "--store", str(tmp_path / "store"), "--chunk-size", "20",
        CHUNKQ_FAULTS=slow, **{warm_forks.SOCKET_ENV: str(path)},
    )  # fmt: skip
    try:
        wait_for(lambda: "FAULT slow: this chunk takes" in log.read_text(errors="replace"), 180, "chunk 0")
        proc.kill()  # its socket file stays behind, nobody listening
        assert run.wait(timeout=240) == 0, log.read_text(errors="replace")[-3000:]
    finally:
        stop_tree(run)
    text = log.read_text(errors="replace")
    # The busy worker drained (its pool lives), and the pool forked the rest from a server of its own.
    assert "cannot use the standing fork server" in text and "fork server loaded" in text, text[-3000:]
    assert result_matches(only_run(tmp_path / "store"), texts, reference_model)


@pytest.mark.slow  # real servers, pools and runs
def test_the_socket_is_its_owners_alone(tmp_path: Path, server: tuple[subprocess.Popen[bytes], Path]) -> None:
    proc, path = server
    assert path.stat().st_mode & 0o777 == 0o600
    second = run_cli("serve-forks", str(path), timeout=60, **{warm_forks.SOCKET_ENV: ""})
    assert second.returncode == 2 and "another fork server serves there" in second.stderr
    with standing_forks.connect(str(path)) as sock:  # the owner may
        assert standing_forks.peer(sock)[0] == proc.pid
    os.chmod(path, 0o660)  # opened to a group: a server someone else could have put there
    with pytest.raises(PermissionError, match="not a socket of this user's alone"):
        standing_forks.connect(str(path))
    proc.kill()
    proc.wait(timeout=30)
    # What a killed server left behind is replaced by the next one.
    again = warm_forks.start_standing_server(path, cli_env(), preload=None)
    try:
        with standing_forks.connect(str(path)) as sock:
            assert standing_forks.peer(sock)[0] == again.pid
        again.terminate()
        assert again.wait(timeout=30) == 0
    finally:
        stop_tree(again)
    assert not path.exists()  # a stopped server removes its socket


@pytest.mark.slow  # a real server and worker
def test_a_worker_forked_there_has_its_pools_directory_umask_and_output(
    tmp_path: Path,
    server: tuple[subprocess.Popen[bytes], Path],
    redis_url: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    proc, path = server
    client = ForkServer(cli_env(**{warm_forks.SOCKET_ENV: ""}), str(path))
    here, before = tmp_path / "here", os.getcwd()
    here.mkdir()
    read_fd, write_fd = os.pipe()
    os.chdir(here)
    umask = os.umask(0o027)
    try:
        env = cli_env(CHUNKQ_REDIS_URL=redis_url, CHUNKQ_POOL_PID=str(os.getpid()))
        worker = client.spawn(["--name", "standing-w1", "--queue", "nobody-queues-here"], env, write_fd)
    finally:
        os.umask(umask)
        os.chdir(before)
        os.close(write_fd)
    try:
        seen = psutil.Process(worker.pid)
        assert seen.ppid() == proc.pid  # forked by the server, not by this process
        # Its first log line comes after it took its directory and umask (the server answers the
        # fork before the child has run at all).
        wait_for(lambda: "standing-w1" in capfd.readouterr().err, 60, "the worker's log on our stderr")
        assert seen.cwd() == str(here)
        status = Path(f"/proc/{worker.pid}/status").read_text()
        assert "Umask:\t0027" in status, status
        assert f"[pool {os.getpid()}]" in " ".join(seen.cmdline())  # its title names its pool
        worker.terminate()
        assert worker.wait(timeout=60) == 0  # its exit reported through the server
    finally:
        client.close()
        os.close(read_fd)


def test_a_pool_of_another_python_or_code_is_refused() -> None:
    env = {"PYTHONPATH": "/x", "HF_HUB_OFFLINE": "1", "CHUNKQ_FAULTS": "[]"}
    server = standing_forks.identity(env)
    assert standing_forks.unlike(server, dict(env, CHUNKQ_FAULTS="other", OMP_NUM_THREADS="3")) is None
    assert "other values of PYTHONPATH" in str(standing_forks.unlike(server, dict(env, PYTHONPATH="/y")))
    assert "its chunkq code" in str(standing_forks.unlike(dict(server, code="0"), env))
    assert "runs /other/python" in str(standing_forks.unlike(dict(server, executable="/other/python"), env))
    versions = dict(server["versions"], torch="0.0")
    assert "its libraries differ" in str(standing_forks.unlike(dict(server, versions=versions), env))


def test_a_socket_path_too_long_or_in_a_missing_folder_is_named(tmp_path: Path) -> None:
    """Issue 63.5: serve-forks said only "AF_UNIX path too long" or "[Errno 2] No such file or
    directory", and a pool given such a path said the same of it."""
    long_path = tmp_path / ("s" * 120 + ".sock")
    missing = tmp_path / "nowhere" / "f.sock"
    for path, said in (
        (long_path, f"{long_path}: a Unix socket's path holds at most 107 bytes"),
        (missing, f"{missing}: its folder {missing.parent} does not exist"),
    ):
        served = run_cli("serve-forks", str(path), forks=False, timeout=60)
        assert served.returncode != 0 and said in served.stderr, served.stderr
        with pytest.raises(OSError, match=re.escape(said)):
            standing_forks.connect(str(path))
