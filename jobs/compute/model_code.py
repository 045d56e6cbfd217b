"""The code a ``--trust-remote-code`` model runs, identified by what its load and first encode read.

sentence-transformers 6 imports a module class from outside its own package, and transformers a
config's ``auto_map`` code, only under ``trust_remote_code``; that code may import any installed module
and read any file, so no reading of the model's folder can say what it runs (a hostile pass changed a
helper package such a class imported, and a data file it read: every row came from the cache,
max abs diff 1.25 and 15.2). Such a load is therefore watched: a Python audit hook (PEP 578) sees
every module imported and every file opened while the model loads and encodes a warm-up input,
and every file read that way is hashed, the *listing*, unless it is one of:

- the model's own files (the identity hashed them), the standard library, ``/proc``, ``/sys``,
  ``/dev`` and the system's own libraries (``/usr/lib``, ``/lib``);
- chunkq, and the distributions chunkq itself requires, with theirs (torch, transformers,
  sentence-transformers, numpy...): the environment every worker shares, whose releases of
  sentence-transformers, transformers, tokenizers and torch are in the vector cache's key;
- the hub's token file (a credential, not code); ``__pycache__`` bytecode: a watched load reads
  none, and writes none, every module it imports is compiled from its source, which is listed.

The listing's digest is part of the model's identity (``+code:<digest>``): the submit loads the
model once on the CPU in a fresh interpreter to make it (``code_probe``; a later submit on this host
re-hashes the files the last probe listed and reuses it when every byte and the installed
distributions are the same), and each worker makes its own at its load. A worker whose listing
differs is refused before it encodes a row, naming the files. What cannot be identified (a
connection opened, another program run) refuses the run in one line, unless
``--accept-unidentified-code`` accepts the risk by name: the run then compares the model's files
alone and uses no vector cache. After the load a worker goes on watching (``LateReads``): what the
code reads only on some inputs keeps the run's vectors out of the cache. What no listing sees:
environment variables, what native code reads, and a change to one of chunkq's own requirements
other than a new release (docs/cache.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from chunkq.jobs.compute.shared_environment import environment, under

T = TypeVar("T")

UNIDENTIFIED = "unidentified"  # the identity's code part when the run accepted that risk by name
CODE_TAG = "+code:"
ACCEPT_FLAG = "--accept-unidentified-code"
# Audit events of a load that reaches beyond the files it reads: what another program does is not seen.
_RUNS_PROGRAMS = frozenset({"subprocess.Popen", "os.system", "os.posix_spawn", "os.exec", "os.spawn"})


@dataclass(frozen=True)
class Listing:
    """What a load read beyond its folder and the shared environment: (name, sha256, package) per
    file, a name being the path below its import root (the same on every host of one environment)
    or, outside any, the absolute path; and what could not be identified, each in words."""

    files: tuple[tuple[str, str, str], ...] = ()
    unidentified: tuple[str, ...] = ()
    paths: dict[str, str] = field(default_factory=dict, compare=False)  # name -> this host's path
    # The load's vectors of CANARY_TEXTS (a dense model's), rows of floats: what its code does, seen
    # from outside, whatever it read to do it (canary_difference).
    canary: list[list[float]] | None = field(default=None, compare=False)

    def digest(self) -> str:
        data = json.dumps([list(f) for f in self.files], separators=(",", ":")).encode()
        return hashlib.sha256(data).hexdigest()[:16]

    def to_json(self) -> list[dict[str, str]]:
        return [{"name": n, "sha256": s, "package": p} for n, s, p in self.files]

    def to_record(self) -> dict[str, Any]:
        """The listing whole, with this host's paths and its canary: what the probe hands back."""
        return {
            "files": self.to_json(),
            "unidentified": list(self.unidentified),
            "paths": self.paths,
            "canary": self.canary,
        }

    def differences(self, run: list[dict[str, Any]] | None) -> list[str]:
        """How this listing differs from the run's (``to_json``), file by file, in words."""
        theirs = {str(f.get("name")): str(f.get("sha256")) for f in run or [] if isinstance(f, dict)}
        mine = {n: s for n, s, _ in self.files}
        found = [f"{n}: other bytes" for n in sorted(mine.keys() & theirs.keys()) if mine[n] != theirs[n]]
        found += [f"{n}: read here, not by the run's load" for n in sorted(mine.keys() - theirs.keys())]
        found += [f"{n}: read by the run's load, not here" for n in sorted(theirs.keys() - mine.keys())]
        return found


