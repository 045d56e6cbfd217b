"""The Slurm recipe (``examples/slurm/``) run for real: a one-node cluster of Debian's ``slurm-wlm``
and ``munge`` started here (slurmctld and slurmd as root, two "GPUs" that are plain device files,
so Slurm hands each pool job its own ``CUDA_VISIBLE_DEVICES`` as on a GPU node; the workers run on
the CPU), the recipe submitted with its own ``run.sh``, one pool job cancelled in the middle of a
chunk. `make test` installs the packages; outside CI a machine without them skips this file."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from chunkq.jobs.contract.process_clock import start_ticks
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.supervisor.server.embedded_redis import free_port
from tests.helpers import make_texts, result_matches, wait_for, write_corpus
from tests.tiny_models import bundled_copy

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "slurm"
DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sbatch", "squeue", "scancel", "sinfo")
MISSING = [tool for tool in DAEMONS + CLIENTS if shutil.which(tool) is None]
# Slurm waits this long between a job's SIGTERM and its SIGKILL (slurm.conf KillWait, 30 s by
# default): long enough for a drain to finish a 4 s chunk, short enough to cut a 600 s one.
KILL_WAIT = 15
DRAINED_CHUNK = 6  # its first attempt takes 4 s: the pool holding it is cancelled and finishes it
CUT_CHUNK = 10  # its first attempt takes 600 s: the pool holding it is requeued (preempted) and cut off
CLUSTER_DIR = "slurm"  # the folder of a cluster's files, its slurm.conf what its processes carry
OWNER_FILE = "owner"  # PID@START of the test process whose cluster it is

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(MISSING) and not os.environ.get("CI"),
        reason=f"{', '.join(MISSING)} not installed (make test installs slurm-wlm and munge)",
    ),
]


def _slurm_conf(base: Path, ctld_port: int, slurmd_port: int) -> str:
    return f"""\
ClusterName=chunkqtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={base}/munge/socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait={KILL_WAIT}
# The recipe's own CPU and memory requests, on whatever this machine has.
SlurmdParameters=config_overrides
GresTypes=gpu
NodeName=n1 NodeAddr=127.0.0.1 NodeHostname={socket.gethostname().split(".")[0]} State=UNKNOWN \\
    CPUs=32 RealMemory=262144 Gres=gpu:2
PartitionName=debug Nodes=n1 Default=YES MaxTime=INFINITE State=UP
"""


def _ours(conf: Path) -> list[psutil.Process]:
    """Every process of this cluster: the daemons and whatever its jobs started carry SLURM_CONF."""
    return [proc for proc, its_conf in _cluster_processes() if its_conf == str(conf)]


def _cluster_processes() -> Iterator[tuple[psutil.Process, str]]:
    """Each process of a cluster this file made, and its cluster's slurm.conf."""
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            conf = proc.environ().get("SLURM_CONF", "")
            if conf.endswith(f"/{CLUSTER_DIR}/slurm.conf"):
                yield proc, conf


def _owned(base: Path) -> None:
    (base / OWNER_FILE).write_text(f"{os.getpid()}@{start_ticks()}")


