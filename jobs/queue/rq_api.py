"""RQ, as chunkq uses it: the one module of the product that imports ``rq``.

Everything chunkq takes from RQ is named here, public API and internals alike (chunkq subclasses
RQ's worker, fails a dead worker's job the way RQ's own lifecycle does, reads its intermediate list
and result keys). An RQ release that renames or reshapes one of them is met in this file and in
``tests/jobs/test_rq_contract.py``, which pins the signatures of the internals named below; pyproject.toml
bounds rq below its next major version for the same reason.
"""

from __future__ import annotations

from rq import get_current_job
from rq.defaults import DEFAULT_FAILURE_TTL
from rq.exceptions import (
    DeserializationError,
    InvalidJobOperation,
    InvalidJobOperationError,
    NoSuchJobError,
    StopRequested,
)
from rq.executions import WORKER_EXECUTIONS_KEY_TEMPLATE
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.job_lifecycle import record_job_failure
from rq.queue import EnqueueData, Queue
from rq.registry import (
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)
from rq.results import Result
from rq.serializers import DefaultSerializer, JSONSerializer
from rq.utils import import_attribute, str_to_date, utcformat
from rq.worker import SimpleWorker, Worker, WorkerStatus

__all__ = [
    "DEFAULT_FAILURE_TTL",
    "WORKER_EXECUTIONS_KEY_TEMPLATE",
    "DefaultSerializer",
    "DeferredJobRegistry",
    "DeserializationError",
    "EnqueueData",
    "FailedJobRegistry",
    "FinishedJobRegistry",
    "IntermediateQueue",
    "InvalidJobOperation",
    "InvalidJobOperationError",
    "JSONSerializer",
    "Job",
    "JobStatus",
    "NoSuchJobError",
    "Queue",
    "Result",
    "ScheduledJobRegistry",
    "SimpleWorker",
    "StartedJobRegistry",
    "StopRequested",
    "Worker",
    "WorkerStatus",
    "get_current_job",
    "import_attribute",
    "record_job_failure",
    "str_to_date",
    "utcformat",
]
