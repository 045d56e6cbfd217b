"""The allow-list of job functions, enforced by an RQ job class every chunkq worker uses.

RQ with the JSON serializer still imports and calls whatever dotted path a job names, so anyone
who can write to Redis could run ``os.system`` on a GPU host. This job class refuses every
function, callback and webhook that chunkq did not list.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from chunkq.jobs.contract import environment
from chunkq.jobs.contract.errors import JobNotAllowedError
from chunkq.jobs.queue.rq_api import Job, import_attribute

EMBED_CHUNK = "chunkq.jobs.embed.embed_chunk"
DEFAULT_ALLOWED = frozenset({EMBED_CHUNK})
ALLOW_ENV = environment.ALLOWED_JOBS  # comma-separated extra dotted paths for users' own job functions


def allowed_functions() -> frozenset[str]:
    extra = {name.strip() for name in os.environ.get(ALLOW_ENV, "").split(",") if name.strip()}
    return DEFAULT_ALLOWED | extra


class AllowListedJob(Job):
    """An RQ job that runs only allow-listed functions and never callbacks or webhooks."""

    @property
    def func(self) -> Callable[..., Any] | None:
        name = self.func_name
        # Refuse before anything runs: a job carrying callbacks or webhooks is not one chunkq made.
        self._refuse_callback("success", self._success_callback_name)
        self._refuse_callback("failure", self._failure_callback_name)
        self._refuse_callback("stopped", self._stopped_callback_name)
        if self.webhooks:
            raise JobNotAllowedError(f"job {self.id}: webhooks refused; chunkq sends none")
        if self.instance is not None or name not in allowed_functions():
            raise JobNotAllowedError(f"job {self.id}: function {name!r} is not on chunkq's allow-list")
        func: Callable[..., Any] = import_attribute(name)
        return func

    def _refuse_callback(self, kind: str, name: str | None) -> None:
        if name:
            raise JobNotAllowedError(
                f"job {self.id}: {kind} callback {name!r} refused; chunkq runs no callbacks"
            )

    @property
    def success_callback(self) -> Any:
        self._refuse_callback("success", self._success_callback_name)
        return None

    @property
    def failure_callback(self) -> Any:
        self._refuse_callback("failure", self._failure_callback_name)
        return None

    @property
    def stopped_callback(self) -> Any:
        self._refuse_callback("stopped", self._stopped_callback_name)
        return None

    def send_webhooks(self, status: Any, *, exc_string: str | None = None) -> None:
        if self.webhooks:
            self.log.warning("job %s: %d webhook(s) refused; chunkq sends none", self.id, len(self.webhooks))