def _reap_orphaned_clusters() -> None:
    """Kill what is left of clusters whose test process is gone. A test process SIGKILLed (by a
    `timeout`, say) never runs its fixture's clean-up: the recipe's jobs then ran here for two hours,
    one a password-protected Redis on 0.0.0.0, another a supervisor hung in its exit trap's scancel."""
    for proc, conf in _cluster_processes():
        owner = Path(conf).parent / OWNER_FILE
        with contextlib.suppress(OSError, ValueError):
            pid, ticks = owner.read_text().split("@")
            if start_ticks(int(pid)) == ticks:
                continue  # a live test's cluster (another xdist worker's)
        with contextlib.suppress(psutil.Error):
            proc.kill()


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A one-node cluster; yields the environment its client commands need."""
    assert not MISSING, f"{', '.join(MISSING)} are needed in CI (make test installs them)"
    if os.geteuid() != 0:
        pytest.skip("slurmd runs jobs as their users only when it is root")
    _reap_orphaned_clusters()
    base = tmp_path / CLUSTER_DIR
    for sub in ("munge", "state", "spool"):
        (base / sub).mkdir(parents=True, mode=0o700)
    _owned(base)
    key = base / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = base / "slurm.conf"
    conf.write_text(_slurm_conf(base, free_port(), free_port()))
    # Two "GPUs": gres needs character devices, any will do; Slurm numbers them 0 and 1.
    (base / "gres.conf").write_text(
        "NodeName=n1 Name=gpu File=/dev/null\nNodeName=n1 Name=gpu File=/dev/zero\n"
    )
    (base / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started: list[subprocess.Popen[bytes]] = []

    def start(*cmd: str, log: str) -> None:
        with open(base / log, "wb") as out:
            started.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))

    munge = base / "munge"
    start(
        "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={munge}/socket",
        f"--pid-file={munge}/pid", f"--log-file={munge}/log", f"--seed-file={munge}/seed",
        log="munged.out",
    )  # fmt: skip
    try:
        wait_for(lambda: (munge / "socket").exists(), 30, "munged's socket")
        start("slurmctld", "-D", "-f", str(conf), log="slurmctld.out")
        start("slurmd", "-D", "-f", str(conf), "-N", "n1", log="slurmd.out")
        wait_for(lambda: _node_state(env) == "idle", 60, "the node to be idle", interval=0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True, timeout=30, check=False)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not _squeue(env), KILL_WAIT + 30, "jobs to end", interval=0.5)
        for proc in reversed(started):
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for proc in _ours(conf):  # a step daemon or job process its slurmd left behind
            with contextlib.suppress(psutil.Error):
                proc.kill()


def _node_state(env: dict[str, str]) -> str:
    return _client(env, "sinfo", "-h", "-N", "-o", "%t").strip()


def _squeue(env: dict[str, str], *states: str) -> list[str]:
    where = [f"--states={','.join(states)}"] if states else []
    return _client(env, "squeue", "-h", "-o", "%i %j %T", *where).split("\n")[:-1]


def _client(env: dict[str, str], *cmd: str) -> str:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30, check=False).stdout


def _pool_logs(logs: Path) -> dict[str, Path]:
    """The pool jobs' logs by array element (``JOB_TASK``), from chunkq-pool-%A_%a.log."""
    found = {}
    for path in logs.glob("chunkq-pool-*.log"):
        match = re.fullmatch(r"chunkq-pool-(\d+_\d+)\.log", path.name)
        if match:
            found[match.group(1)] = path
    return found


def _holding(logs: Path, chunk: int) -> str | None:
    for element, path in _pool_logs(logs).items():
        if f"__c{chunk:06d}" in path.read_text(errors="replace"):
            return element
    return None


