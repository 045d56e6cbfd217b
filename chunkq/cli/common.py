"""What every ``chunkq`` subcommand shares: exit codes, one-line errors, and the options that each
takes (``--store``, ``--redis-url``, ``--log-level``), each reading its ``CHUNKQ_*`` variable."""

from __future__ import annotations

import functools
import logging
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import redis
from click.core import ParameterSource

from chunkq.jobs.contract import errors
from chunkq.jobs.contract.addresses import parse_redis
from chunkq.jobs.contract.defaults import DEFAULT_QUEUE, DEFAULT_STORE
from chunkq.jobs.contract.errors import (
    AssemblyError,
    BadInputError,
    ChunkqError,
    ChunksFailedError,
    ConfigError,
    DamagedRunError,
    RunConflictError,
    RunNotFoundError,
    StoreWriteError,
)
from chunkq.jobs.contract.redaction import redact, redacted
from chunkq.jobs.contract.settings import env_of
from chunkq.jobs.contract.storage import open_store
from chunkq.queue_worker.exit_codes import (
    EXIT_ASSEMBLY,
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_CHUNKS_FAILED,
    EXIT_CONFIG,
    EXIT_CONFLICT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_LOCKED,
    EXIT_NOT_FOUND,
    EXIT_REDIS,
    EXIT_STORAGE,
)
from chunkq.supervisor.request import check_redis_url, reach_redis
from chunkq.supervisor.server.store_redis import served_url
from chunkq.supervisor.store.run_lock import RunLockedError
from chunkq.supervisor.store.run_log import QUIET, show_on_terminal
from chunkq.supervisor.watch.supervise import RedisGoneError

log = logging.getLogger("chunkq")


F = TypeVar("F", bound=Callable[..., Any])


def _exit_code(exc: Exception) -> int:
    for kind, code in (
        (RunLockedError, EXIT_LOCKED),
        (ChunksFailedError, EXIT_CHUNKS_FAILED),
        (RedisGoneError, EXIT_REDIS),
        (AssemblyError, EXIT_ASSEMBLY),
        (DamagedRunError, EXIT_ASSEMBLY),
        (BadInputError, EXIT_BAD_INPUT),
        (RunConflictError, EXIT_CONFLICT),
        (StoreWriteError, EXIT_STORAGE),
        (RunNotFoundError, EXIT_NOT_FOUND),
        (redis.RedisError, EXIT_REDIS),
    ):
        if isinstance(exc, kind):
            return code
    return EXIT_CONFIG


RESUME_HINT = "the store keeps every finished chunk: run the same command to resume"