def with_code(identity: str, listing: Listing | None) -> str:
    """A model's identity with its code part: the listing's digest, or ``unidentified`` (None)."""
    return identity + CODE_TAG + (UNIDENTIFIED if listing is None else listing.digest())


def files_part(identity: str) -> str:
    """An identity without its code part: what the model's files alone are."""
    return identity.split(CODE_TAG, 1)[0]


def accepted_unidentified(identity: str | None) -> bool:
    return identity is not None and identity.endswith(CODE_TAG + UNIDENTIFIED)


def merged(earlier: Listing | None, now: Listing) -> Listing:
    """What every load of one model in one process read: a module an earlier load imported is not
    read again, yet the later load runs it (as it was read then)."""
    if earlier is None:
        return now
    files = {n: (n, s, p) for n, s, p in earlier.files} | {n: (n, s, p) for n, s, p in now.files}
    unidentified = tuple(dict.fromkeys(earlier.unidentified + now.unidentified))
    paths, canary = {**earlier.paths, **now.paths}, now.canary if now.canary is not None else earlier.canary
    return Listing(tuple(sorted(files.values())), unidentified, paths, canary)


# Texts every load of a model that brings its own code encodes while it is watched: a word, a
# sentence, a text past any model's maximum length (its truncated path: code can read a file only
# for long inputs), and one outside ASCII. Their vectors are the code's behaviour seen from outside.
CANARY_TEXTS = (
    "canary",
    "A plain sentence of an ordinary length, about a river, a bridge and the town between them.",
    " ".join(f"word{i} and more" for i in range(400)),
    "Ünïcödé, 数字 123, punctuation: (a) [b] {c}!",
)
SAME_BEHAVIOUR_COSINE = 0.999  # a canary row at least this close on another host or device: same code
SAME_CACHE_DIFF = 1e-4  # what the cache holds must come from code whose canary is this close (CPU, fp32)


def canary_vectors(model: Any, kind: str) -> list[list[float]] | None:
    """A dense model's vectors of CANARY_TEXTS, as plain floats (None for other kinds: their rows
    are scores or tokens, and their own warm-up runs instead)."""
    from chunkq.jobs import kinds

    if not kinds.get(kind).canary:
        return None
    import numpy as np

    vectors = model.encode(list(CANARY_TEXTS), batch_size=len(CANARY_TEXTS), convert_to_numpy=True)
    return np.asarray(vectors, dtype=np.float64).tolist()  # type: ignore[no-any-return]


def canary_difference(mine: list[list[float]] | None, theirs: Any) -> tuple[float, float] | None:
    """(the largest absolute difference, the lowest cosine) between two canaries' rows; None where
    either is missing or they are not of one shape."""
    import numpy as np

    if mine is None or not isinstance(theirs, list) or not theirs:
        return None
    a, b = np.asarray(mine, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        return None
    return float(np.abs(a - b).max()), float(row_cosines(a, b).min())


def row_cosines(a: Any, b: Any) -> Any:
    """The cosine of each row of ``a`` with the same row of ``b`` (0 for a row of zeros)."""
    import numpy as np

    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)


# --- recording ---------------------------------------------------------------------------------

_RELATIVE_OPEN = "it opens "  # an os.open whose folder its event does not say: never identified
NO_BYTECODE = os.path.join(os.devnull, "chunkq-reads-no-bytecode")  # below a file: never a folder
_SEEN: list[_Seen] = []  # the recording under way (one at a time), seen by every thread's events
_record_lock = threading.Lock()
_hooked = False


@dataclass
class _Seen:
    opened: list[str] = field(default_factory=list)
    elsewhere: list[str] = field(default_factory=list)  # what the load reached beyond files


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _SEEN and not _LATE:  # the hook stays for the process's life (PEP 578): cheap when idle
        return
    for seen in (*_SEEN[:1], *(late.seen for late in _LATE[:1])):  # whichever thread reads
        _note(seen, event, args)


