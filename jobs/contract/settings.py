"""Every pool and worker setting, written once: its default, flag, environment variable, help, and
whether each worker gets it on its command line. The defaults a user meets are named in
``defaults.py`` beside this module; a run's options (``supervisor/run_options.py``) use ``Meta`` too.

``PoolSettings`` is the schema. From its fields' metadata come the ``chunkq pool`` options (and
the pool options of ``chunkq run``: ``chunkq/cli/settings_options.py``), the worker's command line
(``queue_worker/worker_args.py``), and the settings ``chunkq run`` hands its
pool whole, as JSON (``to_json``/``from_json``). compose.yaml sets the same ``CHUNKQ_*`` variables;
a test checks that each one it sets is here. A new pool option is one field below, plus its test and
its line in docs/settings.md.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from chunkq.jobs.contract import environment
from chunkq.jobs.contract.defaults import (
    DEFAULT_PRECISION,
    DEFAULT_QUEUE,
    DEFAULT_RECYCLE_AFTER,
    HUNG_GRACE_SECONDS,
)
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.specs import TORCH_PRECISIONS
from chunkq.jobs.contract.units import size_value

# A worker takes a second stop signal this soon after the first for the same one delivered twice:
# Slurm's scancel signals every process of the job, the worker too, and the pool relays it.
SIGNAL_REPEAT_SECONDS = 1.0
ENV_PREFIX = "CHUNKQ_"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # every chunkq command and pool
SETTINGS_JSON_ENV = environment.POOL_SETTINGS_JSON  # chunkq run hands its pool every setting at once
DEVICES_JSON_ENV = environment.POOL_DEVICES_JSON  # ... and the devices it chose for it (not surveyed twice)


WORKERS_AUTO = "auto"  # --workers-per-gpu auto: as many as pay off on each GPU


def workers_per_gpu_value(value: str) -> str:
    """--workers-per-gpu as given: a number of workers (1 or more) or 'auto'."""
    if value == WORKERS_AUTO or (value.isdigit() and int(value) >= 1):
        return value
    raise ConfigError(f"{value!r}: give a number of workers (1 or more) or 'auto'")


@dataclass(frozen=True)
class Meta:
    """How a setting reaches whoever receives it: ``kind`` is str, int, float, flag (--x, or --x/--no-x
    when on by default), switch (--x/--no-x), choice or list. The pool's settings are below; a run's
    (its corpus, encoding and watch) are ``supervisor/run_options.py``, in the same form."""

    help: str
    kind: str = "str"
    env: str | None = ""  # "": CHUNKQ_<NAME>; None: no environment variable
    cli: bool = True  # a ``chunkq pool`` option (False: set by code, or by a shared option)
    worker: bool = False  # each worker gets it as its flag (lists: the flag once per item)
    flag: str = ""  # "": --<name>
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    # A worker run by hand, without this flag, has none: no count, no time, no store of its own (a
    # pool always passes it).
    unset_by_hand: bool = False
    zero_means_none: bool = False  # 0: never (--recycle-after 0), as the worker reads it
    receiver: str = "pool"  # pool (its workers too where ``worker``), submit (the run's identity) or watch
    parse: Callable[[str], Any] | None = None  # a value given as text, checked (ConfigError) and converted

    def env_name(self, name: str) -> str | None:
        return None if self.env is None else (self.env or ENV_PREFIX + name.upper())


def setting(default: Any, help: str, **meta: Any) -> Any:
    """A field of the schema; ``default`` may be a zero-argument callable (a fresh value each time)."""
    info = {"chunkq": Meta(help, **meta)}
    if callable(default):
        return field(default_factory=default, metadata=info)
    return field(default=default, metadata=info)


def default_pool_name() -> str:
    return f"pool-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class PoolSettings:
    """Everything a pool and its workers need; read once from flags and ``CHUNKQ_*`` variables."""

    redis_url: str = setting("", "redis:// or rediss:// URL (password or ACL user included).", cli=False)
    queue: str = setting(DEFAULT_QUEUE, "The queue workers take chunks from.", cli=False, worker=True)
    gpus: str = setting("all", "all, none or 0,2.")
    min_free_memory: str = setting(
        "0", "Skip GPUs with less free memory than this (e.g. 8GiB).", parse=size_value
    )
    gpu_memory_limit: str = setting(
        "0",
        "The most GPU memory each worker's PyTorch may hold (e.g. 10GiB; 0: no limit): past it the "
        "allocator raises its own out-of-memory, and the batch is halved. For a GPU shared with other work.",
        worker=True,
        parse=size_value,
    )
    busy_gpus: str = setting(
        "use",
        "What to do with GPUs other processes are using (they are reported either way).",
        kind="choice",
        choices=("use", "skip"),
    )
    workers_per_gpu: str = setting(
        WORKERS_AUTO,
        "Workers sharing each GPU, or 'auto': as many as the CPU cores per GPU feed and GPU memory "
        "holds, at most 4 (logged with the reason).",
        parse=workers_per_gpu_value,
    )
    cpu_workers: int | None = setting(
        None,
        "Workers when no GPU is used. Default: one per core, each in one thread (as the host's memory "
        "holds them; logged with the reason): on shared cores one thread per process wins.",
        kind="int",
        low=1,
    )
    max_jobs: int | None = setting(
        None,
        "Chunks a worker runs before it exits and a fresh process replaces it (default: no count; "
        "--recycle-after decides).",
        kind="int",
        low=1,
        worker=True,
        unset_by_hand=True,
    )
    recycle_after: float = setting(
        DEFAULT_RECYCLE_AFTER,
        "Work after which a worker exits at the end of its chunk and a fresh process replaces it: "
        "seconds, or 10m, 2h (0: never by time). A broken CUDA context does not wait: it exits at once.",
        kind="duration",
        low=0,
        worker=True,
        unset_by_hand=True,
        zero_means_none=True,
    )
    max_jobs_jitter: float = setting(
        0.1,
        "Each worker's max-jobs and recycle-after vary by up to this fraction, so reloads are staggered.",
        kind="float",
        low=0,
        high=0.9,
        env=None,
    )
    preload: str | None = setting(
        None, "Model each worker loads before its first job.", env=None, worker=True
    )
    store: str | None = setting(
        None, "The one store workers serve.", cli=False, worker=True, unset_by_hand=True
    )
    allowed_models: tuple[str, ...] = setting(
        (),
        "A model jobs may ask for, beside the bundled one and --preload (repeatable or comma-separated; "
        "'*': any, unsafe).",
        kind="list",
        worker=True,
        flag="--allow-model",
    )
    precision: str = setting(
        DEFAULT_PRECISION, "fp32, or fp16/bf16 on GPUs.", kind="choice", choices=TORCH_PRECISIONS, worker=True
    )
    trust_remote_code: bool = setting(
        False,
        "Let jobs run models that bring their own Python code (trust_remote_code: nomic, jina, "
        "gte-Qwen...). Off, such a job is refused: a job's options come through Redis.",
        kind="flag",
        worker=True,
    )
    name: str = setting(default_pool_name, "Pool name (prefix of its worker names).", env=None)
    log_level: str = setting("INFO", "Log level of the pool and its workers.", cli=False, worker=True)
    restart_delay: float = setting(
        1.0, "Seconds before restarting a worker that failed.", cli=False, env=None
    )
    kill_grace: float = setting(10.0, "Seconds after a second signal before SIGKILL.", cli=False, env=None)
    crash_limit: int = setting(
        5, "Worker deaths on one GPU within --crash-window that take it out of the pool.", kind="int", low=1
    )
    crash_window: float = setting(300.0, "Seconds.", kind="float", low=0)
    hung_grace: float = setting(
        HUNG_GRACE_SECONDS,
        "Seconds past a job's timeout before its worker is killed as hung.",
        kind="float",
        low=0,
    )
    standby: bool = setting(
        True, "Start each replacement worker while its predecessor runs its last chunk.", kind="flag"
    )
    fork_server: bool = setting(
        True,
        "Fork each worker from a process that has imported torch (saves ~5 s of CPU per worker); off: a "
        "fresh interpreter each time.",
        kind="flag",
    )
    fork_server_socket: str | None = setting(
        None,
        "Fork workers from the standing fork server at this Unix socket (`chunkq serve-forks`). It "
        "imported torch and loaded the model once for every run; a pool that cannot use it starts its own.",
        flag="--fork-server-at",
    )
    metrics_port: int | None = setting(
        None,
        "Serve the pool's Prometheus metrics on 127.0.0.1:PORT (0: any free port).",
        kind="int",
        low=0,
        high=65535,
        env="CHUNKQ_POOL_METRICS_PORT",
    )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PoolSettings:
        data = json.loads(text)
        data["allowed_models"] = tuple(data.get("allowed_models", ()))
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def truthy(value: str | None) -> bool:
    """A flag's environment variable as click reads it: 1, true, yes, on (any case)."""
    return (value or "").strip().lower() in {"1", "true", "yes", "on", "t", "y"}


def env_of(name: str) -> str:
    """The environment variable of setting ``name`` (the CLI reads it; the pool sets some for workers)."""
    meta: Meta = next(f.metadata["chunkq"] for f in fields(PoolSettings) if f.name == name)
    env = meta.env_name(name)
    if env is None:
        raise KeyError(f"setting {name} has no environment variable")
    return env


def schema() -> list[tuple[str, Meta, Any]]:
    """(name, metadata, default) of every setting, in declaration order."""
    out = []
    for f in fields(PoolSettings):
        default = f.default if f.default is not MISSING else None  # a factory: computed when used
        out.append((f.name, f.metadata["chunkq"], default))
    return out


def flag(name: str, meta: Meta | None = None) -> str:
    """The option's flag, on the CLI and the worker's command line alike."""
    return (meta.flag if meta is not None and meta.flag else None) or "--" + name.replace("_", "-")
