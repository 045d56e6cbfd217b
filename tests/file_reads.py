"""Which files a chunkq command and every process it starts read, and from where (issue 54.2).

``reading_env(folder)`` gives a command's environment a ``sitecustomize`` that logs, through an audit
hook, each file under ``folder`` opened for reading, with the process and chunkq's own frames that
opened it; ``reads(log)`` counts them: one read per call site, however many times numpy opens a file
to load it once.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

_HOOK = """
import os, sys, traceback
_log, _under = os.environ.get("CHUNKQ_TEST_READS_LOG"), os.environ.get("CHUNKQ_TEST_READS_UNDER", "")
if _log and _under:
    _fd, _busy = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), [False]
    _ours = ("/jobs/", "/queue_worker/", "/supervisor/", "/chunkq/")

    def _hook(event, args):
        if event != "open" or _busy[0] or isinstance(args[0], int):
            return
        path, mode, flags = args
        try:
            name = os.path.abspath(os.fsdecode(os.fspath(path)))
        except TypeError:
            return
        writes = any(c in mode for c in "wax+") if mode else flags & (os.O_WRONLY | os.O_RDWR)
        if writes or not name.startswith(_under):
            return
        _busy[0] = True
        try:
            frames = [f for f in traceback.extract_stack()[:-1] if any(p in f.filename for p in _ours)]
            where = ";".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in frames)
            os.write(_fd, f"{os.getpid()}\\t{name[len(_under):]}\\t{where}\\n".encode())
        finally:
            _busy[0] = False

    sys.addaudithook(_hook)
"""


def reading_env(folder: Path, hook_dir: Path) -> dict[str, str]:
    """Environment variables that make every Python process of a command log its reads under
    ``folder`` to ``hook_dir/reads.log``."""
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(_HOOK)
    path = os.pathsep.join(p for p in (str(hook_dir), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "PYTHONPATH": path,
        "CHUNKQ_TEST_READS_LOG": str(hook_dir / "reads.log"),
        "CHUNKQ_TEST_READS_UNDER": str(folder.resolve()) + os.sep,
    }


def reads(log: Path, what: dict[str, str]) -> Counter[str]:
    """Reads by kind: ``what`` maps a kind to a regular expression of the path (under the folder);
    a file opened again by the same process from the same frames (numpy's memory map) is one read."""
    counted: Counter[str] = Counter()
    last = None
    for line in log.read_text().splitlines() if log.exists() else []:
        pid, path, where = line.split("\t")
        if (pid, path, where) == last:
            continue
        last = (pid, path, where)
        for kind, pattern in what.items():
            if re.fullmatch(pattern, path):
                counted[kind] += 1
    return counted
