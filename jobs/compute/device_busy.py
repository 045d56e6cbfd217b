"""How busy a chunk kept its device: a GPU left idle is the first thing to see.

Three sources, best first; a chunk's output records the share and which source gave it:
- ``nvml``: the driver's own utilisation samples over the chunk's span (``nvmlDeviceGetSamples``,
  GPU_UTILIZATION_SAMPLES: the percent of each sample period in which a kernel ran, about every
  1/6 s), for the whole GPU: every worker on it counts. The worker supplies the reader
  (``runtime.set_utilisation``: NVML is the pool's business, jobs/ never opens it).
- ``cuda-events``: where NVML cannot say (a host whose NVML cannot initialise, a MIG slice), CUDA
  events around each forward call of the model, on this worker's stream: this worker's share only,
  and the gaps between kernels inside a forward count as busy, so it reads high for a small model
  whose kernels the CPU cannot launch fast enough.
- ``cpu-forward``: on the CPU, the share of the chunk spent inside the model's forward; the rest
  is tokenising, batching, pooling and copies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

NVML, CUDA_EVENTS, CPU_FORWARD = "nvml", "cuda-events", "cpu-forward"
GPU_SOURCES = (NVML, CUDA_EVENTS)
# Utilisation samples since a time (microseconds, the samples' clock) -> [(time, percent)], or None
# where the device cannot say (the worker's NVML reader).
UtilisationSince = Callable[[int], list[tuple[int, float]] | None]


@dataclass
class _Forwards:
    """Each forward call of a model, timed: CUDA events on a GPU, the clock on the CPU."""

    gpu: bool
    seconds: float = 0.0
    events: list[tuple[Any, Any]] = field(default_factory=list)
    _began: Any = None

    def before(self, *_: Any) -> None:
        if self.gpu:
            import torch

            self._began = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self._began.record()
        else:
            self._began = time.perf_counter()

    def after(self, *_: Any) -> None:
        if self._began is None:
            return
        if self.gpu:
            import torch

            ended = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ended.record()
            self.events.append((self._began, ended))
        else:
            self.seconds += time.perf_counter() - self._began
        self._began = None

    def busy_seconds(self) -> float:
        if self.gpu and self.events:
            self.events[-1][1].synchronize()
            return float(sum(began.elapsed_time(ended) for began, ended in self.events)) / 1000.0
        return self.seconds


@dataclass
class Busy:
    share: float | None = None  # of the chunk's span, 0..1; None where nothing could say
    source: str | None = None
    samples: int = 0  # NVML samples, or forward calls timed

    def to_dict(self) -> dict[str, Any] | None:
        if self.share is None:
            return None
        return {"share": round(self.share, 4), "source": self.source, "samples": self.samples}


def _from_nvml(read: UtilisationSince | None, since_us: int) -> Busy | None:
    if read is None:
        return None
    try:
        samples = read(since_us)
    except Exception:  # a reader that fails mid-run costs the figure, never the chunk
        return None
    if not samples:
        return None
    return Busy(sum(p for _, p in samples) / len(samples) / 100.0, NVML, len(samples))


@contextmanager
def measured(model: Any, device: str, read: UtilisationSince | None) -> Iterator[Busy]:
    """Measure how busy ``device`` was while the block ran; the yielded Busy is filled on exit."""
    gpu = device.startswith("cuda")
    since_us = int(time.time() * 1e6)
    began = time.perf_counter()
    forwards = _Forwards(gpu)
    hooks = _hook(model, forwards)
    busy = Busy()
    try:
        yield busy
    finally:
        for hook in hooks:
            hook.remove()
    span = time.perf_counter() - began
    found = _from_nvml(read, since_us) if gpu else None
    if found is None and span > 0 and (forwards.events or forwards.seconds):
        share = min(forwards.busy_seconds() / span, 1.0)
        found = Busy(share, CUDA_EVENTS if gpu else CPU_FORWARD, len(forwards.events) if gpu else 0)
    if found is not None:
        busy.share, busy.source, busy.samples = found.share, found.source, found.samples


def _hook(model: Any, forwards: _Forwards) -> list[Any]:
    """Hooks that time each batch's pass through ``model``: before its first module and after its
    last. sentence-transformers' models are sequences of modules, and ``encode`` calls their
    ``forward`` directly, which no hook on the top module sees; each module in the sequence is
    called, so hooks on the first and the last are."""
    if not hasattr(model, "register_forward_pre_hook"):
        return []
    children = list(model.children())
    first, last = (children[0], children[-1]) if children else (model, model)
    return [first.register_forward_pre_hook(forwards.before), last.register_forward_hook(forwards.after)]


@dataclass
class Tally:
    """Chunks' busy shares as one figure: each weighted by its chunk's seconds, per source; the
    figure is the source that measured the most seconds (a run on one kind of device has one)."""

    by_source: dict[str, list[float]] = field(default_factory=dict)  # source: [busy seconds, seconds]

    def add(self, busy: Any, seconds: Any) -> None:
        if isinstance(busy, dict) and isinstance(busy.get("share"), int | float) and seconds:
            weighted = self.by_source.setdefault(str(busy.get("source")), [0.0, 0.0])
            weighted[0] += float(busy["share"]) * float(seconds)
            weighted[1] += float(seconds)

    def figure(self) -> dict[str, Any] | None:
        if not self.by_source:
            return None
        source, (busy_seconds, seconds) = max(self.by_source.items(), key=lambda item: item[1][1])
        return {"share": round(busy_seconds / seconds, 4), "source": source, "seconds": round(seconds, 3)}


def describe(figure: dict[str, Any] | None) -> str:
    """For people: '83 % (nvml)', or why there is no figure."""
    if not figure:
        return "not measured (chunks made before chunkq recorded it)"
    what = {
        NVML: "the GPU's own utilisation, NVML",
        CUDA_EVENTS: "each worker's forward calls, CUDA events",
        CPU_FORWARD: "time in the model's forward, CPU",
    }.get(str(figure["source"]), str(figure["source"]))
    return f"{100 * float(figure['share']):.0f} % ({what})"