def reports_errors(func: F) -> F:
    """Turn every error into one clear line and a named exit code, never a traceback on the terminal."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except redis.RedisError as exc:
            click.echo(f"chunkq: error: {_redis_error(exc, kwargs.get('redis_url'))}", err=True)
            sys.exit(_exit_code(exc))
        except ChunkqError as exc:
            click.echo(f"chunkq: error: {exc}", err=True)
            sys.exit(_exit_code(exc))
        except KeyboardInterrupt:
            click.echo(f"chunkq: interrupted; {RESUME_HINT}", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except click.ClickException:
            raise
        except BrokenPipeError:
            # Nobody reads any more: say nothing (there is no one to say it to), and keep Python's
            # flush at exit from failing on the same closed pipe.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT_BROKEN_PIPE)
        except OSError as exc:
            _os_error(exc)
        except Exception as exc:
            if _is_object_store_error(exc):
                _store_refused(exc, "could not be reached or refused the request")
            _internal_error(exc)

    return wrapper  # type: ignore[return-value]


def _os_error(exc: OSError) -> NoReturn:
    """A disk or store that refuses (full, read-only, not ours, a bucket's 403 or missing bucket):
    one line and EXIT_STORAGE; any other OSError is a bug."""
    if isinstance(exc, PermissionError) and exc.errno is None:  # s3fs and gcsfs: 403 Forbidden
        _store_refused(exc, "refused access (check the store's credentials and permissions)")
    if isinstance(exc, FileNotFoundError) and exc.errno is None and "://" in str(exc):
        _store_refused(exc, "has no such bucket or path")  # fsspec's NoSuchBucket
    if exc.errno not in errors.STORAGE_ERRNOS:
        _internal_error(exc)
    log.debug("storage error", exc_info=exc)
    where = f" writing {exc.filename}" if exc.filename else ""
    click.echo(
        f"chunkq: error: {exc.strerror}{where}; make room (or fix the permissions) and run the "
        f"same command again (nothing partial was published; {RESUME_HINT})",
        err=True,
    )
    sys.exit(EXIT_STORAGE)


# The object stores' client errors (botocore, aiobotocore, aiohttp, google-auth), by class name: the
# store's network, endpoint or credentials, not a bug in chunkq. Named, not imported: each is an
# optional extra.
OBJECT_STORE_ERRORS = frozenset(
    {
        "BotoCoreError",
        "ClientError",
        "EndpointConnectionError",
        "NoCredentialsError",
        "ClientConnectorError",
        "ServerTimeoutError",
        "RefreshError",
        "TransportError",
    }
)


def _is_object_store_error(exc: BaseException) -> bool:
    return any(cls.__name__ in OBJECT_STORE_ERRORS for cls in type(exc).__mro__)


def _store_refused(exc: BaseException, what: str) -> NoReturn:
    click.echo(
        f"chunkq: error: the object store {what}: {type(exc).__name__}: {errors.first_line(str(exc))}; "
        f"fix it and run the same command again ({RESUME_HINT})",
        err=True,
    )
    sys.exit(EXIT_STORAGE)


def _redis_error(exc: redis.RedisError, url: str | None) -> str:
    """Redis's own words (``invalid username-password pair or user is disabled.``) name neither Redis
    nor the server: say both, the password masked, and what to check."""
    url = url or os.environ.get(env_of("redis_url"))
    where = f"Redis at {redacted(url)}" if url else "Redis"
    if isinstance(exc, redis.AuthenticationError):
        # A URL without a password meets a server that wants one as Redis's "HELLO must be called
        # with the client already authenticated, ...": about a command the user never gave.
        missing = url and not _password_in(url)
        said = "wants a password, which the URL lacks" if missing else f"refused the password: {exc}"
        return f"{where} {said} (give it in the URL, redis://:PASSWORD@HOST:PORT, or in CHUNKQ_REDIS_URL)"
    return f"{where}: {exc}"


def _password_in(url: str) -> bool:
    parsed = parse_redis(url)  # as Redis's client reads it; one it cannot read: say Redis's words
    return parsed is None or bool(parsed.get("password"))


def _internal_error(exc: BaseException) -> NoReturn:
    """A bug: one line on the terminal, the traceback in a file the line names."""
    crash = Path(tempfile.gettempdir()) / f"chunkq-crash-{os.getpid()}.txt"
    try:
        crash.write_text(redact("".join(traceback.format_exception(exc))), encoding="utf-8")
        where = f"the traceback is in {crash}"
    except OSError:
        where = "run again with --log-level DEBUG for the traceback"
    log.debug("internal error", exc_info=exc)
    click.echo(
        f"chunkq: internal error: {type(exc).__name__}: {errors.first_line(str(exc))} (a bug in chunkq; "
        f"{where}); {RESUME_HINT}",
        err=True,
    )
    sys.exit(EXIT_INTERNAL)


def store_option(func: F) -> F:
    return click.option(
        "--store",
        default=DEFAULT_STORE,
        envvar=env_of("store"),
        show_default=True,
        show_envvar=True,
        callback=_open_store,
        help="Store shared by all hosts: a local or network path, or s3://bucket/prefix, gs://bucket/prefix.",
    )(func)


def _open_store(ctx: click.Context, param: click.Parameter, value: str) -> Path:
    try:
        return open_store(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc


REDIS_HELP = {
    "needed": "redis:// or rediss:// URL (password or ACL user included).",
    "embedded": "redis:// or rediss:// URL of a shared Redis; without one, an embedded server is "
    "started in the store for this run.",
    "live": "redis:// or rediss:// URL; optional: adds what only Redis knows (jobs queued and "
    "running) to what the store records.",
    "status": "redis:// or rediss:// URL; optional: adds what only Redis knows (jobs queued and "
    "running) to what the store records. Default: the embedded Redis of a `chunkq run` serving "
    "the store on this host, while one does.",
    "unused": "Accepted like on every command; this one reads the store alone.",
    "serves": "Accepted like on every command; this one serves the store's own Redis instead.",
    "forks": "Accepted like on every command; this one forks workers for pools, which reach Redis.",
}


def _readable_redis_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value:
        try:
            check_redis_url(value)
        except ConfigError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def redis_option(kind: str) -> Callable[[F], F]:
    """``--redis-url`` as every subcommand takes it; ``kind`` says what the command does with it."""
    return click.option(
        "--redis-url",
        envvar=env_of("redis_url"),
        show_envvar=True,
        help=REDIS_HELP[kind],
        callback=_readable_redis_url,
    )


def need_redis(url: str | None, store: Path | None = None) -> str:
    """The URL of a command that cannot work without Redis: the one given, else the store's own
    server while ``chunkq serve-redis`` (or a ``chunkq run``) serves it; or a usage error saying
    how to give one."""
    url = url or (served_url(store) if store is not None else None)
    if not url:
        raise click.UsageError(
            f"this command needs Redis: pass --redis-url, set {env_of('redis_url')}, or start "
            "`chunkq serve-redis` on the same store"
        )
    return url


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_LEVEL_ENV = env_of("log_level")


_level_given: list[bool] = []  # a --log-level (or CHUNKQ_LOG_LEVEL) was given: True when on the command line


def _set_log_level(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value:
        typed = ctx.get_parameter_source(str(param.name)) is ParameterSource.COMMANDLINE
        # `chunkq --log-level DEBUG run`: the subcommand's option falls back to CHUNKQ_LOG_LEVEL,
        # which must not undo the level typed before the subcommand's name.
        if not typed and any(_level_given):
            return value
        _level_given.append(typed)
        configure_logging(value)
    return value


def configure_logging(level: str) -> None:
    """The root logger's level, and the terminal's; the pool hands the level to its workers."""
    show_on_terminal(logging.getLevelName(level.upper()))
    logging.getLogger().setLevel(level.upper())


def quiet_unless(verbose: int) -> None:
    """``run`` and ``supervise``: the terminal shows the progress and warnings; ``-v`` INFO lines
    too, ``-vv`` DEBUG. A --log-level given (or CHUNKQ_LOG_LEVEL) sets the terminal's level itself.
    The run's log file gets INFO and up either way (supervisor.store.run_log)."""
    if _level_given and not verbose:
        return
    show_on_terminal({0: QUIET, 1: logging.INFO}.get(verbose, logging.DEBUG))


def verbose_option(func: F) -> F:
    return click.option(
        "-v",
        "--verbose",
        count=True,
        help="Log lines on the terminal too: -v INFO (each chunk, each worker), -vv DEBUG. "
        "By default the terminal shows the progress and warnings; INFO lines go to the run's "
        "log file (runs/RUN/logs/run.log).",
    )(func)


def log_level_option(func: F) -> F:
    """``--log-level``, taken before or after the subcommand's name alike."""
    return click.option(
        "--log-level",
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        envvar=LOG_LEVEL_ENV,
        show_envvar=True,
        expose_value=False,
        is_eager=True,
        callback=_set_log_level,
        help="How much chunkq logs on the terminal (default INFO; run and supervise: progress and "
        "warnings, see -v).",
    )(func)


def queue_option(func: F) -> F:
    return click.option(
        "--queue",
        default=DEFAULT_QUEUE,
        envvar=env_of("queue"),
        show_default=True,
        show_envvar=True,
        help="The RQ queue the run's jobs go to; pools take jobs from it.",
    )(func)


def reach_redis_if(url: str | None) -> redis.Redis | None:
    """A checked connection when a command was given Redis (optional for it), else None."""
    return reach_redis(url) if url else None