def test_the_recipe_runs_on_slurm_and_cancelled_or_preempted_pools_lose_nothing(
    tmp_path: Path, slurm: dict[str, str], reference_model: Any
) -> None:
    ids, texts = make_texts(160, seed=36)
    corpus = write_corpus(tmp_path / "corpus.jsonl", ids, texts, "jsonl")
    store, logs = tmp_path / "store", tmp_path / "logs"
    logs.mkdir()
    run_id = "slurm-test"
    slow = [
        {"kind": "slow", "chunks": [DRAINED_CHUNK], "attempts": [1], "seconds": 4},
        {"kind": "slow", "chunks": [CUT_CHUNK], "attempts": [1], "seconds": 600},
    ]
    env = {
        **slurm,
        # Issue 45.11: chunkq from the venv chunkq.env names, not from the submitting shell's PATH
        "CHUNKQ_VENV": sys.prefix,
        "CHUNKQ_STORE": str(store),
        "CHUNKQ_CORPUS": str(corpus),
        "CHUNKQ_RUN_ID": run_id,
        "CHUNKQ_SUBMIT_OPTIONS": "--chunk-size 10 --queue-window 4",
        "CHUNKQ_POOL_OPTIONS": "--cpu-workers 1",
        # Issue 45.2: the model named once; the pools preload and allow it (a copy: not the bundled)
        "CHUNKQ_MODEL": str(bundled_copy(tmp_path / "model")),
        "CHUNKQ_REDIS_WAIT": "120",
        "CHUNKQ_LOG_LEVEL": "INFO",
        "HF_HUB_OFFLINE": "1",
        "CHUNKQ_FAULTS": json.dumps(slow),
    }
    env.pop("CHUNKQ_REDIS_URL", None)
    submitted = subprocess.run(
        [str(RECIPE / "run.sh"), "2"], cwd=logs, env=env, capture_output=True, text=True, timeout=60
    )
    assert submitted.returncode == 0, submitted.stderr
    supervisor_job = re.search(r"supervisor job (\d+)", submitted.stdout)
    assert supervisor_job, submitted.stdout
    supervisor_log = logs / f"chunkq-supervisor-{supervisor_job.group(1)}.log"

    # scancel the pool that holds DRAINED_CHUNK: it drains, finishing that chunk, and leaves.
    wait_for(lambda: _holding(logs, DRAINED_CHUNK) is not None, 240, "a pool to take the chunk", 0.5)
    cancelled = _holding(logs, DRAINED_CHUNK)
    assert cancelled is not None
    subprocess.run(["scancel", cancelled], env=env, check=True, timeout=30)
    # Preempt (requeue) the pool that holds CUT_CHUNK: KillWait cuts the chunk off; the pool job
    # comes back by itself, and the chunk is run again.
    wait_for(lambda: _holding(logs, CUT_CHUNK) is not None, 240, "a pool to take the chunk", 0.5)
    preempted = _holding(logs, CUT_CHUNK)
    assert preempted is not None and preempted != cancelled
    subprocess.run(["scontrol", "requeue", preempted], env=env, check=True, timeout=30)
    # Slurm holds a requeued job back for minutes (its begin time); here it may start once it ended.
    wait_for(lambda: f"{preempted} " in "\n".join(_squeue(env, "PENDING")), 60, "the requeued job", 0.5)
    begin_now = ["scontrol", "update", f"JobId={preempted}", "StartTime=now"]
    subprocess.run(begin_now, env=env, check=True, timeout=30)

    wait_for(lambda: not _squeue(env), 400, "the supervisor to finish and release the pools", interval=1)
    said = supervisor_log.read_text(errors="replace")
    layout = RunLayout(store, run_id)
    assert (layout.result / "embeddings.npy").is_file(), said[-3000:]
    assert result_matches(layout, texts, reference_model)

    pool_logs = {element: path.read_text(errors="replace") for element, path in _pool_logs(logs).items()}
    after_cancel = pool_logs[cancelled].partition("CANCELLED")[2]
    assert "draining" in after_cancel and f"Job OK ({run_id}__c{DRAINED_CHUNK:06d})" in after_cancel
    assert "stopping now" not in pool_logs[cancelled]  # Slurm's two SIGTERMs were one stop
    # The preempted pool drained too, was cut off, came back and ran chunks again.
    assert pool_logs[preempted].count("pool on ") == 2, pool_logs[preempted][-3000:]
    # KillWait ran out before the chunk did: Slurm killed the worker; the requeued pool, under the
    # same name, failed the chunk its predecessor held as it started, or the supervisor did first,
    # seeing that worker and its pool gone on its own host (jobs/queue/worker_place.py; on a cluster
    # the supervisor's job runs on another node and the pool's path is the one), and it ran again.
    assert "died with an earlier run of pool" in pool_logs[preempted] or re.search(
        rf"job {run_id}__c{CUT_CHUNK:06d} marked failed: its worker \S+ \(pid \d+\) and its pool are gone",
        said,
    ), said[-3000:]
    assert "could not connect to Redis" not in "".join(pool_logs.values())  # pools left before Redis
    assert f"{run_id}__c{CUT_CHUNK:06d}: attempt 2 queued" in said, said[-3000:]
    # Each pool job was handed its own "GPU" by Slurm, and the pool read which (none it can open here).
    handed = set(re.findall(r"discovery: CUDA_VISIBLE_DEVICES=(\d+)", "".join(pool_logs.values())))
    assert handed == {"0", "1"}, pool_logs
    # The served Redis stopped with the supervisor job: nothing of this run runs any more.
    assert not (store / "redis" / "url").exists()
    commands = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
    job = cancelled.split("_")[0]
    assert [c for c in commands if str(store) in c or f"--name slurm-{job}-" in c] == []


