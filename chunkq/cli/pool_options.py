"""``chunkq`` options built from the settings schema (``queue_worker/settings.py``): a pool setting
becomes a ``chunkq pool`` option, and a ``chunkq run`` option unless run decides it itself, with its
flag, type, default, environment variable and help, all from the one field."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, TypeVar

import click

from chunkq.queue_worker.gpus import WORKERS_AUTO
from chunkq.queue_worker.settings import Meta, PoolSettings, flag, schema

F = TypeVar("F", bound=Callable[..., Any])


def _split_list(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(item for value in values for item in value.split(",") if item)


def _workers_value(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if value == WORKERS_AUTO or (value.isdigit() and int(value) >= 1):
        return value
    raise click.BadParameter(f"{value!r}: give a number of workers (1 or more) or 'auto'")


_CALLBACKS: dict[str, Callable[..., Any]] = {"workers_per_gpu": _workers_value}


def _option(name: str, meta: Meta, default: Any) -> Callable[[F], F]:
    kwargs: dict[str, Any] = {"help": meta.help, "envvar": meta.env_name(name), "show_envvar": True}
    option = flag(name, meta)
    if meta.kind == "flag" and default:
        return click.option(f"{option}/--no-{option[2:]}", name, default=True, show_default=True, **kwargs)
    if meta.kind == "flag":
        return click.option(option, name, is_flag=True, **kwargs)
    if meta.kind == "list":
        return click.option(option, name, multiple=True, callback=_split_list, **kwargs)
    if meta.kind == "choice":
        kind: Any = click.Choice(meta.choices)
    elif meta.kind in ("int", "float"):
        range_type = click.IntRange if meta.kind == "int" else click.FloatRange
        kind = range_type(meta.low, meta.high)  # type: ignore[arg-type]
    else:
        kind = str
    return click.option(
        option,
        name,
        type=kind,
        default=default,
        show_default=default is not None,
        callback=_CALLBACKS.get(name),
        **kwargs,
    )


def pool_setting_options(exclude: Iterable[str] = ()) -> Callable[[F], F]:
    """Click options for every CLI pool setting not in ``exclude``."""
    skip = set(exclude)
    chosen = [(n, m, d) for n, m, d in schema() if m.cli and n not in skip]

    def decorate(func: F) -> F:
        for name, meta, default in reversed(chosen):
            func = _option(name, meta, default)(func)
        return func

    return decorate


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
