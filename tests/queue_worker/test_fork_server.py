"""The fork server: workers forked from a process that imported torch once, still fresh processes.

Real processes, a real Redis and the bundled model on the CPU.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import redis

from chunkq.jobs.compute import models
from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.jobs.contract.settings import PoolSettings
from chunkq.queue_worker import exit_codes
from chunkq.queue_worker.devices.discovery import GpuInfo
from chunkq.queue_worker.processes.fork_client import ForkServer
from chunkq.queue_worker.processes.fork_server import MODEL_ENV, ForkServerError
from chunkq.queue_worker.processes.pool import Pool
from chunkq.supervisor.corpus.records import CorpusOptions
from chunkq.supervisor.submit.identity import SubmitRequest
from chunkq.supervisor.submit.submission import SubmitResult, submit
from tests import warm_forks
from tests.helpers import (
    CHUNKQS_OWN_THREADS,
    CLI,
    cli_env,
    make_texts,
    max_abs_diff,
    signal_handlers_restored,
    stop_tree,
    wait_for,
    worker_processes,
    write_corpus,
)

# Real pools, workers and CLI runs as subprocesses: the slow tier.
pytestmark = pytest.mark.slow
# These pools' claims are about a fork server of their own, not the test process's standing one, and
# about workers forked with the threads chunkq gives them.
OWN = {warm_forks.SOCKET_ENV: "", **CHUNKQS_OWN_THREADS}

POOL_LOGGER = "chunkq.queue_worker.processes.pool"


def _submit(tmp_path: Path, store: Path, connection: redis.Redis, rows: int, chunk: int) -> SubmitResult:
    ids, texts = make_texts(rows, seed=71)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    request = SubmitRequest(
        corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=chunk, queue="fs"
    )
    return submit(request, connection)


@contextmanager
def _pool(
    tmp_path: Path, redis_url: str, *args: str, **env: str
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    log = tmp_path / "pool.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*CLI, "pool", "--gpus", "none", "--queue", "fs", *args],
            env=cli_env(CHUNKQ_REDIS_URL=redis_url, CHUNKQ_STORE=str(tmp_path / "store"), **OWN, **env),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc, log
    finally:
        stop_tree(proc)


def _drained(pool: subprocess.Popen[bytes], log: Path) -> int:
    """The pool's exit code after its drain, or a failure that shows what it was still doing."""
    try:
        return pool.wait(timeout=60)
    except subprocess.TimeoutExpired:
        tail = log.read_text(errors="replace")[-4000:]
        raise AssertionError(f"the pool did not drain within 60 s; its log ends:\n{tail}") from None


def _fork_server(pool: subprocess.Popen[bytes]) -> psutil.Process:
    (server,) = [
        c
        for c in psutil.Process(pool.pid).children()
        if "chunkq.queue_worker.processes.fork_server" in " ".join(c.cmdline())
    ]
    return server


def _lineage(pool: subprocess.Popen[bytes], seen: list[list[tuple[int, int, int]]]) -> bool:
    """Append (pid, parent pid, session id) of each live worker to ``seen``; False while there is
    none, or one exits as it is looked at."""
    try:
        found = [(w.pid, w.ppid(), os.getsid(w.pid)) for w in worker_processes(pool)]
    except (psutil.Error, ProcessLookupError):
        return False
    seen.append(found)
    return bool(found)


def test_each_worker_is_a_new_process_forked_from_one_server(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str
) -> None:
    run = _submit(tmp_path, store, connection, rows=40, chunk=10)
    layout = RunLayout(store, run.run_id)
    with _pool(tmp_path, redis_url, "--max-jobs", "1", "--max-jobs-jitter", "0") as (pool, log):
        wait_for(lambda: len(layout.done_chunks()) == 4, 180, "four chunks done")
        server = _fork_server(pool)
        # The last chunk's worker may have exited before its successor is forked: wait for one.
        seen: list[list[tuple[int, int, int]]] = []
        wait_for(lambda: _lineage(pool, seen), 60, "the pool's next worker")
        assert all(ppid == server.pid for _pid, ppid, _sid in seen[-1])
        assert all(sid == pid for pid, _ppid, sid in seen[-1])  # own session, as with a fresh interpreter
        pool.send_signal(signal.SIGTERM)
        assert _drained(pool, log) == 0
        assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
        text = log.read_text()
    pids = {read_json(layout.output_meta(i))["pid"] for i in range(4)}
    assert len(pids) == 4 and server.pid not in pids  # max-jobs 1: a new process for every chunk
    assert "fork server unusable" not in text
    assert text.count("loaded model") >= 4  # each forked worker loaded the model itself