def test_on_a_cpu_partition_the_pools_run_on_their_cpus_and_a_refused_submit_releases_them(
    tmp_path: Path, slurm: dict[str, str], reference_model: Any
) -> None:
    """Issue 65.7: the pool's resources come from chunkq.env (the script hard-coded a GPU, 8 CPUs
    and 32G), so a CPU partition runs the recipe as written; a submit that fails ends the
    supervisor job with the pools released, not left waiting 900 s for a Redis that is gone."""
    ids, texts = make_texts(20, seed=37)
    store, logs = tmp_path / "store", tmp_path / "logs"
    logs.mkdir()
    env = {
        **slurm,
        "CHUNKQ_VENV": sys.prefix,
        "CHUNKQ_STORE": str(store),
        "CHUNKQ_CORPUS": str(write_corpus(tmp_path / "corpus.jsonl", ids, texts, "jsonl")),
        "CHUNKQ_RUN_ID": "cpu-run",
        "CHUNKQ_SUBMIT_OPTIONS": "--chunk-size 10",
        "CHUNKQ_POOL_RESOURCES": "--cpus-per-task=1 --mem=2G",
        "CHUNKQ_REDIS_WAIT": "900",
        "CHUNKQ_LOG_LEVEL": "INFO",
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("CHUNKQ_REDIS_URL", None)
    env.pop("CHUNKQ_CPU_WORKERS", None)  # the suite's one worker a pool: here the pool counts its CPUs

    def submit(**more: str) -> str:
        done = subprocess.run(
            [str(RECIPE / "run.sh"), "1"],
            cwd=logs,
            env={**env, **more},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        found = re.search(r"pool array (\d+)", done.stdout)
        assert found, done.stdout
        return found.group(1)

    pool = submit()
    shown = _client(env, "scontrol", "show", "job", pool)
    assert "gpu" not in shown and "NumCPUs=1" in shown, shown
    wait_for(lambda: not _squeue(env), 300, "the CPU run to finish and release its pool", interval=1)
    assert result_matches(RunLayout(store, "cpu-run"), texts, reference_model)
    (pool_log,) = _pool_logs(logs).values()
    said = pool_log.read_text(errors="replace")
    assert "CUDA_VISIBLE_DEVICES=unset" in said and "CPU workers: 1 (one per core (1)" in said, said[-3000:]

    submit(CHUNKQ_CORPUS=str(tmp_path / "missing.jsonl"), CHUNKQ_RUN_ID="refused")
    wait_for(lambda: not _squeue(env), 90, "the refused run's pools to be released", interval=1)
    supervisor_logs = [p.read_text(errors="replace") for p in logs.glob("chunkq-supervisor-*.log")]
    assert any("missing.jsonl" in text and "chunkq: error" in text for text in supervisor_logs), (
        supervisor_logs
    )


def test_a_cluster_whose_test_process_was_killed_is_reaped_and_a_live_ones_is_not(tmp_path: Path) -> None:
    """No Slurm needed: two processes carrying a cluster's SLURM_CONF, one cluster's owner gone."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    processes = {}
    for name, owner in (("orphan", f"{dead.pid}@{start_ticks()}"), ("live", None)):
        base = tmp_path / name / CLUSTER_DIR
        base.mkdir(parents=True)
        if owner is None:
            _owned(base)
        else:
            (base / OWNER_FILE).write_text(owner)
        env = {**os.environ, "SLURM_CONF": str(base / "slurm.conf")}
        processes[name] = subprocess.Popen(["sleep", "120"], env=env)
    try:
        _reap_orphaned_clusters()
        assert processes["orphan"].wait(timeout=30) == -9
        assert processes["live"].poll() is None
    finally:
        for proc in processes.values():
            proc.kill()
            proc.wait()
