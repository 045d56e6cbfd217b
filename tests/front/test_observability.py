"""Prometheus metrics scraped from a live pool and supervisor, then ``chunkq report`` on the same run."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
import redis

from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.queue_worker.exit_codes import EXIT_CONFIG
from chunkq.supervisor.server.embedded_redis import free_port
from tests.helpers import make_texts, run_cli, start_cli, stop_tree, wait_for, write_corpus

# Real pools, workers and CLI runs as subprocesses: the slow tier.
pytestmark = pytest.mark.slow

PNG = b"\x89PNG\r\n\x1a\n"


def _scrape(port: int) -> dict[str, float]:
    """``name{labels}`` -> value of every sample an endpoint serves."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def test_metrics_during_a_run_and_the_report_after_it(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str
) -> None:
    ids, texts = make_texts(60, seed=9)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_STORE": str(store), "CHUNKQ_QUEUE": "obs"}
    submitted = run_cli("submit", str(corpus), "--chunk-size", "10", "--run-id", "obs", **env)
    assert submitted.returncode == 0, submitted.stderr
    # Chunk 1 breaks CUDA on its first attempt; chunk 5 is slow, so the run is still going when scraped.
    faults = json.dumps(
        [
            {"kind": "cuda_fatal", "chunks": [1], "attempts": [1]},
            {"kind": "slow", "chunks": [5], "seconds": 20},
        ]
    )
    pool_port, sup_port = free_port(), free_port()
    pool_args = ["--gpus", "none", "--max-jobs", "3", "--name", "obspool", "--metrics-port", str(pool_port)]
    pool_args += ["--preload", "bundled:all-MiniLM-L6-v2"]
    pool = start_cli(tmp_path / "pool.log", "pool", *pool_args, CHUNKQ_FAULTS=faults, **env)
    supervisor = start_cli(
        tmp_path / "sup.log", "supervise", "obs", "--poll", "0.2", "--metrics-port", str(sup_port), **env
    )
    try:
        run = '{run="obs"}'
        wait_for(lambda: _scrape(sup_port).get(f"chunkq_rows_done{run}", 0) >= 40, 180, "40 rows done")
        sup = _scrape(sup_port)
        pool_metrics = _scrape(pool_port)
        assert sup[f"chunkq_rows{run}"] == 60
        assert sup['chunkq_chunk_retries_total{error_class="cuda_fatal",run="obs"}'] == 1
        assert sup['chunkq_chunks{run="obs",state="done"}'] >= 4
        assert sup['chunkq_chunks{run="obs",state="quarantined"}'] == 0
        # a CPU worker's share of each chunk in the model's forward (jobs.compute.device_busy)
        assert 0.0 < sup['chunkq_device_busy_ratio{run="obs",source="cpu-forward"}'] <= 1.0, sup
        assert pool_metrics['chunkq_worker_exits_total{device="cpu",pool="obspool",reason="cuda_fatal"}'] == 1
        assert pool_metrics['chunkq_workers{pool="obspool"}'] >= 1
        assert sum(v for k, v in pool_metrics.items() if k.startswith("chunkq_model_load_seconds_count")) >= 2
        wait_for(lambda: supervisor.poll() is not None, 180, "the supervisor to assemble the result")
        assert supervisor.returncode == 0, (tmp_path / "sup.log").read_text()[-3000:]
    finally:
        stop_tree(supervisor) if supervisor.poll() is None else None
        stop_tree(pool)

    out = tmp_path / "report"
    report = run_cli("report", "obs", "--out", str(out), **env)
    assert report.returncode == 0, report.stderr[-3000:]
    assert (out / "report.png").read_bytes()[:8] == PNG and (out / "report.png").stat().st_size > 20_000
    numbers = json.loads((out / "report.json").read_text())
    layout = RunLayout(store, "obs")
    metas = [read_json(layout.output_meta(i)) for i in range(6)]
    assert numbers["rows_done"] == 60 and numbers["chunks_done"] == 6
    assert numbers["worker_processes"] == len({m["pid"] for m in metas})
    assert numbers["failed_attempts"] == 1 and numbers["failures_by_class"] == {"cuda_fatal": 1}
    assert numbers["quarantined_chunks"] == []
    # The slow chunk sleeps inside its job, so its device was idle; the others spend most of their
    # time in the model. The run's figure weighs each chunk by its seconds.
    shares = {m["chunk"]: m["busy"]["share"] for m in metas}
    assert shares[5] < 0.2 < min(v for k, v in shares.items() if k != 5), shares
    busy = numbers["device_busy"]
    weighted = sum(m["busy"]["share"] * m["seconds"] for m in metas) / sum(m["seconds"] for m in metas)
    assert busy["source"] == "cpu-forward" and busy["share"] == pytest.approx(weighted, abs=1e-3), busy
    assert numbers["length_unit"] == "tokens" and numbers["truncation_point"] == 256
    md = (out / "report.md").read_text()
    assert "| device busy over the chunks | " in md and "(time in the model's forward, CPU) |" in md
    assert "| rows done | 60 of 60 |" in md and "| failed attempts | 1 (cuda_fatal: 1) |" in md
    assert f"| worker processes | {numbers['worker_processes']} encoded its chunks, 0 died |" in md