def test_workers_take_the_preloaded_model_from_the_fork_server(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str, reference_model: Any
) -> None:
    run = _submit(tmp_path, store, connection, rows=30, chunk=10)
    layout = RunLayout(store, run.run_id)
    args = ("--preload", BUNDLED_MODEL, "--max-jobs", "1", "--max-jobs-jitter", "0")
    with _pool(tmp_path, redis_url, *args) as (pool, log):
        wait_for(lambda: len(layout.done_chunks()) == 3, 180, "three chunks done")
        pool.send_signal(signal.SIGTERM)
        assert _drained(pool, log) == 0
        text = log.read_text()
    assert "fork server loaded bundled:all-MiniLM-L6-v2" in text
    assert text.count("took model bundled:all-MiniLM-L6-v2 from the fork server") >= 3
    assert "loaded model bundled" not in text  # no worker built the model itself
    _ids, texts = make_texts(30, seed=71)
    built = re.search(r"fork server loaded \S+ in ([0-9.]+) s", text)
    assert built, text[-3000:]
    for i in range(3):
        meta = read_json(layout.output_meta(i))
        # The load it reports is its own: moving a model the fork server built, not building one.
        # Against the build measured in the same run, not a fixed bound a loaded machine can pass.
        assert meta["model_load_seconds"] < float(built.group(1)) / 2, (meta, built.group(0))
        got = np.load(layout.output_npy(i))
        assert max_abs_diff(got, reference_model.encode(texts[i * 10 : (i + 1) * 10])) <= 1e-5


def test_a_model_the_fork_server_cannot_load_is_left_to_the_workers(caplog: pytest.LogCaptureFixture) -> None:
    server = ForkServer(cli_env(**{MODEL_ENV: "/no/such/model/here"}))
    try:
        with caplog.at_level(logging.INFO, logger="chunkq.queue_worker.processes.fork_server"):
            server._start()
        assert server.proc is not None and server.proc.poll() is None  # it serves all the same
        assert "fork server could not load /no/such/model/here" in caplog.text
    finally:
        server.close()


def test_a_model_too_large_to_keep_is_not_kept() -> None:
    with pytest.raises(ConfigError, match="weights take"):
        models.load_template(BUNDLED_MODEL, max_bytes=1 << 20)  # 1 MiB: MiniLM has about 90
    assert BUNDLED_MODEL not in models._templates


