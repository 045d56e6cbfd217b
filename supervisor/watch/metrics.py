"""Prometheus metrics of a supervised run (served on loopback by ``queue_worker.processes.metrics.serve``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from chunkq.supervisor.watch.snapshot import Snapshot

STATES = ("done", "queued", "running", "retrying", "quarantined")


class RunMetrics:
    def __init__(self, run_id: str) -> None:
        self.registry = CollectorRegistry()
        self.run_id = run_id
        self.chunks = Gauge(
            "chunkq_chunks", "Chunks of the run by state", ["run", "state"], registry=self.registry
        )
        self.rows_done = Gauge(
            "chunkq_rows_done", "Rows whose embeddings are in the store", ["run"], registry=self.registry
        )
        self.rows_encoding = Gauge(
            "chunkq_rows_encoding",
            "Rows running chunks have encoded, not yet published",
            ["run"],
            registry=self.registry,
        )
        self.rows_total = Gauge("chunkq_rows", "Rows in the run", ["run"], registry=self.registry)
        self.rate = Gauge("chunkq_rows_per_second", "Recent throughput", ["run"], registry=self.registry)
        self.corpus_rows = Gauge(
            "chunkq_corpus_rows",
            "Rows of the run's corpus by where their vector comes from: encoded, from_cache, deduplicated "
            "(a copy of a text encoded once)",
            ["run", "source"],
            registry=self.registry,
        )
        self.busy = Gauge(
            "chunkq_device_busy_ratio",
            "Share of the finished chunks' time their device was busy (source: nvml, the GPU's own "
            "utilisation; cuda-events, each worker's forward calls; cpu-forward, time in the model)",
            ["run", "source"],
            registry=self.registry,
        )
        self.retries = Counter(
            "chunkq_chunk_retries",
            "Failed chunk attempts queued again, by error class",
            ["run", "error_class"],
            registry=self.registry,
        )
        self.quarantines = Counter(
            "chunkq_chunks_quarantined",
            "Chunks quarantined, by error class",
            ["run", "error_class"],
            registry=self.registry,
        )

    def observe(self, snap: Snapshot) -> None:
        counts = {
            "done": snap.chunks_done,
            "queued": snap.chunks_queued,
            "running": snap.chunks_running,
            "retrying": snap.chunks_retrying,
            "quarantined": snap.chunks_quarantined,
        }
        for state in STATES:
            self.chunks.labels(self.run_id, state).set(counts[state])
        self.rows_done.labels(self.run_id).set(snap.corpus_rows_done)
        self.rows_encoding.labels(self.run_id).set(snap.rows_encoding)
        self.rows_total.labels(self.run_id).set(snap.corpus_rows)
        self.rate.labels(self.run_id).set(snap.rows_per_second or 0.0)
        if snap.device_busy is not None:
            self.busy.labels(self.run_id, snap.device_busy["source"]).set(snap.device_busy["share"])
        if snap.cache is not None:
            for source in ("encoded", "from_cache", "deduplicated"):
                self.corpus_rows.labels(self.run_id, source).set(snap.cache[source])

    def settled(self, outcome: str, error_class: str) -> None:
        """Count what the retry policy did with one failed chunk ('requeued' or 'quarantined_now')."""
        if outcome == "requeued":
            self.retries.labels(self.run_id, error_class).inc()
        elif outcome == "quarantined_now":
            self.quarantines.labels(self.run_id, error_class).inc()
