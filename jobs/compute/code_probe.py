"""Submit's probe: a ``--trust-remote-code`` model loaded once on the CPU in a fresh interpreter, its
code listed (jobs/compute/model_code.py) before the run's identity is fixed; reused from this host's
last probe of the same files and options while every file it listed has the same bytes and the
installed distributions are the same.

    python -m chunkq.jobs.compute.code_probe REQUEST_JSON OUT_JSON   # what ``probe`` starts
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from chunkq.jobs.compute.model_code import ACCEPT_FLAG, Listing, from_json, sha256_of
from chunkq.jobs.contract.errors import ConfigError

log = logging.getLogger(__name__)
PROBE_SECONDS = 1800  # a model of tens of GB loads on the CPU in minutes; the probe is bounded all the same


def probe(ref: str, options: dict[str, Any], identity: str) -> Listing:
    """The listing of ``ref``'s load with ``options`` (``EncodeOptions.to_dict``), made by a fresh
    interpreter on the CPU; reused from this host's last probe of the same files and options while
    every file it listed has the same bytes and the installed distributions are the same."""
    memo = _memo_path(ref, options, identity)
    reused = _reuse(memo)
    if reused is not None:
        return reused
    with tempfile.TemporaryDirectory(prefix="chunkq-code-") as tmp:
        out = Path(tmp) / "listing.json"
        request = json.dumps({"model": ref, "options": options})
        cmd = [sys.executable, "-m", "chunkq.jobs.compute.code_probe", request, str(out)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_SECONDS, check=False)
        except subprocess.TimeoutExpired:
            raise ConfigError(_cannot(ref, f"its load ran past {PROBE_SECONDS} s")) from None
        if done.returncode != 0 or not out.is_file():
            why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:300]
            raise ConfigError(_cannot(ref, f"its load failed: {why}"))
        data = json.loads(out.read_text())
    listing = from_json(data)
    if not listing.unidentified:
        _remember(memo, listing)
    return listing


def _cannot(ref: str, why: str) -> str:
    return (
        f"model {ref}: chunkq loads a model that brings its own code once on the CPU at submit, to "
        f"identify the code it runs, and {why}; give {ACCEPT_FLAG} to run it without that (its files "
        "alone are compared, and no vector cache is used)"
    )


def _installed() -> list[str]:
    from importlib.metadata import distributions

    return sorted({f"{d.metadata['Name']}=={d.version}" for d in distributions()})


def _memo_path(ref: str, options: dict[str, Any], identity: str) -> Path | None:
    from chunkq.jobs.contract.storage import user_cache_dir

    try:
        folder = user_cache_dir() / "model-code"
    except ConfigError:
        return None
    key = json.dumps([ref, options, identity, sys.executable, sys.path, _installed()], sort_keys=True)
    return folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _reuse(memo: Path | None) -> Listing | None:
    try:
        listing = from_json(json.loads(memo.read_text())) if memo is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if listing is None:
        return None
    for name, sha, _ in listing.files:
        try:
            if sha256_of(listing.paths[name]) != sha:
                return None
        except (OSError, KeyError):
            return None
    return listing


def _remember(memo: Path | None, listing: Listing) -> None:
    if memo is None:
        return
    from chunkq.jobs.contract.storage import private_dirs

    data = listing.to_record()
    try:
        private_dirs(memo.parent)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, memo)
    except OSError as exc:  # a memo: the next submit probes again
        log.debug("model code memo not written (%s)", exc)


def _probe_main(request: str, out: str) -> None:
    """In the probe's own interpreter: load as a worker loads, warm up, write the listing."""
    from chunkq.jobs.compute import model_reads, models
    from chunkq.jobs.contract.specs import EncodeOptions

    model_reads.no_working_directory_imports()
    asked = json.loads(request)
    options = EncodeOptions.from_dict(asked["options"])
    loaded = models.get_model(asked["model"], "cpu", "fp32", options)
    listing = loaded.code if loaded.code is not None else Listing()
    Path(out).write_text(json.dumps(listing.to_record()))


if __name__ == "__main__":
    _probe_main(sys.argv[1], sys.argv[2])
