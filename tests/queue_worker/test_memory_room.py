"""The memory a pool sizes its CPU workers by is a cgroup's limit where one binds (Slurm's --mem,
docker --memory, a Kubernetes limit), not the host's. One test in a real memory cgroup made here
(where this host lets a test make one), the others on folders laid out as the kernel shows them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkq.queue_worker.devices.memory_room import PROC_CGROUP, memory_room

GIB = 1 << 30


def _write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_a_slurm_jobs_limit_above_its_task_binds_on_cgroup_v2(tmp_path: Path) -> None:
    """Slurm's cgroup/v2 plugin limits the job; the task's own folder says "max"."""
    root = tmp_path / "sys-fs-cgroup"
    _write(root, cgroup_controllers="cpuset cpu io memory pids\n")
    job = root / "system.slice" / "slurmstepd.scope" / "job_7"
    _write(
        job,
        memory_max=f"{2 * GIB}\n",
        memory_current=f"{GIB + GIB // 2}\n",
        memory_stat=f"anon 1\ninactive_file {GIB // 2}\n",
    )
    _write(job / "step_0" / "user" / "task_0", memory_max="max\n", memory_current="4096\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n")
    room = memory_room(proc, root)
    assert (room.total, room.available, room.limited_by) == (2 * GIB, GIB, str(job))  # cache counted free


def test_a_v1_container_without_its_own_namespace_reads_its_mounts_root(tmp_path: Path) -> None:
    """Docker on cgroup v1: /proc/self/cgroup names /docker/<id>, which the container cannot see; its
    /sys/fs/cgroup/memory is its own cgroup."""
    root = tmp_path / "sys-fs-cgroup"
    _write(
        root / "memory",
        memory_limit_in_bytes=f"{GIB}\n",
        memory_usage_in_bytes=f"{GIB // 4}\n",
        memory_stat=f"cache 9\ntotal_inactive_file {GIB // 4}\n",
    )
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/docker/abc\n")
    room = memory_room(proc, root)
    assert (room.total, room.available, room.limited_by) == (GIB, GIB, str(root / "memory"))


def test_no_limit_is_the_hosts_memory(tmp_path: Path) -> None:
    root = tmp_path / "sys-fs-cgroup"
    _write(
        root / "memory" / "user", memory_limit_in_bytes="9223372036854771712\n", memory_usage_in_bytes="1\n"
    )
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/user\n")
    assert memory_room(proc, root).limited_by == "the host"
    assert memory_room(tmp_path / "no-such-file", root).limited_by == "the host"


@pytest.fixture
def limited_cgroup() -> Iterator[Path]:
    """A child of this process's v1 memory cgroup limited to 1 GiB, or a skip where none can be made."""
    own = [line.split(":", 2)[2] for line in PROC_CGROUP.read_text().splitlines() if ":memory:" in line]
    folder = Path(
        "/sys/fs/cgroup/memory", *(own[0].strip("/").split("/") if own else []), f"chunkq-test-{os.getpid()}"
    )
    try:
        folder.mkdir()
        (folder / "memory.limit_in_bytes").write_text(str(GIB))
    except OSError as exc:
        pytest.skip(f"cannot make a v1 memory cgroup here ({exc})")
    try:
        yield folder
    finally:
        folder.rmdir()


def _inside(cgroup: Path, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a Python that moved itself into ``cgroup`` first."""
    moved = f"import os\nopen({str(cgroup / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
    return subprocess.run(
        [sys.executable, "-c", moved + code], capture_output=True, text=True, timeout=120, check=True
    )


def test_a_pool_in_a_memory_cgroup_sizes_its_cpu_workers_by_the_limit(limited_cgroup: Path) -> None:
    """Two cores and 20+ GiB on this host: two workers of the bundled model (90 MB + 512 MiB each)
    unconstrained; under a 1 GiB limit, one."""
    limited = _inside(
        limited_cgroup,
        "import logging\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from chunkq.jobs.compute.model_refs import BUNDLED_MODEL\n"
        "from chunkq.queue_worker.devices.gpus import resolve_cpu_workers\n"
        "from chunkq.queue_worker.devices.memory_room import memory_room\n"
        "room = memory_room()\n"
        "print(room.total, room.limited_by, resolve_cpu_workers(None, BUNDLED_MODEL))\n",
    )
    total, where, workers = limited.stdout.split()
    assert (int(total), where, workers) == (GIB, str(limited_cgroup), "1"), limited.stderr[-2000:]
    assert f"(the memory limit of cgroup {limited_cgroup})" in limited.stderr  # the pool's one line says why


def test_a_cgroup_name_that_is_not_utf8_is_read_and_shown(tmp_path: Path) -> None:
    """The hostile pass: a cgroup named with a byte that is not UTF-8 ended the pool
    (UnicodeDecodeError reading /proc/self/cgroup); any bytes are a cgroup's name."""
    root = tmp_path / "sys-fs-cgroup"
    odd = os.fsdecode(b"hq_\xff")
    _write(root / "memory" / odd, memory_limit_in_bytes=f"{GIB}\n", memory_usage_in_bytes="0\n")
    proc = tmp_path / "cgroup"
    proc.write_bytes(b"4:memory:/hq_\xff\n")
    room = memory_room(proc, root)
    assert room.total == GIB and room.limited_by.endswith("hq_\\xff")  # printable in the pool's log
    proc.write_bytes(b"4:memory:/hq_\xff\n\xfe\xff garbage with no colons\n")
    assert memory_room(proc, root).total == GIB


def test_memory_that_holds_no_worker_says_so() -> None:
    """The hostile pass: under 200 MiB the line said "holds 1" and the worker was killed five times
    on the limit with nothing naming memory."""
    from chunkq.queue_worker.devices.gpus import TOO_LITTLE_MEMORY, auto_cpu_workers

    workers, why = auto_cpu_workers(2, 90 << 20, 200 << 20, " (the memory limit of cgroup /x)")
    assert workers == 1 and "holds 0" in why and TOO_LITTLE_MEMORY in why and "cgroup /x" in why
    assert TOO_LITTLE_MEMORY not in auto_cpu_workers(2, 90 << 20, 2 * GIB)[1]


def test_a_worker_killed_on_the_memory_limit_is_said_to_be(limited_cgroup: Path) -> None:
    """What the pool adds to "killed by SIGKILL" when the kernel's OOM killer counted a kill in its
    cgroups since the last it saw: a child that touches 2 GiB under the 1 GiB limit."""
    seen = _inside(
        limited_cgroup,
        "import signal, subprocess, sys\n"
        "from chunkq.queue_worker.devices.memory_room import OomWatch\n"
        "watch = OomWatch()\n"
        "print(watch.reason(-signal.SIGKILL))\n"
        "hog = 'x = bytearray(2 << 30); x[::4096] = bytes(len(x) // 4096)'\n"
        "code = subprocess.run([sys.executable, '-c', hog]).returncode\n"
        "print(code == -signal.SIGKILL, '|', watch.reason(code), '|', watch.reason(code))\n",
    )
    before, after = seen.stdout.splitlines()
    assert before == "None", seen.stdout
    assert (
        after
        == f"True | (the kernel's OOM killer: the memory limit of cgroup {limited_cgroup}, 1.0 GiB) | None"
    )
