"""``chunkq`` options built from the settings schemas: a pool setting (``jobs/contract/settings.py``)
becomes a ``chunkq pool`` option, and a ``chunkq run`` option unless run decides it itself; a run
option (``supervisor/run_options.py``) becomes an option of the commands that take it; each with its
flag, type, default, environment variable, help and check, all from the one entry."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import click

from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.settings import Meta, PoolSettings, flag, schema
from chunkq.jobs.contract.units import DURATION_FORMS, duration_seconds
from chunkq.supervisor.run_options import RUN_OPTIONS, run_option

F = TypeVar("F", bound=Callable[..., Any])


def _split_list(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(item for value in values for item in value.split(",") if item)


def _parsed_by(parse: Callable[[str], Any]) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback from a schema's parser: its ConfigError is a usage error naming the option."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None or not isinstance(value, str):
            return value
        try:
            return parse(value)
        except ConfigError as exc:
            raise click.BadParameter(str(exc)) from exc

    return callback


if TYPE_CHECKING:
    _ParamType = click.ParamType[float, Any]  # generic from click 8.2; pyproject allows 8.1
else:
    _ParamType = click.ParamType


class Seconds(_ParamType):
    """A span of time as the docs write it: 600, 10m, 12h (--recycle-after 10m was
    refused, seconds only)."""

    name = "seconds"

    def __init__(self, low: float | None) -> None:
        self.low = low

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        seconds = value if isinstance(value, int | float) else duration_seconds(str(value))
        if seconds is None or (self.low is not None and seconds < self.low):
            self.fail(f"{value!r}: give {DURATION_FORMS}", param, ctx)
        return float(seconds)


def schema_option(name: str, meta: Meta, default: Any) -> Callable[[F], F]:
    """The click option of one schema entry."""
    kwargs: dict[str, Any] = {"help": meta.help, "envvar": meta.env_name(name), "show_envvar": True}
    option = flag(name, meta)
    if meta.kind == "switch" or (meta.kind == "flag" and default):
        # A switch whose default is None is left unset unless given: the default depends on others.
        return click.option(
            f"{option}/--no-{option[2:]}",
            name,
            default=None if default is None else bool(default),
            show_default=default is not None,
            **kwargs,
        )
    if meta.kind == "flag":
        return click.option(option, name, is_flag=True, default=default, **kwargs)
    if meta.kind == "list":
        return click.option(option, name, multiple=True, callback=_split_list, **kwargs)
    if meta.kind == "choice":
        kind: Any = click.Choice(meta.choices)
    elif meta.kind in ("int", "float"):
        range_type = click.IntRange if meta.kind == "int" else click.FloatRange
        kind = range_type(meta.low, meta.high)  # type: ignore[arg-type]
    elif meta.kind == "duration":
        kind = Seconds(meta.low)
    else:
        kind = str
    return click.option(
        option,
        name,
        type=kind,
        default=default,
        show_default=default is not None,
        callback=_parsed_by(meta.parse) if meta.parse else None,
        **kwargs,
    )


def _schema_options(entries: list[tuple[str, Meta, Any]]) -> Callable[[F], F]:
    """Click options for ``entries``, in their order in ``--help``."""

    def decorate(func: F) -> F:
        for name, meta, default in reversed(entries):
            func = schema_option(name, meta, default)(func)
        return func

    return decorate


def pool_setting_options(exclude: Iterable[str] = ()) -> Callable[[F], F]:
    """Click options for every CLI pool setting not in ``exclude``."""
    skip = set(exclude)
    return _schema_options([(n, m, d) for n, m, d in schema() if m.cli and n not in skip])


def pool_settings(values: dict[str, Any], **fixed: Any) -> PoolSettings:
    """PoolSettings from click's values (pool settings are picked out by name) and ``fixed`` ones."""
    names = _names(lambda meta: True)
    given = {k: v for k, v in values.items() if k in names and v is not None}
    return replace(PoolSettings(), **{**given, **fixed})


def pop_pool_values(values: dict[str, Any], exclude: Iterable[str] = ()) -> dict[str, Any]:
    """Take the pool options (as ``pool_setting_options(exclude)`` made them) out of a command's click
    values; the rest are the command's own."""
    skip = set(exclude)
    names = _names(lambda meta: meta.cli) - skip
    return {k: values.pop(k) for k in list(values) if k in names}


def _names(keep: Callable[[Meta], bool]) -> set[str]:
    return {name for name, meta, _default in schema() if keep(meta)}


def run_options(receiver: str) -> Callable[[F], F]:
    """Click options for every run option of ``receiver`` (submit or watch)."""
    return _schema_options([o for o in RUN_OPTIONS if o[1].receiver == receiver])


def run_option_flag(name: str) -> Callable[[F], F]:
    """The click option of one run option (a command that takes it alone)."""
    return schema_option(*run_option(name))
