"""The memory this process may use: the host's, or less where a cgroup limits it.

``psutil.virtual_memory()`` reads /proc/meminfo, which is the host's inside a container or a Slurm
job: a pool under ``--mem`` (Slurm's cgroup plugin), ``docker run --memory`` or a Kubernetes memory
limit sized its CPU workers by the host's memory. Seen here (2 cores, 23 GiB, a v1 memory cgroup of
480 MiB): two workers of the bundled model, killed on the limit three generations over, then "no
device left to run workers on" (exit 8); sized by the limit, one worker, and the run finished. The
limit is the least over the process's own cgroup and each one above it (Slurm limits the job, not
the step or task it runs in); what is used there counts the page cache the kernel would reclaim
first, so that part (inactive file pages) counts as free, as ``docker stats`` and the kubelet count
it.

Both hierarchies: cgroup v2 (``memory.max``, ``memory.current``) and v1 (``memory.limit_in_bytes``,
``memory.usage_in_bytes``). In a container with its own cgroup namespace the mount's root is its
cgroup; without one (v1 Docker) /proc/self/cgroup names a path the container cannot see, and the
deepest part of it that exists is where the walk starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import psutil

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# v1 writes "no limit" as the largest page-aligned number (9223372036854771712 on x86-64).
_V1_UNLIMITED = 1 << 62
HOST = "the host"


@dataclass(frozen=True)
class MemoryRoom:
    total: int  # bytes this process may hold at most: the host's, or the tightest cgroup limit
    available: int  # bytes it may still take
    limited_by: str  # HOST or the cgroup folder whose limit binds

    @property
    def limited(self) -> bool:
        return self.limited_by != HOST

    @property
    def source(self) -> str:
        """Whose memory it is, in the words of the pool's lines."""
        return f"the memory limit of cgroup {self.limited_by}" if self.limited else "this host's memory"


def memory_room(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> MemoryRoom:
    host = psutil.virtual_memory()
    room = MemoryRoom(int(host.total), int(host.available), HOST)
    try:
        return _tightest(room, _own_folders(proc_cgroup, root))
    except (OSError, ValueError):  # what no kernel writes: the host's memory, as before
        return room


def _tightest(room: MemoryRoom, folders: list[tuple[Path, int]]) -> MemoryRoom:
    for folder, version in folders:
        limit = _limit(folder, version)
        if limit is None:
            continue
        left = max(0, limit - _used(folder, version))
        if left < room.available or limit < room.total:
            shown = os.fsencode(folder).decode("utf-8", "backslashreplace")  # any bytes, printable
            room = MemoryRoom(min(limit, room.total), min(left, room.available), shown)
    return room


def _own_folders(proc_cgroup: Path, root: Path) -> list[tuple[Path, int]]:
    """The memory controller's folders of this process's cgroup and each above it, deepest first,
    each with its hierarchy's version."""
    try:
        # A cgroup's name is any bytes (the hostile pass: one not UTF-8 ended the pool).
        lines = proc_cgroup.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    except OSError:
        return []
    found: list[tuple[Path, int]] = []
    for line in lines:
        number, controllers, path = [*line.split(":", 2), "", ""][:3]
        if number == "0" and controllers == "":
            mount, version = (root if (root / "cgroup.controllers").exists() else root / "unified"), 2
        elif "memory" in controllers.split(","):
            mount, version = root / "memory", 1
        else:
            continue
        if not mount.is_dir():
            continue
        parts = [p for p in path.strip().split("/") if p and p not in (".", "..")]
        while parts and not (mount.joinpath(*parts)).is_dir():
            parts.pop()  # a path outside this namespace's view: its deepest visible part
        while True:
            found.append((mount.joinpath(*parts), version))
            if not parts:
                break
            parts.pop()
    return found


def _number(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        return None
    return int(text) if text.isdigit() else None  # "max" (v2): no limit


def _limit(folder: Path, version: int) -> int | None:
    limit = _number(folder / ("memory.max" if version == 2 else "memory.limit_in_bytes"))
    return None if limit is None or limit >= _V1_UNLIMITED else limit


def _used(folder: Path, version: int) -> int:
    used = _number(folder / ("memory.current" if version == 2 else "memory.usage_in_bytes")) or 0
    reclaimable = "inactive_file" if version == 2 else "total_inactive_file"
    try:
        for line in (folder / "memory.stat").read_text(encoding="ascii", errors="replace").splitlines():
            name, _, value = line.partition(" ")
            if name == reclaimable and value.strip().isdigit():
                return max(0, used - int(value))
    except OSError:
        pass
    return used


def oom_kills(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> int:
    """The kills the kernel's OOM killer counted in this process's cgroups (each level's ``oom_kill``:
    v2's memory.events, v1's memory.oom_control); 0 where none says."""
    total = 0
    try:
        for folder, version in _own_folders(proc_cgroup, root):
            name = "memory.events" if version == 2 else "memory.oom_control"
            with contextlib.suppress(OSError, ValueError):
                for line in (folder / name).read_text(encoding="ascii", errors="replace").splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and value.strip().isdigit():
                        total += int(value)
    except (OSError, ValueError):
        return 0
    return total


class OomWatch:
    """Says when a worker the pool saw SIGKILLed was the OOM killer's (a memory limit), which "killed
    by SIGKILL" alone did not (the hostile pass: five such deaths, and no line named memory)."""

    def __init__(self) -> None:
        self.seen = oom_kills()

    def reason(self, returncode: int) -> str | None:
        """What to add to a worker's exit ``returncode``'s reason: None unless the OOM killer's."""
        if returncode != -signal.SIGKILL:
            return None
        now = oom_kills()
        if now <= self.seen:
            return None
        self.seen = now
        room = memory_room()
        return f"(the kernel's OOM killer: {room.source}, {room.total / 2**30:.1f} GiB)"
