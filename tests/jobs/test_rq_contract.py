"""Every RQ internal chunkq relies on still exists with the signature chunkq uses, reached through
the one door to RQ (``jobs/queue/rq_api.py``), which names everything chunkq takes from it.

chunkq subclasses RQ's worker and job and reads RQ's keys below its public API (worker.py's stop
handling, jobs/queue/abandon.py's failing of a dead worker's job, the tracker's intermediate list). An RQ
upgrade that renames or reshapes one of them fails here, in the fast tier, not in a user's run.
pyproject.toml bounds rq below its next major version for the same reason.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import redis

from chunkq.jobs.queue import rq_api
from chunkq.jobs.queue.rq_api import (
    WORKER_EXECUTIONS_KEY_TEMPLATE,
    DefaultSerializer,
    IntermediateQueue,
    Job,
    JSONSerializer,
    Queue,
    Result,
    SimpleWorker,
    StartedJobRegistry,
    record_job_failure,
)

# (the callable, the leading parameters chunkq passes, in order)
SIGNATURES: list[tuple[Callable[..., Any], tuple[str, ...]]] = [
    (SimpleWorker._shutdown, ("self",)),
    (SimpleWorker._install_signal_handlers, ("self",)),
    (SimpleWorker.dequeue_job_and_maintain_ttl, ("self", "timeout", "max_idle_time")),
    (SimpleWorker.execute_job, ("self", "job", "queue")),
    (SimpleWorker.prepare_execution, ("self", "job")),
    (SimpleWorker.perform_job, ("self", "job", "queue", "execution")),
    (SimpleWorker.set_state, ("self", "state")),
    (SimpleWorker.unsubscribe, ("self",)),
    (SimpleWorker.request_stop, ("self", "signum", "frame")),
    (SimpleWorker.request_force_stop, ("self", "signum", "frame")),
    (SimpleWorker.procline, ("self", "message")),
    (SimpleWorker.reorder_queues, ("self", "reference_queue")),
    (SimpleWorker.queue_names, ("self",)),
    (SimpleWorker.find_by_key, ("worker_key", "connection")),
    (record_job_failure, ("job", "exc_string", "pipeline")),
    (StartedJobRegistry.remove_executions, ("self", "job", "pipeline")),
    (StartedJobRegistry.get_job_ids, ("self", "start", "end", "desc", "cleanup")),
    (IntermediateQueue.__init__, ("self", "queue_key", "connection")),
    (IntermediateQueue.get_job_ids, ("self",)),
    (IntermediateQueue.set_first_seen, ("self", "job_id")),
    (IntermediateQueue.get_first_seen, ("self", "job_id")),
    (Queue.prepare_data, ("func", "args", "kwargs", "timeout", "result_ttl")),
    (Queue.enqueue_many, ("self", "job_datas", "pipeline")),
    (Queue.push_job_id, ("self", "job_id", "pipeline", "at_front")),
    (Job.fetch_many, ("job_ids", "connection", "serializer")),
    (Result.get_key, ("job_id",)),
    (DefaultSerializer.loads, ()),
]


@pytest.mark.parametrize(("func", "leading"), SIGNATURES, ids=[f.__qualname__ for f, _ in SIGNATURES])
def test_an_rq_callable_chunkq_uses_keeps_its_parameters(
    func: Callable[..., Any], leading: tuple[str, ...]
) -> None:
    what = func.__qualname__
    names = tuple(inspect.signature(func).parameters)
    if not leading:  # replaced by chunkq (nopickle): its existence is what matters
        assert callable(func), what
        return
    for name in leading:
        assert name in names, f"{what}: no parameter {name!r} in {names}"


def test_the_rq_attributes_and_keys_chunkq_reads_exist(connection: redis.Redis) -> None:
    worker = SimpleWorker(["contract"], connection=connection, serializer=JSONSerializer)
    for attribute in ("_stop_requested", "pubsub_thread", "redis_worker_namespace_prefix", "log", "name"):
        assert hasattr(worker, attribute), f"SimpleWorker lost {attribute}"
    # The runs' turns (jobs/queue/run_queues.py): the queues a worker looks in, set before each wait.
    for attribute in ("queues", "_ordered_queues", "queue_class", "serializer", "job_class"):
        assert hasattr(worker, attribute), f"SimpleWorker lost {attribute}"
    assert ":w-contract:" in WORKER_EXECUTIONS_KEY_TEMPLATE.format("w-contract")  # its running executions
    queue = Queue("contract", connection=connection)
    assert isinstance(queue.intermediate_queue_key, str)
    job = Job.create(print, connection=connection)
    for attribute in ("_success_callback_name", "_failure_callback_name", "_stopped_callback_name"):
        assert hasattr(job, attribute), f"Job lost {attribute} (jobs/queue/allowlist.py refuses callbacks)"
    assert hasattr(Job, "send_webhooks") and hasattr(Job, "func")


def test_rq_is_bounded_below_its_next_major_version() -> None:
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    (rq,) = [Requirement(r) for r in project["project"]["dependencies"] if Requirement(r).name == "rq"]
    import rq as installed

    assert Version(installed.__version__) in rq.specifier
    assert Version(f"{Version(installed.__version__).major + 1}.0") not in rq.specifier


def test_the_door_names_what_rq_still_has() -> None:
    """Each name the door exports resolves (an RQ release that drops one fails at import, here first)."""
    assert len(rq_api.__all__) > 20
    assert all(getattr(rq_api, name, None) is not None for name in rq_api.__all__)