def test_the_fork_server_imports_with_the_collector_off_and_freezes_what_it_imported() -> None:
    """As Python's gc documentation advises for a process that forks without exec: no collection
    walks the imports' objects again and again (about 1 s of a 6-7 s start), they are frozen for the
    workers, and the collector is on again for the server's life and every worker's."""
    probe = (
        "import gc, json\n"
        "from chunkq.queue_worker.processes import fork_server\n"
        "fork_server.PRELOAD = ('torch',)  # the same work, in short\n"
        "seen = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and seen.append(info['generation']))\n"
        "ready = fork_server._prepare()\n"
        "print(json.dumps(['ready' in ready, len(seen), gc.isenabled(), gc.get_freeze_count()]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=cli_env(**OWN), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    ready, collections, enabled, frozen = json.loads(done.stdout.splitlines()[-1])
    assert ready and collections == 0 and enabled and frozen > 50_000, done.stdout


def test_a_forked_worker_lives_in_the_environment_it_was_given(tmp_path: Path) -> None:
    """The fork server's own environment has no GPU settings; the worker's request does."""
    server = ForkServer(cli_env())
    try:
        read_fd, write_fd = os.pipe()
        env = cli_env(CHUNKQ_REDIS_URL="redis://127.0.0.1:9", CHUNKQ_DEVICE="cuda", CHUNKQ_GPU="0")
        env["CUDA_VISIBLE_DEVICES"] = ""
        worker = server.spawn(["--queue", "fs", "--burst"], env, write_fd)
        os.close(write_fd)
        assert psutil.Process(worker.pid).ppid() == server.pid
        # Given a GPU, the forked worker first creates its CUDA context, which this CPU build of
        # torch cannot: it read CHUNKQ_DEVICE from the request, not from the fork server, and says
        # so with the code that sends the pool to fresh interpreters.
        assert worker.wait(timeout=60) == exit_codes.EXIT_FORKED_NO_CUDA
        os.close(read_fd)
    finally:
        server.close()
    assert server.proc is None


@pytest.mark.parametrize("kind", ["own", "standing"])
def test_a_worker_stopped_the_moment_it_is_forked_stops_as_asked(kind: str, redis_url: str) -> None:
    """A pool may stop a worker the moment it learns its pid (a recycled worker's successor started
    just before the pool was told to drain). A forked worker inherits the server's handling of
    SIGTERM (ignored by a pool's own server, a standing server's own stop) until its handlers are in
    place: a stop sent in between was lost, and the worker listened on until its pool killed it (a
    full suite run saw test_pool_recycles_workers_and_finishes_every_chunk's pool wait 60 s for it)."""
    env = cli_env(CHUNKQ_REDIS_URL=redis_url, CHUNKQ_DEVICE="cpu", CUDA_VISIBLE_DEVICES="", **OWN)
    standing = warm_forks.standing_socket() if kind == "standing" else None
    server = ForkServer(env, standing)
    codes = []
    try:
        for _ in range(5):
            read_fd, write_fd = os.pipe()
            worker = server.spawn(["--queue", "stopped-at-once"], env, write_fd)
            worker.send_signal(signal.SIGTERM)  # as Pool._signal_all does, right after the fork
            os.close(write_fd)
            try:
                codes.append(worker.wait(timeout=30))
            except subprocess.TimeoutExpired:
                worker.kill()
                codes.append(worker.wait(timeout=30))
            os.close(read_fd)
    finally:
        server.close()
    assert codes == [exit_codes.EXIT_STOPPED] * 5


def test_a_dead_fork_server_is_replaced_and_its_workers_are_not_left_behind(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str
) -> None:
    run = _submit(tmp_path, store, connection, rows=20, chunk=10)
    layout = RunLayout(store, run.run_id)
    with _pool(tmp_path, redis_url, "--cpu-workers", "2") as (pool, log):
        wait_for(lambda: len(worker_processes(pool)) == 2, 120, "two workers")
        first = _fork_server(pool)
        old_workers = worker_processes(pool)
        first.kill()
        _gone, alive = psutil.wait_procs(old_workers, timeout=60)
        assert not alive, f"workers outlived their fork server: {alive}"
        wait_for(lambda: len(worker_processes(pool)) == 2, 120, "two new workers")
        assert _fork_server(pool).pid != first.pid
        assert pool.poll() is None
        wait_for(lambda: len(layout.done_chunks()) == 2, 180, "the run done by the new workers")
        pool.send_signal(signal.SIGTERM)
        assert _drained(pool, log) == 0


def test_a_fork_server_that_cannot_start_leaves_the_pool_on_fresh_interpreters(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str
) -> None:
    run = _submit(tmp_path, store, connection, rows=10, chunk=10)
    layout = RunLayout(store, run.run_id)
    with _pool(tmp_path, redis_url, CHUNKQ_FORK_SERVER_PRELOAD="no_such_module_here") as (pool, log):
        wait_for(lambda: len(layout.done_chunks()) == 1, 180, "the chunk done")
        assert "fork server unusable" in log.read_text()
        (worker,) = worker_processes(pool)
        assert worker.ppid() == pool.pid  # started with a fresh interpreter
        pool.send_signal(signal.SIGTERM)
        assert _drained(pool, log) == 0


def _preload(tmp_path: Path, name: str, source: str) -> dict[str, str]:
    """Environment for a fork server that also imports ``source`` as module ``name``."""
    (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", ""), os.getcwd()])
    return cli_env(PYTHONPATH=path, CHUNKQ_FORK_SERVER_PRELOAD=name, **OWN)


def test_a_fork_server_with_the_cuda_driver_mapped_but_not_initialised_serves(tmp_path: Path) -> None:
    """What ``import torch`` does on a CUDA build: libcuda mapped, CUDA not initialised (measured on
    an H100). Simulated by mapping a library named libcuda.so.1; the old guard refused this."""
    env = _preload(
        tmp_path,
        "map_libcuda",
        "import ctypes, os, shutil, _ctypes\n"
        f"ctypes.CDLL(shutil.copy(_ctypes.__file__, {str(tmp_path / 'libcuda.so.1')!r}))\n"
        f"open({str(tmp_path / 'nvml_check')!r}, 'w').write(os.environ['PYTORCH_NVML_BASED_CUDA_CHECK'])\n",
    )
    server = ForkServer(env)
    try:
        server._start()
        assert server.proc is not None and server.proc.poll() is None
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
        assert "libcuda.so.1" in maps  # the simulation took: the driver library is mapped
        # and torch's availability checks in it ask NVML, never the driver
        assert (tmp_path / "nvml_check").read_text() == "1"
        read_fd, write_fd = os.pipe()
        worker = server.spawn(
            ["--queue", "fs", "--burst"], cli_env(CHUNKQ_REDIS_URL="redis://127.0.0.1:9"), write_fd
        )
        os.close(write_fd)
        assert worker.wait(timeout=60) == exit_codes.EXIT_REDIS  # forked and ran: nothing listens there
        os.close(read_fd)
    finally:
        server.close()


def test_a_fork_server_in_which_cuda_was_initialised_refuses(tmp_path: Path) -> None:
    env = _preload(tmp_path, "init_cuda", "import torch\ntorch.cuda.is_initialized = lambda: True\n")
    server = ForkServer(env)
    with pytest.raises(ForkServerError, match=r"torch\.cuda was initialised while importing"):
        server._start()
    assert server.proc is None


def test_a_pool_whose_forked_gpu_workers_cannot_create_a_context_falls_back_once(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPU slot on this CPU host: the forked worker really cannot create a CUDA context; the pool
    says so once and starts fresh interpreters, whose worker then refuses to run on the CPU."""
    gpu = GpuInfo(index=0, name="no such GPU here", uuid="", memory_total=1 << 30, memory_free=1 << 30)
    settings = PoolSettings(redis_url=redis_url, queue="fs-gpu", restart_delay=0.0, name="fs-gpu")
    pool = Pool(settings, [gpu])
    with (
        signal_handlers_restored(),
        caplog.at_level(logging.INFO, logger=POOL_LOGGER),
    ):
        assert pool.run() == exit_codes.EXIT_CONFIG  # no device left once the CPU fallback is refused
    assert [code for _slot, code in pool.exits] == [exit_codes.EXIT_FORKED_NO_CUDA, exit_codes.EXIT_CONFIG]
    assert pool.fork_server is None
    assert caplog.text.count("fork server unusable") == 1
    assert "could not create its CUDA context" in caplog.text


def test_a_fork_server_whose_children_would_be_bad_forks_refuses(tmp_path: Path) -> None:
    """torch's poison_fork (torch/csrc/cuda/Module.cpp) registers a pthread_atfork child handler the
    first time anything reaches _cuda_getDeviceCount; every later child is then a bad fork while
    torch.cuda.is_initialized() stays False in the parent. Imitated with the same mechanism
    (os.register_at_fork) behind torch.cuda._is_in_bad_fork, which a CPU build answers False."""
    env = _preload(
        tmp_path,
        "poison_fork",
        "import os, torch.cuda\n"
        "_bad = False\n"
        "def _forked_child():\n"
        "    global _bad\n"
        "    _bad = True\n"
        "os.register_at_fork(after_in_child=_forked_child)\n"
        "torch.cuda._is_in_bad_fork = lambda: _bad\n",
    )
    server = ForkServer(env)
    with pytest.raises(ForkServerError, match="a child forked now is a bad fork for torch"):
        server._start()
    assert server.proc is None


def test_a_forked_worker_whose_gpu_is_out_of_memory_costs_only_that_fork(
    redis_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Creating the context fails with the runtime's out-of-memory (a GPU full of other workers):
    the pool keeps forking, and retires the GPU only after --crash-limit such deaths."""
    monkeypatch.setenv("CHUNKQ_FAULTS", '[{"kind": "no_context", "variant": "oom"}]')
    gpu = GpuInfo(index=0, name="no such GPU here", uuid="", memory_total=1 << 30, memory_free=1 << 30)
    settings = PoolSettings(
        redis_url=redis_url,
        queue="fs-oom",
        restart_delay=0.0,
        name="fs-oom",
        crash_limit=3,
        workers_per_gpu="1",
    )
    pool = Pool(settings, [gpu])
    with (
        signal_handlers_restored(),
        caplog.at_level(logging.INFO, logger=POOL_LOGGER),
    ):
        assert pool.run() == exit_codes.EXIT_CONFIG  # no device left once it is retired
    assert [code for _slot, code in pool.exits] == [exit_codes.EXIT_NO_CONTEXT] * 3
    assert pool.fork_server is not None and "fork server unusable" not in caplog.text
    assert "could not create its CUDA context (out of memory or busy)" in caplog.text
    assert "3 worker deaths within" in caplog.text
