"""Prometheus metrics of a pool, and the loopback-only HTTP endpoint that serves them.

Each process keeps its own registry (not the global one), so a test or a ``chunkq run`` that
holds a pool and a supervisor in one interpreter never mixes their series.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from chunkq.jobs.contract.errors import ConfigError
from chunkq.queue_worker import exit_codes
from chunkq.queue_worker.devices.discovery import discover

log = logging.getLogger(__name__)

METRICS_HOST = "127.0.0.1"


def serve(registry: CollectorRegistry, port: int, host: str = METRICS_HOST) -> int:
    """Serve ``registry`` on ``host:port`` (loopback only: the endpoint has no authentication)."""
    if not ipaddress.ip_address(host).is_loopback:
        raise ConfigError(f"metrics are served on loopback only (they have no authentication), not {host}")
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except (OSError, OverflowError) as exc:  # taken (EADDRINUSE), below 1024 without the right, past 65535
        raise _cannot_listen(port, host, exc) from exc
    bound = int(server.server_address[1])
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound


def _cannot_listen(port: int, host: str, exc: BaseException) -> ConfigError:
    why = getattr(exc, "strerror", None) or str(exc)
    return ConfigError(
        f"metrics port {port}: cannot listen on {host}:{port} ({why}); give another port, or 0 for any "
        "free one"
    )


def check_listenable(port: int, host: str = METRICS_HOST) -> None:
    """ConfigError unless ``serve`` could listen on ``port`` now: said before a run is created, not
    by a pool that dies of it after (hostile pass: the run made, then an OverflowError traceback)."""
    import socket

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds
        try:
            probe.bind((host, port))
        except (OSError, OverflowError) as exc:
            raise _cannot_listen(port, host, exc) from None


def exit_reason(returncode: int) -> str:
    """A short, bounded label for a worker's exit (``describe`` is for people, this is for series)."""
    return exit_codes.of(returncode).label


class _GpuMemory(Collector):
    """Per-GPU memory from NVML at scrape time (no CUDA context in the pool)."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = set(keys)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        used = GaugeMetricFamily("chunkq_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu", "name"])
        total = GaugeMetricFamily(
            "chunkq_gpu_memory_total_bytes", "GPU memory in all", labels=["gpu", "name"]
        )
        busy = GaugeMetricFamily(
            "chunkq_gpu_busy_ratio",
            "Share of NVML's last sample period in which a kernel ran on the GPU (an idle GPU reads 0)",
            labels=["gpu", "name"],
        )
        for gpu in discover():
            if gpu.key in self.keys:
                if gpu.memory_free is not None:  # unknown where NVML cannot say: no sample, not 0
                    used.add_metric([gpu.key, gpu.name], float(gpu.memory_total - gpu.memory_free))
                total.add_metric([gpu.key, gpu.name], float(gpu.memory_total))
                if gpu.utilisation is not None:
                    busy.add_metric([gpu.key, gpu.name], gpu.utilisation / 100.0)
        yield used
        yield total
        yield busy


class PoolMetrics:
    def __init__(self, pool: str, gpu_keys: list[str]) -> None:
        self.registry = CollectorRegistry()
        self.pool = pool
        self.exits = Counter(
            "chunkq_worker_exits",
            "Worker processes that ended, by reason",
            ["pool", "device", "reason"],
            registry=self.registry,
        )
        self.started = Counter(
            "chunkq_workers_started", "Worker processes started", ["pool", "device"], registry=self.registry
        )
        self.running = Gauge("chunkq_workers", "Live worker processes", ["pool"], registry=self.registry)
        self.model_load = Histogram(
            "chunkq_model_load_seconds",
            "Seconds a worker took to load its model",
            ["pool", "device"],
            buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
            registry=self.registry,
        )
        if gpu_keys:
            self.registry.register(_GpuMemory(gpu_keys))

    def worker_started(self, device: str) -> None:
        self.started.labels(self.pool, device).inc()

    def worker_exited(self, device: str, returncode: int, hung: bool = False) -> None:
        self.exits.labels(self.pool, device, "hung" if hung else exit_reason(returncode)).inc()

    def model_loaded(self, device: str, seconds: float) -> None:
        self.model_load.labels(self.pool, device).observe(seconds)

    def set_running(self, count: int) -> None:
        self.running.labels(self.pool).set(count)
