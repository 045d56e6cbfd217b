"""Every command's ``--help`` in sections, each option in its first sentence; ``--help-all`` gives
each option's whole text. ``chunkq run`` takes over fifty options: in one flat list of full
paragraphs its help ran to 229 lines."""

from __future__ import annotations

import textwrap
from typing import Any

import click

# Which section each option (by its parameter name) is shown in, in this order; the rest: "Other".
SECTIONS: tuple[tuple[str, frozenset[str]], ...] = (
    ("The corpus", frozenset({"fmt", "text_field", "pair_field", "id_field", "run_id", "chunk_size"})),
    (
        "The model",
        frozenset(
            {"model", "kind", "role", "revision", "trust_remote_code", "model_kwargs", "precision", "backend"}
            | {"accept_unidentified_code"}
            | {"allowed_models", "preload"}
        ),
    ),
    (
        "Encoding",
        frozenset(
            {"batch_size", "batch_tokens", "normalize", "max_seq_length", "prompt", "prompt_name"}
            | {"truncate_dim", "output_dtype", "max_active_dims", "allow_missing", "cache"}
            | {"long_texts", "window_tokens", "window_stride", "pool"}
        ),
    ),
    (
        "Workers and GPUs",
        frozenset(
            {"gpus", "min_free_memory", "gpu_memory_limit", "busy_gpus", "workers_per_gpu", "cpu_workers"}
            | {"max_jobs"}
            | {"recycle_after", "max_jobs_jitter", "crash_limit", "crash_window", "hung_grace"}
            | {"standby", "fork_server", "name", "job_timeout"}
        ),
    ),
    (
        "Watching the run and its result",
        frozenset(
            {"queue_window", "shard_size", "poll", "max_attempts", "allow_partial", "metrics_port"}
            | {"keep_outputs"}
            | {"wait", "warn_idle", "stale_after"}
        ),
    ),
    ("The output", frozenset({"out_format", "out", "to", "index", "vector_column", "columns", "level"})),
    ("Where", frozenset({"store", "queue", "priority", "redis_url"})),
)
OTHER = "Other"
HELP_ALL = "--help-all"
# Sections a long command's --help lists by name only: the fleet's and the watch's tuning, which most
# runs leave at their defaults (a command with more options than LONG_COMMAND).
BY_NAME = frozenset({"Workers and GPUs", "Watching the run and its result"})
LONG_COMMAND = 25
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.")


def first_sentence(text: str) -> str:
    """``text`` up to its first full stop outside brackets (a model name's dots stay)."""
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(char, 0)
        ends = i + 1 == len(text) or text[i + 1] == " "
        if char == "." and depth == 0 and ends and not text[: i + 1].endswith(_ABBREVIATIONS):
            return text[: i + 1]
    return text


def _brief(record: str) -> str:
    """An option's first sentence, with click's ``[env var: ...; default: ...]`` kept."""
    body, sep, extra = record.rpartition("  [")
    if not sep or not record.endswith("]"):
        return first_sentence(record)
    return f"{first_sentence(body)}  [{extra}"


def _write_names(formatter: click.HelpFormatter, text: str) -> None:
    """``text`` wrapped at spaces only: click's wrapping breaks at hyphens, and a flag split over
    two lines (``--max-jobs-`` / ``jitter``) can be neither read nor searched for."""
    indent = formatter.current_indent
    width = max((formatter.width or 80) - indent, 20)
    for line in textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False):
        formatter.write(f"{'':>{indent}}{line}\n")


def _section_of(name: str | None) -> str:
    return next((title for title, names in SECTIONS if name in names), OTHER)


def _show_all(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    ctx.meta[HELP_ALL] = True
    click.echo(ctx.get_help(), color=ctx.color)
    ctx.exit()


class SectionedCommand(click.Command):
    """A command whose options are shown by section, briefly unless ``--help-all`` is given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.append(
            click.Option(
                [HELP_ALL],
                is_flag=True,
                expose_value=False,
                is_eager=True,
                callback=_show_all,
                help="Show every option's whole text (--help gives each its first sentence).",
            )
        )

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        whole = bool(ctx.meta.get(HELP_ALL))
        grouped: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is None:  # arguments: the usage line and the command's text name them
                continue
            name, text = record
            grouped.setdefault(_section_of(param.name), []).append((name, text if whole else _brief(text)))
        long = sum(len(records) for records in grouped.values()) > LONG_COMMAND
        for title in [t for t, _ in SECTIONS] + [OTHER]:
            records = grouped.get(title)
            if not records:
                continue
            with formatter.section(title):
                if long and not whole and title in BY_NAME:
                    names = ", ".join(name.split()[0] for name, _ in records)
                    _write_names(formatter, f"{names} ({HELP_ALL} says what each does)")
                else:
                    formatter.write_dl(records)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_epilog(ctx, formatter)
        if not ctx.meta.get(HELP_ALL):
            formatter.write_paragraph()
            formatter.write_text(f"Each option in its first sentence; {HELP_ALL} gives the whole text.")
