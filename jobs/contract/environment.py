"""Every ``CHUNKQ_*`` environment variable that is not a setting, declared once.

The settings' own variables (``CHUNKQ_STORE``, ``CHUNKQ_REDIS_URL``, ``CHUNKQ_WORKERS_PER_GPU``...)
are derived from their names in ``settings.py`` and ``supervisor/run_options.py``; the rest are
here, each with who sets it and what it does. Modules import the name from here: no other module
spells a ``CHUNKQ_`` name (``tests/jobs/test_environment.py`` reads the source for one), and
``docs/settings.md`` lists each.
"""

from __future__ import annotations

from typing import NamedTuple

USER = "user"  # a user sets it
DRILL = "drill"  # tests and fault drills only: a stand-in for hardware, or a fault injected
INTERNAL = "internal"  # chunkq sets it for a process it starts; never set by hand


class Variable(NamedTuple):
    name: str
    audience: str
    purpose: str


VARIABLES: dict[str, Variable] = {}


def _declare(name: str, audience: str, purpose: str) -> str:
    VARIABLES[name] = Variable(name, audience, purpose)
    return name


# Set by users.
ALLOWED_JOBS = _declare("CHUNKQ_ALLOWED_JOBS", USER, "extra job functions (dotted paths) workers may run")
REDIS_SERVER = _declare("CHUNKQ_REDIS_SERVER", USER, "the server binary of the embedded Redis")
TOKENISE_AHEAD = _declare("CHUNKQ_TOKENISE_AHEAD", USER, "1: tokenise beside the forward; 0: before it")
KINDS = _declare("CHUNKQ_KINDS", USER, "modules that each define a kind of your own (KIND)")
FORK_SERVER_PRELOAD = _declare(
    "CHUNKQ_FORK_SERVER_PRELOAD", USER, "more modules the fork server imports once"
)
DASHBOARD_BIND = _declare("CHUNKQ_DASHBOARD_BIND", USER, "chunkq dashboard --bind")
DASHBOARD_PORT = _declare("CHUNKQ_DASHBOARD_PORT", USER, "chunkq dashboard --port")
DASHBOARD_USERNAME = _declare("CHUNKQ_DASHBOARD_USERNAME", USER, "chunkq dashboard --username")
DASHBOARD_PASSWORD = _declare("CHUNKQ_DASHBOARD_PASSWORD", USER, "chunkq dashboard --password")

# Tests and drills.
FAULTS = _declare("CHUNKQ_FAULTS", DRILL, "fault-injection rules (jobs/drills/faults.py)")
SIMULATED_GPUS = _declare("CHUNKQ_SIMULATED_GPUS", DRILL, "a JSON file that stands in for NVML")
SIMULATED_CUDA = _declare(
    "CHUNKQ_SIMULATED_CUDA", DRILL, "a JSON file that stands in for the CUDA driver's devices"
)
SIMULATED_TORCH_CUDA = _declare(
    "CHUNKQ_SIMULATED_TORCH_CUDA", DRILL, "the CUDA release torch is said to be built for"
)

# Set by chunkq for the processes it starts.
DEVICE = _declare("CHUNKQ_DEVICE", INTERNAL, "a worker's device: cpu or cuda")
GPU = _declare("CHUNKQ_GPU", INTERNAL, "a worker's physical GPU index, for the record")
POOL_STARTED_AT = _declare("CHUNKQ_POOL_STARTED_AT", INTERNAL, "when the worker's pool started")
POOL_FOR_RUN = _declare("CHUNKQ_POOL_FOR_RUN", INTERNAL, "the run a `chunkq run` started the pool for")
POOL_SETTINGS_JSON = _declare("CHUNKQ_POOL_SETTINGS_JSON", INTERNAL, "every pool setting, from chunkq run")
POOL_DEVICES_JSON = _declare(
    "CHUNKQ_POOL_DEVICES_JSON", INTERNAL, "the devices chunkq run chose for its pool"
)
FORK_SERVER_FD = _declare("CHUNKQ_FORK_SERVER_FD", INTERNAL, "the fork server's socket, inherited")
FORK_SERVER_MODEL = _declare("CHUNKQ_FORK_SERVER_MODEL", INTERNAL, "the pool's --preload model, loaded once")
NOTIFY_FD = _declare("CHUNKQ_NOTIFY_FD", INTERNAL, "where a worker says it started its last job")
WAIT_FOR_PID = _declare("CHUNKQ_WAIT_FOR_PID", INTERNAL, "the process a standby worker waits for")
PARENT_PID = _declare("CHUNKQ_PARENT_PID", INTERNAL, "the process whose death ends a worker")
POOL_PID = _declare("CHUNKQ_POOL_PID", INTERNAL, "the worker's pool")