def _two_free_ports() -> int:
    """A port P with P + 1 free too: `chunkq run --metrics-port P` serves its pool's on P + 1. Taken
    below the kernel's ephemeral range, where no other test's connection or `port 0` server can take
    P + 1 between this pick and the pool's bind (seen under four tests at once on two cores)."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = random.randint(min(20000, low - 1000), low - 2)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise AssertionError("no two free ports in a row")


def test_a_metrics_port_that_is_taken_is_one_clear_error() -> None:
    """A pool whose metrics port was taken died with a traceback (seen: the run's pool, its P + 1
    taken by another process); now one line naming the port, which the pool and the run report."""
    import socket

    from prometheus_client import CollectorRegistry

    from chunkq.jobs.contract.errors import ConfigError
    from chunkq.queue_worker.processes.metrics import serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"metrics port {port}: cannot listen on 127.0.0.1:{port} "):
            serve(CollectorRegistry(), port)


def test_a_runs_metrics_ports_are_checked_before_the_run_is_created(tmp_path: Path) -> None:
    """Issue 63.4: `run --metrics-port 65535` was taken, the run created, and its pool died of an
    OverflowError traceback (its port, 65536); a taken P + 1 was found only after the run was made.
    Both are refused first, in one line, and nothing is left in the store."""
    import socket

    ids, texts = make_texts(4, seed=1)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    last = run_cli("run", str(corpus), "--store", str(store), "--metrics-port", "65535", forks=False)
    assert last.returncode == EXIT_CONFIG, last.stderr[-2000:]
    assert "the next port, 65536, past the last one (65535)" in last.stderr.strip().splitlines()[-1]
    port = _two_free_ports()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        busy = run_cli("run", str(corpus), "--store", str(store), "--metrics-port", str(port), forks=False)
    assert busy.returncode == EXIT_CONFIG, busy.stderr[-2000:]
    line = busy.stderr.strip().splitlines()[-1]
    assert (
        f"metrics port {port + 1}: cannot listen on 127.0.0.1:{port + 1}" in line
        and "Traceback" not in busy.stderr
    )
    assert not (store / "runs").exists()


def test_chunkq_run_serves_its_metrics_on_the_port_and_its_pools_on_the_next(tmp_path: Path) -> None:
    """Issue 54.4: the pool's port was set after its settings were built, so nothing listened on
    P + 1, which the docs promise. Both are scraped while the run is live (a chunk made slow)."""
    import time

    ids, texts = make_texts(40, seed=10)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    port = _two_free_ports()
    faults = json.dumps([{"kind": "slow", "chunks": [3], "seconds": 20}])
    run = start_cli(
        tmp_path / "run.log", "run", str(corpus), "--store", str(tmp_path / "store"), "--chunk-size", "10",
        "--metrics-port", str(port), CHUNKQ_FAULTS=faults,
    )  # fmt: skip
    slowest = 0.0

    def scraped(at: int, name: str) -> bool:
        nonlocal slowest
        started = time.monotonic()
        samples = _scrape(at)
        slowest = max(slowest, time.monotonic() - started)
        return any(key.startswith(name) for key in samples)

    try:
        wait_for(lambda: scraped(port, "chunkq_rows_done"), 180, "the run's metrics on P")
        wait_for(lambda: scraped(port + 1, "chunkq_workers"), 60, "the pool's metrics on P + 1")
        assert run.poll() is None, "scraped after the run ended: not a live run's figures"
        assert slowest < 5, slowest  # every scrape answered (none hung to its timeout)
        wait_for(lambda: run.poll() is not None, 180, "the run to end")
        assert run.returncode == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        stop_tree(run) if run.poll() is None else None
