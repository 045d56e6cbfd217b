"""``chunkq doctor``: what this host offers chunkq, and advice where something is wrong.

GPUs come from NVML (no CUDA context is created for them), or where NVML cannot initialise, from
CUDA asked in a child process (queue_worker.devices.discovery); a failing NVML on a host with a driver is a
problem, named with its error and what still works. torch is asked separately, so a CPU-only torch
on a GPU host (the silent-CPU-fallback trap) is called out.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from chunkq.jobs.contract.redaction import redacted
from chunkq.jobs.contract.run_files import atomic_write_bytes
from chunkq.jobs.contract.storage import is_local
from chunkq.jobs.queue.redis_clients import connect
from chunkq.queue_worker.devices import discovery
from chunkq.supervisor.server.embedded_redis import APPENDFSYNC, DURABLE_FSYNC, server_binary
from chunkq.supervisor.server.store_redis import served_url


@dataclass
class Report:
    gpus: list[dict[str, Any]] = field(default_factory=list)
    nvml: dict[str, Any] = field(default_factory=dict)
    torch: dict[str, Any] = field(default_factory=dict)
    redis: dict[str, Any] = field(default_factory=dict)
    store: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = not self.problems
        return data


def _nvml() -> dict[str, Any]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:
        return {"available": False, "error": str(exc)}
    try:
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        return {
            "available": True,
            "driver": str(pynvml.nvmlSystemGetDriverVersion()),
            "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}",
        }
    finally:
        pynvml.nvmlShutdown()


def _torch() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"version": torch.__version__, "cuda_build": torch.version.cuda}
    info["cuda_available"] = bool(torch.cuda.is_available())
    info["device_count"] = torch.cuda.device_count() if info["cuda_available"] else 0
    return info


def _redis(url: str | None) -> dict[str, Any]:
    if not url:
        try:
            return {"mode": "embedded (chunkq run)", "server_binary": server_binary(), "reachable": None}
        except Exception as exc:
            return {"mode": "embedded (chunkq run)", "error": str(exc), "reachable": False}
    try:
        connection = connect(url, socket_timeout=3)
        info = connection.info("server")
        aof = bool(connection.info("persistence").get("aof_enabled"))
    except redis.RedisError as exc:
        return {"mode": "external", "reachable": False, "error": str(exc)}
    try:
        fsync = connection.config_get("appendfsync").get("appendfsync")
    except redis.RedisError:  # CONFIG renamed or refused for this user: unknown, not wrong
        fsync = None
    return {
        "mode": "external",
        "reachable": True,
        "version": info.get("redis_version"),
        "append_only": aof,
        "appendfsync": fsync,
    }


def _store(path: Path) -> dict[str, Any]:
    probe = path / f".doctor-{socket.gethostname()}-{os.getpid()}"
    try:
        # The same publish path the jobs use, so a store doctor calls writable is writable for them.
        atomic_write_bytes(probe, b"chunkq doctor\n")
        probe.unlink()
        report: dict[str, Any] = {"path": str(path), "writable": True}
        if is_local(path):
            usage = os.statvfs(path)
            report["free_bytes"] = usage.f_bavail * usage.f_frsize
        return report
    except Exception as exc:  # an object store raises its own client errors, not only OSError
        return {"path": str(path), "writable": False, "error": f"{type(exc).__name__}: {exc}"}


# What to do about a failing NVML, by its nvml.h name.
NVML_ADVICE = {
    "LIB_RM_VERSION_MISMATCH": "the driver was updated under the running system: reboot, or reload the "
    "nvidia kernel modules, so that the library and the kernel module agree",
    "NO_PERMISSION": "this process may not open /dev/nvidia*: check the container's device access",
}


def _nvml_problem(found: discovery.Survey, gpus: list[discovery.GpuInfo]) -> str:
    said = f"NVML cannot initialise ({found.nvml_error})"
    advice = NVML_ADVICE.get(
        found.nvml_error_name or "", "check the NVIDIA driver (nvidia-smi says the same)"
    )
    if gpus:
        names = ", ".join(f"{gpu.label} {gpu.uuid}" for gpu in gpus)
        return (
            f"{said}: {len(gpus)} GPU(s) found through CUDA instead ({names}); runs use them as ever "
            "(--gpus, CUDA_VISIBLE_DEVICES, pinning by UUID; each worker reads its own free memory), but "
            f"free memory, processes, compute mode and MIG are unknown until NVML works: {advice}"
        )
    return f"{said}, and CUDA lists no GPU ({found.cuda_error}): {advice}"


def _store_redis(store: Path, redis_url: str | None) -> dict[str, Any]:
    """The Redis commands would use: the one given, else the store's own while it is served (issue
    53.7: doctor said "embedded" beside a running serve-redis), else the embedded default."""
    served = None if redis_url else served_url(store)
    found = _redis(redis_url or served)
    if served:
        found.update(
            mode="served by chunkq serve-redis (or a chunkq run) of this store", url=redacted(served)
        )
    return found


def examine(store: Path, redis_url: str | None) -> Report:
    report = Report(nvml=_nvml(), torch=_torch(), redis=_store_redis(store, redis_url), store=_store(store))
    host = discovery.survey()
    found = discovery.allowed(host)
    report.gpus = [{**asdict(gpu), "label": gpu.label, "exclusive": gpu.exclusive} for gpu in found]
    if host.driver_broken:
        report.problems.append(_nvml_problem(host, found))
    visible = os.environ.get(discovery.VISIBLE_ENV)
    if visible is not None:
        report.notes.append(
            f"{discovery.VISIBLE_ENV}={visible}: this process may use "
            + (", ".join(gpu.label for gpu in found) or "no GPU")
            + "; --gpus all means these"
        )
    if os.environ.get("PYTORCH_NO_NVML") is not None:
        report.notes.append(
            "PYTORCH_NO_NVML is set: no PyTorch code reads it; it does not prevent the NVML assert of the "
            "caching allocator, which is an out-of-memory (chunkq retries it smaller, in a fresh process)"
        )
    if not found and not host.driver_broken:
        report.notes.append(
            "no NVIDIA GPU found"
            + (f" ({report.nvml['error']})" if "error" in report.nvml else "")
            + "; workers will run on the CPU"
        )
    elif not report.torch["cuda_available"]:
        report.problems.append(
            f"{len(found)} GPU(s) present but torch {report.torch['version']} sees none: "
            "install a CUDA build of torch (the one matching your driver, from pytorch.org); "
            "chunkq refuses to fall back to the CPU on a GPU"
        )
    for gpu in found:
        if gpu.processes:
            names = ", ".join(f"{p.name} (pid {p.pid})" for p in gpu.processes)
            report.notes.append(f"{gpu.label} is in use by: {names}")
        if gpu.exclusive:
            report.notes.append(f"{gpu.label} is in EXCLUSIVE_PROCESS compute mode: one worker, no standby")
    if report.redis.get("reachable") is False:
        report.problems.append(f"Redis: {report.redis.get('error')}; check --redis-url / CHUNKQ_REDIS_URL")
    elif report.redis.get("append_only") is False or report.redis.get("appendfsync") not in DURABLE_FSYNC:
        report.problems.append(
            f"Redis persistence is appendonly {'yes' if report.redis.get('append_only') else 'no'}, "
            f"appendfsync {report.redis.get('appendfsync')}: a server killed or its host crashed then "
            f"loses what was queued; set `appendonly yes` and `appendfsync {APPENDFSYNC}` (as the "
            "embedded server of `chunkq run` does)"
        )
    if not report.store["writable"]:
        report.problems.append(f"store {report.store['path']} is not writable: {report.store.get('error')}")
    return report


def render(report: Report) -> str:
    lines = []
    nvml = report.nvml
    if nvml.get("available"):
        lines.append(f"NVIDIA driver {nvml['driver']}, CUDA driver {nvml['cuda_driver']}")
    for gpu in report.gpus:
        total, processes = gpu["memory_total"] / 2**30, len(gpu["processes"])
        if gpu["source"] == discovery.FROM_CUDA:
            state = f"{total:.1f} GiB, found through CUDA (NVML failed: free memory and processes unknown)"
        elif gpu["memory_free"] is None:
            state = f"free memory unknown, {processes} process(es)"
        else:
            state = f"{gpu['memory_free'] / 2**30:.1f} of {total:.1f} GiB free, {processes} process(es)"
        lines.append(f"{gpu['label']}: {gpu['name']} ({gpu['uuid']}), {state}")
        lines += [f"    pid {p['pid']} {p['name']}" for p in gpu["processes"]]
    t = report.torch
    lines.append(
        f"torch {t['version']} (CUDA build {t['cuda_build'] or 'none'}): "
        f"{t['device_count']} CUDA device(s) visible"
    )
    r = report.redis
    lines.append(
        f"Redis ({r['mode']}): "
        + (
            "reachable, version " + str(r.get("version"))
            if r.get("reachable")
            else r.get("server_binary") or r.get("error", "?")
        )
    )
    s = report.store
    lines.append(
        f"store {s['path']}: " + ("writable" if s["writable"] else f"NOT writable ({s.get('error')})")
    )
    lines += [f"note: {n}" for n in report.notes]
    lines += [f"PROBLEM: {p}" for p in report.problems]
    lines.append("all good" if not report.problems else f"{len(report.problems)} problem(s) found")
    return "\n".join(lines)
