"""OpenVINO as a model's runtime on the CPU, through sentence-transformers' own ``backend="openvino"``
(optimum-intel), not a pipeline of chunkq's.

Exact unless asked: OpenVINO's CPU plugin runs in bf16 by default where the CPU has it (AVX512-BF16,
AMX), which moved an all-MiniLM-L6-v2 vector by up to 1.5e-3 here; chunkq sets the precision hint to
f32 unless ``--precision bf16`` names it. The model is exported from its PyTorch weights once per
host, model identity and OpenVINO release, into this host's cache, and every later load (each
worker, each run) reads the export. OpenVINO is imported by the worker that runs the model, never
by the fork server a worker is forked from, so no child inherits a runtime's threads. (Imported
there, it would have saved a worker ~1 s of its load, and mapped no plugin; but importing it starts
a thread, openvino_telemetry's sender, which a fork must not copy mid-send.)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from chunkq.jobs.compute.ov_quantize import QUANTIZED_FILE, missing_quantized
from chunkq.jobs.contract import release
from chunkq.jobs.contract.defaults import DEFAULT_PRECISION
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.specs import INT8
from chunkq.jobs.contract.storage import user_cache_dir

log = logging.getLogger(__name__)

INSTALL = "pip install 'chunkq[openvino]'"
# chunkq's --precision: OpenVINO's hint. int8 is a quantized model (ov_quantize), its other ops in f32.
PRECISION_HINTS = {DEFAULT_PRECISION: "f32", "bf16": "bf16", INT8: "f32"}
_MODULES = ("openvino", "optimum.intel")
_RELEASES = ("openvino", "optimum-intel")
EXPORTED_MARK = "chunkq-openvino.json"  # written last: a folder without it is an export cut short
LOCK_SUFFIX = ".lock"  # beside each export: one exporter at a time


def missing() -> str | None:
    """Why OpenVINO cannot run on this host, in one line; None when it can."""
    for module in _MODULES:
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            return f"--backend openvino needs OpenVINO and optimum-intel, which this Python lacks: {INSTALL}"
    return None


def require() -> None:
    why = missing()
    if why is not None:
        raise ConfigError(why)


def check_precision(precision: str, device: str) -> None:
    """OpenVINO here runs on the CPU, in f32 (exact) or bf16 (by name)."""
    if not device.startswith("cpu"):
        raise ConfigError(
            f"--backend openvino runs models on the CPU; these workers run on {device}: give --gpus none"
        )
    if precision not in PRECISION_HINTS:
        raise ConfigError(
            f"--precision {precision} with --backend openvino: give {' or '.join(PRECISION_HINTS)} "
            f"({DEFAULT_PRECISION}, the default, equals PyTorch's vectors; bf16 and int8 run faster, rounded)"
        )


def releases() -> dict[str, str]:
    """OpenVINO's and optimum-intel's releases, whole: part of what a vector of theirs is."""
    return release.releases(dict.fromkeys(_RELEASES))


def load_kwargs(precision: str, threads: int) -> dict[str, Any]:
    """sentence-transformers' ``model_kwargs`` for OpenVINO: the precision named, this worker's
    threads, unpinned. OpenVINO pins its threads to cores by default, and a host's workers are
    several processes: two single-threaded ones pinned on this 2-core machine shared one core (500
    docstrings in 14.4-14.8 s each, against 8.1-8.5 s unpinned), and a run went at 0.58x PyTorch's."""
    return {
        "ov_config": {
            "INFERENCE_PRECISION_HINT": PRECISION_HINTS[precision],
            "INFERENCE_NUM_THREADS": threads,
            "ENABLE_CPU_PINNING": False,
        },
        **({"file_name": QUANTIZED_FILE} if precision == INT8 else {}),
    }


def exports_dir() -> Path:
    """This host's exports (``chunkq cache exports`` lists them: jobs/compute/ov_exports.py)."""
    return user_cache_dir() / "openvino"


def export_folder(identity: str) -> Path:
    """Where this host keeps the export of the model whose files are ``identity``."""
    key = json.dumps({"model": identity, **releases()}, sort_keys=True)
    return exports_dir() / hashlib.sha256(key.encode()).hexdigest()[:32]


def exported(folder: Path) -> bool:
    return (folder / EXPORTED_MARK).is_file()


def load(make: Callable[[str], Any], path: str, identity: str | None, precision: str) -> Any:
    """``make(path)``, the model on OpenVINO: from this host's export of it, made first (by one
    worker at a time: a second waits, then reads it) where there is none; workers read an export
    that is there at once (under the lock, a second worker's load waited 1.2 s for the first's).
    ``identity`` None (files fetched by this very load): exported for this load alone. int8: the
    folder's own quantized model, which is nothing to export."""
    if precision == INT8:
        why = missing_quantized(path if os.path.isdir(path) else None, path)
        if why is not None:
            raise ConfigError(why)
        return make(path)
    if identity is None:
        with _exporting():
            return make(path)
    folder = export_folder(identity)
    if exported(folder):  # whole once marked, and never written again: read without the lock
        return make(str(folder))
    folder.parent.mkdir(parents=True, exist_ok=True)
    with export_lock(folder.with_name(folder.name + LOCK_SUFFIX)):
        if exported(folder):
            return make(str(folder))
        log.info("exporting the model to OpenVINO, once for this host, into %s", folder)
        with _exporting():
            model = make(path)
        keep_export(model, folder, identity, path)
        return model


@contextlib.contextmanager
def export_lock(path: Path) -> Iterator[None]:
    """The lock file ``path``, held (released when the file closes, or the process dies). ``cache
    exports --clean`` unlinks a lock no one holds (ov_exports), which may come between this open and
    this flock: a lock on an unlinked file excludes no one (a second exporter makes a new file and
    exports beside the first), so it is taken again on the file the path names now."""
    while True:
        with open(path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                current = os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino
            except FileNotFoundError:
                current = False
            if current:
                yield
                return


class _SavedBelow(logging.Filter):
    """sentence-transformers warns that it exports and advises saving the export; chunkq says it
    exports in a line of its own and keeps the export (``keep_export``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        said = record.getMessage()
        return not (
            said.startswith("Saving the exported OpenVINO") or "Exporting the model to OpenVINO" in said
        )


@contextlib.contextmanager
def _exporting() -> Iterator[None]:
    """An export traces the PyTorch model: its tracer's warnings (a Python bool in the graph, as
    expected of attention masks) would fill every worker's log once per export."""
    import torch

    said = logging.getLogger("sentence_transformers.backend.utils")
    quiet = _SavedBelow()
    said.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)  # type: ignore[attr-defined]
            yield
    finally:
        said.removeFilter(quiet)


def keep_export(model: Any, folder: Path, identity: str, source: str) -> None:
    """Save the model just exported, whole, where the next load finds it: written beside and
    renamed into place, so a load never reads half an export; a host that cannot keep it exports
    again next time (said once). Its mark names the folder it was made from, for people."""
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}")
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp))
        (tmp / EXPORTED_MARK).write_text(json.dumps({"model": identity, "from": source, **releases()}))
        os.replace(tmp, folder)  # another worker's export landed first: theirs is as good
    except OSError as exc:
        if not exported(folder):
            log.warning(
                "cannot keep the OpenVINO export in %s (%s); the next load exports again", folder, exc
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