def _note(seen: _Seen, event: str, args: tuple[Any, ...]) -> None:
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int) or not _reads(mode, flags):
            return
        try:
            text = os.fsdecode(path)
        except (TypeError, ValueError):
            return
        if mode is None and not os.path.isabs(text):
            # os.open's event does not say its dir_fd: a relative path may be below any folder held
            # open (the hostile pass read a data file so, unlisted: 40 rows from a stale cache)
            seen.elsewhere.append(
                f"{_RELATIVE_OPEN}{text!r} relative to a folder it cannot be told (os.open)"[:200]
            )
        seen.opened.append(os.path.abspath(text))
    elif event in ("socket.connect", "socket.sendto", "socket.sendmsg"):
        verb = "connects to" if event == "socket.connect" else "sends to"
        seen.elsewhere.append(f"it {verb} {args[1]!r}"[:200])
    elif event in _RUNS_PROGRAMS:
        seen.elsewhere.append(f"it runs another program ({event}: {str(args[0])[:120]})")
    elif event == "ctypes.dlopen":
        _native(seen, args[0])


def _native(seen: _Seen, name: Any) -> None:
    """A library the load opens through ctypes: its file is read like any other; the process's own
    symbols (``CDLL(None)``: libc's ``system``, say) are code no file names."""
    if name is None:
        seen.elsewhere.append("it calls the process's own native code (ctypes.CDLL(None))")
        return
    try:
        text = os.fsdecode(name)
    except (TypeError, ValueError):
        return
    if os.sep in text:  # a library found by the loader's search is among the files mapped meanwhile
        seen.opened.append(os.path.abspath(text))


def _reads(mode: Any, flags: Any) -> bool:
    if isinstance(mode, str):
        return not set(mode) & set("wax+")
    return isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR) == 0


def record(load: Callable[[], T], covered: set[str]) -> tuple[T, Listing]:
    """``load()``'s value and the listing of what it read (``covered``: the real paths the model's
    identity hashed). Modules it imported are found as new entries of ``sys.modules``: an
    extension module is mapped by the loader, which no open event shows."""
    global _hooked
    with _record_lock:  # one recording at a time: every thread's events are this one's
        if not _hooked:
            sys.addaudithook(_audit)
            _hooked = True
        before, mapped = set(sys.modules), _mapped_files()
        callers = _callers()
        seen = _Seen()
        _SEEN.append(seen)
        bytecode = sys.pycache_prefix, sys.dont_write_bytecode
        # What is imported meanwhile runs from its source, which the listing hashes: a module's
        # __pycache__ is trusted by its source's mtime and size alone, so a forged .pyc ran unseen.
        sys.pycache_prefix, sys.dont_write_bytecode = NO_BYTECODE, True
        try:
            value = load()
        finally:
            _SEEN.clear()
            sys.pycache_prefix, sys.dont_write_bytecode = bytecode
        unidentified = list(seen.elsewhere)
        read = list(seen.opened)
        read += filter(None, map(_module_file, sorted(set(sys.modules) - before)))
        # Files mapped meanwhile (shared libraries, whatever native code maps): no open event shows them.
        read += sorted(_mapped_files() - mapped)
        return value, _listing(read, covered | callers, unidentified)


class LateReads:
    """What the code of a watched model reads after its load, in any thread (an import, or a file,
    that only some inputs reach: the hostile pass's lazy import, and a module a thread imported after
    the second forward, each changed after a run, were served from the cache). The worker drains it
    after each chunk's encode (what a thread read between chunks counts too); a chunk whose code
    read what its load did not, or other bytes of it, says so, and the run's vectors stay out of the
    vector cache. Imports from then on compile from source."""

    def __init__(self, load: Listing, covered: set[str]) -> None:
        self.listed, self.covered = set(load.files), set(covered)
        self.seen, self.modules, self.mapped = _Seen(), set(sys.modules), _mapped_files()

    def also(self, load: Listing, covered: set[str]) -> None:
        self.listed |= set(load.files)
        self.covered |= covered

    def drain(self, store: str) -> list[str]:
        """The files read since the last drain that the loads did not list with these bytes, but for
        those below ``store`` (the worker's own: the chunk's input, the run's manifest)."""
        seen, self.seen = self.seen, _Seen()
        modules, mapped = set(sys.modules), _mapped_files()
        read = seen.opened + list(filter(None, map(_module_file, sorted(modules - self.modules))))
        read += sorted(mapped - self.mapped)
        read = [path for path in read if not under(os.path.realpath(path), frozenset({store}))]
        self.modules, self.mapped = modules, mapped
        listing = _listing(read, self.covered, [])
        late = [name for name, sha, package in listing.files if (name, sha, package) not in self.listed]
        return late + [why for why in seen.elsewhere if why.startswith(_RELATIVE_OPEN)]


