"""``chunkq dashboard``: rq-dashboard for chunkq's Redis, with the holes of rq-dashboard 0.9 closed.

As shipped, rq-dashboard 0.9 binds 0.0.0.0, reads jobs with pickle unless told ``--json``, and
its workers endpoint unpickles each worker's current job even then (``Worker.all()`` is called
without a serializer). Here:
- every endpoint reads JSON, the workers endpoint is replaced by one that passes the serializer,
  and RQ's pickle loader is disabled in the process (``jobs.queue.nopickle``), so a path we missed fails
  instead of running a planted payload;
- it binds to loopback unless credentials are set; credentials are checked in constant time on
  every request, static files included;
- only the read-only pages answer GET; everything else (requeue, delete, empty, compact, and any
  route a later rq-dashboard adds) must be a POST from the dashboard's own pages (same Origin), so
  another site open in the browser cannot drive it, not even through a link or an image (rq-dashboard
  accepts ``GET /requeue/<queue>``);
- the Host header must name the address it serves (on loopback: 127.0.0.1, localhost or [::1] with
  its port), so a page that rebinds its own DNS name to 127.0.0.1 cannot reach it;
- the job and workers pages insert strings into HTML unescaped, and those strings come from
  Redis (and from tracebacks that quote corpus text): they are HTML-escaped before they leave.
"""

from __future__ import annotations

import base64
import errno
import hmac
import html
import ipaddress
import json
import logging
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import redis

from chunkq.jobs.contract import errors
from chunkq.jobs.contract.defaults import DEFAULT_QUEUE
from chunkq.jobs.contract.errors import ChunkqError, ConfigError
from chunkq.jobs.queue.nopickle import PickleRefusedError, forbid_pickle
from chunkq.jobs.queue.rq_api import (
    FailedJobRegistry,
    InvalidJobOperation,
    InvalidJobOperationError,
    JSONSerializer,
    NoSuchJobError,
    Queue,
)

log = logging.getLogger(__name__)

# Endpoints that only read; every other endpoint changes state and must be a same-origin POST.
_READ_ONLY_ENDPOINTS = frozenset(
    f"rq_dashboard.{name}"
    for name in (
        "static",
        "favicon",
        "queues_overview",
        "workers_overview",
        "jobs_overview",
        "job_view",
        "list_queues",
        "list_jobs",
        "job_info",
        "list_workers",
    )
) | {"static"}
_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
# Endpoints whose templates insert every field as raw HTML.
_READ_ONLY_ENDPOINTS |= {"chunkq_failed", "chunkq_jobs"}  # chunkq's own shortcuts (redirects)
_RAW_HTML_ENDPOINTS = ("rq_dashboard.job_info", "rq_dashboard.list_workers", "rq_dashboard.list_queues")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(bind: str, username: str | None, password: str | None) -> None:
    if bool(username) != bool(password):
        raise ConfigError("give both --username and --password, or neither")
    if not is_loopback(bind) and not password:
        raise ConfigError(
            f"refusing to serve the dashboard on {bind} without authentication: "
            "set --username and --password (or CHUNKQ_DASHBOARD_USERNAME/_PASSWORD), or bind to 127.0.0.1"
        )


def _escape(value: Any) -> Any:
    if isinstance(value, str):
        return html.escape(value)
    if isinstance(value, list):
        return [_escape(v) for v in value]
    if isinstance(value, dict):
        return {k: _escape(v) for k, v in value.items()}
    return value


def _list_workers(instance_number: int) -> dict[str, Any]:
    """rq-dashboard's workers endpoint, reading each worker's current job as JSON, never pickle."""
    from flask import current_app

    from chunkq.jobs.queue.rq_api import Worker

    app: Any = current_app  # rq-dashboard keeps its connection on the app
    rows = []
    for worker in Worker.all(connection=app.redis_conn, serializer=JSONSerializer):
        try:
            job = worker.get_current_job()
            current: Any = (
                "idle"
                if job is None
                else {
                    "job_id": job.id,
                    "description": job.description,
                    "created_at": job.created_at.isoformat() if job.created_at else None,
                    "call_string": job.get_call_string(),
                }
            )
        except Exception as exc:  # a job that is not JSON: say so, do not load it another way
            current = f"unreadable job ({type(exc).__name__})"
        rows.append(
            {
                "name": worker.name,
                "pid": worker.pid,
                "queues": [q.name for q in worker.queues],
                "state": str(worker.get_state()),
                "current_job": current,
                "last_heartbeat": worker.last_heartbeat,
                "birth_date": worker.birth_date,
                "successful_job_count": worker.successful_job_count,
                "failed_job_count": worker.failed_job_count,
                "total_working_time": worker.total_working_time,
            }
        )
    rows.sort(key=lambda w: (w["state"], w["queues"], w["name"]))
    return {"workers": rows}


def _meta_lines(metadata: str) -> str:
    """A job's meta as the job page shows it: one ``"key": value`` line each, HTML-escaped and joined
    with ``<br>`` (the page inserts it as HTML in a paragraph, where newlines would collapse)."""
    try:
        meta = json.loads(metadata)
    except (TypeError, ValueError):
        return html.escape(str(metadata))
    if not isinstance(meta, dict):
        return html.escape(json.dumps(meta, ensure_ascii=False))
    return "<br>".join(
        html.escape(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
        for key, value in sorted(meta.items())
    )


JOBS_PER_PAGE = 20


def jobs_url(queue: str, registry: str = "failed", instance: int = 0) -> str:
    """rq-dashboard's page of a queue's jobs in one registry (its route needs every part)."""
    return f"/{instance}/view/jobs/{quote(queue, safe='')}/{quote(registry, safe='')}/{JOBS_PER_PAGE}/asc/1"


def _finished_note(store: Path | None) -> str:
    """Why the finished counts stay near 0, with the count from the store that holds the truth."""
    if store is None:
        return ""
    from chunkq.tools.run_list import chunks_done

    try:
        done, chunks, runs = chunks_done(store)
        counted = (
            f"the store {html.escape(str(store))} holds {done:,} of {chunks:,} chunks done in {runs} run(s)"
        )
    except (OSError, ChunkqError) as exc:
        counted = f"the store {html.escape(str(store))} could not be read ({html.escape(str(exc))})"
    return (
        '<div class="alert alert-info" id="chunkq-finished">Finished chunks are deleted from Redis once '
        f"the store holds their output, so the finished counts below stay near 0: {counted} "
        "(<code>chunkq runs</code>, <code>chunkq status RUN</code>).</div>"
    )


def _failed_counts(connection: redis.Redis) -> list[tuple[str, int]]:
    """Each queue with failed chunks (a run's own, jobs/queue/run_queues.py), and how many."""
    counts = [
        (queue.name, FailedJobRegistry(queue=queue).count)
        for queue in Queue.all(connection=connection, serializer=JSONSerializer)
    ]
    return [(name, count) for name, count in counts if count]


def _failed_banner(connection: redis.Redis) -> str:
    """The front page's first line: each queue's failed chunks, a link to them, or that there are none."""
    counts = _failed_counts(connection)
    links = [
        f'<a href="{jobs_url(name)}">{count} failed chunk(s) in queue {html.escape(name)}</a>'
        for name, count in counts
        if count
    ]
    body = " · ".join(links) + " (each with its traceback and meta)" if links else "No failed chunks."
    return f'<div class="alert alert-{"danger" if links else "success"}" id="chunkq-failed">{body}</div>'


def _authorised(header: str | None, username: str, password: str) -> bool:
    if not header or not header.startswith("Basic "):
        return False
    try:
        user, _, given = base64.b64decode(header[6:]).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        return False
    # Both compared, always, in constant time: neither the name nor the password leaks by timing.
    return hmac.compare_digest(user.encode(), username.encode()) & hmac.compare_digest(
        given.encode(), password.encode()
    )


def allowed_hosts(bind: str, port: int) -> frozenset[str] | None:
    """The Host headers a dashboard bound to ``bind`` answers; None (any) for a wildcard bind,
    which needs credentials, and a browser sends those to the dashboard's own origin only."""
    if bind in ("0.0.0.0", "::"):  # noqa: S104 - a wildcard bind is refused without credentials
        return None
    names = _LOOPBACK_NAMES if is_loopback(bind) else (f"[{bind}]" if ":" in bind else bind,)
    return frozenset(f"{name}:{port}" for name in names)


def _rewrite(
    app: Any, response: Any, endpoint: str | None, connection: redis.Redis, store: Path | None
) -> None:
    """What chunkq changes in rq-dashboard's answers: strings from Redis escaped where the page
    inserts them as HTML, a job's meta one line a field, and the failed chunks on the front page."""
    if endpoint in _RAW_HTML_ENDPOINTS and response.is_json:
        data = response.get_json()
        escaped = _escape(data)
        if endpoint == "rq_dashboard.job_info" and isinstance(data, dict) and "metadata" in data:
            escaped["metadata"] = _meta_lines(data["metadata"])
        response.set_data(app.json.dumps(escaped))
    if endpoint == "rq_dashboard.queues_overview" and response.mimetype == "text/html":
        page = response.get_data(as_text=True)
        banner = _failed_banner(connection) + _finished_note(store)
        response.set_data(page.replace('<div class="container">', f'<div class="container">{banner}', 1))


def create_app(
    redis_url: str,
    username: str | None = None,
    password: str | None = None,
    hosts: frozenset[str] | None = None,
    store: Path | None = None,
) -> Any:
    """The rq-dashboard Flask app for ``redis_url``, its holes closed (see the module docstring);
    ``store``: where the front page counts finished chunks from."""
    forbid_pickle()
    from flask import Response, current_app, redirect, request
    from rq_dashboard import web
    from rq_dashboard.cli import make_flask_app

    web.config.serializer = JSONSerializer
    app = make_flask_app(None, None, None, url_prefix="")
    app.config["RQ_DASHBOARD_REDIS_URL"] = redis_url
    web.setup_rq_connection(app)
    app.view_functions["rq_dashboard.list_workers"] = web.jsonify(_list_workers)

    def guard() -> Any:
        if hosts is not None and request.host not in hosts:
            return Response("unknown host: this dashboard answers only to its own address", 403)
        if password and not _authorised(request.headers.get("Authorization"), username or "", password):
            return Response("authentication required", 401, {"WWW-Authenticate": 'Basic realm="chunkq"'})
        reading = request.method in ("GET", "HEAD")
        if reading and (request.endpoint in _READ_ONLY_ENDPOINTS or request.endpoint is None):
            return None  # a read-only page, or no route at all: Flask answers 404
        if request.method != "POST":
            return Response("this changes state: only a POST from the dashboard's own page may", 405)
        origin = request.headers.get("Origin") or request.headers.get("Referer") or ""
        if urlsplit(origin).netloc != request.host:
            return Response("cross-origin request refused", 403)
        return None

    def shortcut(instance: int = 0, queue: str | None = None, registry: str = "failed") -> Any:
        # /failed and /0/view/jobs/<queue>/<registry>: rq-dashboard's page wants paging parts too.
        # /failed alone: the queue with the most failed chunks (each run has its own), else the pools'.
        if queue is None:
            counts = _failed_counts(current_app.redis_conn)  # type: ignore[attr-defined]
            queue = max(counts, key=lambda found: found[1])[0] if counts else DEFAULT_QUEUE
        return redirect(jobs_url(queue, registry, instance))

    app.add_url_rule("/failed", "chunkq_failed", shortcut)
    app.add_url_rule("/<int:instance>/view/jobs/<queue>/<registry>", "chunkq_jobs", shortcut)

    def escape_raw_html_fields(response: Any) -> Any:
        _rewrite(app, response, request.endpoint, current_app.redis_conn, store)  # type: ignore[attr-defined]
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("X-Frame-Options", "DENY")
        return response

    def unreadable(exc: Exception) -> Any:
        # A job that is not JSON (pickled, or planted): say so instead of a bare 500.
        log.warning("dashboard: unreadable data at %s: %s: %s", request.path, type(exc).__name__, exc)
        return Response(
            "unreadable job data: not JSON (written with pickle, or by someone who should not "
            "write to Redis); chunkq will not read it another way",
            422,
        )

    def refused(exc: Exception) -> Any:
        # Requeueing a job that is not failed (or is gone) is the user's mistake, not a 500.
        status = 404 if isinstance(exc, NoSuchJobError) else 409
        return Response(f"{errors.first_line(str(exc)) or type(exc).__name__}", status)

    app.before_request(guard)
    app.after_request(escape_raw_html_fields)
    app.register_error_handler(PickleRefusedError, unreadable)
    app.register_error_handler(ValueError, unreadable)  # JSON and UTF-8 decoding errors
    app.register_error_handler(InvalidJobOperationError, refused)
    app.register_error_handler(InvalidJobOperation, refused)
    app.register_error_handler(NoSuchJobError, refused)
    return app


def _held_by(port: int) -> str:
    """ ", held by <process> (pid N)" for the process listening on ``port``, where this user may see it."""
    import psutil

    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                process = psutil.Process(conn.pid)
                return f", held by {' '.join(process.cmdline()[:3]) or process.name()} (pid {conn.pid})"
    except (psutil.Error, OSError):
        pass
    return ""


def serve(
    redis_url: str,
    bind: str,
    port: int,
    username: str | None,
    password: str | None,
    store: Path | None = None,
) -> None:
    """Serve the dashboard with waitress (a production WSGI server) until interrupted."""
    check_bind(bind, username, password)
    import waitress

    app = create_app(redis_url, username, password, allowed_hosts(bind, port), store)
    try:
        server = waitress.create_server(app, host=bind, port=port, threads=4, ident="chunkq")
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise ConfigError(
            f"port {port} on {bind} is in use{_held_by(port)}; choose another with --port "
            "(CHUNKQ_DASHBOARD_PORT)"
        ) from None
    # An interrupt is a normal stop wherever it lands: waitress's run() catches one that arrives
    # while it serves, this catches one between binding and serving.
    try:
        log.info(
            "dashboard on http://%s:%d/ (%s)", bind, port, "authenticated" if password else "loopback only"
        )
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    log.info("dashboard stopped")