_LATE: list[LateReads] = []  # the process's watch after its loads (a worker of a model with code)


def watch_after_load(load: Listing, covered: set[str]) -> None:
    """Go on watching what the model's code reads once ``load`` was recorded (see ``LateReads``)."""
    with _record_lock:
        if _LATE:
            _LATE[0].also(load, covered)
            return
        _LATE.append(LateReads(load, covered))
        sys.pycache_prefix, sys.dont_write_bytecode = NO_BYTECODE, True


def late_reads(store: str) -> list[str]:
    """What the watched code read since the last call that its loads did not, but for the files
    below ``store`` (see ``LateReads``)."""
    with _record_lock:
        return _LATE[0].drain(os.path.realpath(store)) if _LATE else []


def _mapped_files() -> set[str]:
    """The files this process has mapped (Linux's /proc/self/maps); empty elsewhere."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return set()
    found = set()
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/") and not parts[5].endswith(" (deleted)"):
            found.add(parts[5])
    return found


def _callers() -> set[str]:
    """The files of the code that asked for the load (every frame above it): a warning raised in the
    load reads its caller's source line to show it, which is the caller's code, not the model's."""
    found = set()
    frame = sys._getframe(1)
    while frame is not None:
        found.add(os.path.realpath(frame.f_code.co_filename))
        frame = frame.f_back  # type: ignore[assignment]
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return found | ({os.path.realpath(main)} if main else set())


def _module_file(name: str) -> str | None:
    """A module's file, where it was loaded from one. A module made otherwise (built in, a namespace,
    one a library builds at run time) brings no code of its own: what made it was read from a file."""
    spec = getattr(sys.modules.get(name), "__spec__", None)
    origin = getattr(spec, "origin", None)
    if not getattr(spec, "has_location", False) or not origin or not os.path.isfile(origin):
        return None
    return os.path.abspath(str(origin))


def _listing(read: list[str], covered: set[str], unidentified: list[str]) -> Listing:
    exempt = environment()
    roots = _import_roots()
    files: dict[str, tuple[str, str]] = {}
    paths: dict[str, str] = {}
    for path in read:
        real = os.path.realpath(path)
        if real in covered or under(real, exempt) or "__pycache__" in Path(real).parts:
            continue
        if not os.path.isfile(real):
            continue  # opened and failed, or a folder: nothing was read from it
        name = _name(real, roots)
        if name in files:
            continue
        try:
            files[name] = (sha256_of(real), _package(name, real))
        except OSError as exc:
            unidentified.append(f"{real} could not be read again ({exc.strerror})")
            continue
        paths[name] = real
    entries = tuple(sorted((n, s, p) for n, (s, p) in files.items()))
    return Listing(entries, tuple(dict.fromkeys(unidentified)), paths)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _import_roots() -> list[str]:
    roots = {os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)}
    return sorted(roots, key=len, reverse=True)


def _name(real: str, roots: list[str]) -> str:
    for root in roots:
        if real.startswith(root + os.sep):
            return os.path.relpath(real, root)
    return real


def _package(name: str, real: str) -> str:
    """The installed distribution that provides a listed file, as ``name==release`` ("" if none)."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    top = Path(name).parts[0] if not os.path.isabs(name) else ""
    top = top.removesuffix(".py").split(".")[0]
    try:  # any distribution's damaged metadata costs the label, never the run
        owners = packages_distributions().get(top, [])
    except (OSError, ValueError, KeyError):
        return ""
    for dist in owners:
        try:
            return f"{dist}=={version(dist)}"
        except (PackageNotFoundError, ValueError):
            continue
    return ""


def from_json(data: dict[str, Any]) -> Listing:
    """A listing as ``to_record`` wrote it."""
    files = tuple((str(f["name"]), str(f["sha256"]), str(f["package"])) for f in data["files"])
    paths = {str(k): str(v) for k, v in data["paths"].items()}
    canary = data.get("canary")
    return Listing(
        files, tuple(map(str, data["unidentified"])), paths, canary if isinstance(canary, list) else None
    )
