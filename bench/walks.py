"""The walk of a command through the house (issue 66): which of chunkq's modules it passes through,
in the order each of its functions is first called.

``python bench/walks.py STORE RUN_ID`` runs ``status``, ``report``, ``export`` and ``assemble
--verify`` of a published run in this process under ``sys.setprofile``, then the walk of a chunk (a
20-row run submitted to a Redis of its own, one worker run in this process, ``--burst --max-jobs
1``: start, model, one job, exit), and prints, for each, its *stays* (runs of consecutive first
calls in one module), *rooms* (distinct modules) and *returns* (stays in a module already left once:
stays - rooms), as JSON. A function called again is not counted again, so loops do not inflate the
walk; what is counted is how often following the command's path means opening another file, and how
often one already read.

A setting's walk is static: for each of a few settings, the modules whose source names it (its
field, its flag or its variable), where a reader follows it from the command line to its use.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOMS = ("/jobs/", "/queue_worker/", "/supervisor/", "/chunkq/")


def _module(filename: str) -> str | None:
    path = os.path.realpath(filename)
    if not any(room in path for room in ROOMS) or "/site-packages/" in path or "/tests/" in path:
        return None
    for room in ROOMS:
        if room in path:
            return room.strip("/") + "/" + path.split(room, 1)[1]
    return None


def walk(args: list[str]) -> dict[str, Any]:
    """The walk of ``chunkq ARGS`` in this process."""
    from chunkq.cli import cli

    def command() -> None:
        try:
            cli.main(args, prog_name="chunkq", standalone_mode=False)
        except SystemExit:
            pass

    return profiled(command)


def profiled(call: Any) -> dict[str, Any]:
    """The walk of ``call()`` in this process."""
    seen: set[Any] = set()
    order: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code in seen or frame.f_code.co_name == "<module>":
            return
        seen.add(frame.f_code)
        module = _module(frame.f_code.co_filename)
        if module is not None:
            order.append(module)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    stays = [m for i, m in enumerate(order) if i == 0 or order[i - 1] != m]
    rooms = len(set(stays))
    figures: dict[str, Any] = {"stays": len(stays), "rooms": rooms, "returns": len(stays) - rooms}
    figures["functions"] = len(order)
    if os.environ.get("WALKS_PATH"):
        figures["path"] = stays
    return figures


def main() -> None:
    store, run_id = sys.argv[1], sys.argv[2]
    out = Path(tempfile.mkdtemp())
    commands = {
        "status": ["status", run_id, "--store", store],
        "report": ["report", run_id, "--store", store, "--out", str(out / "report")],
        "export": ["export", run_id, "--store", store, "--out", str(out / "x.parquet")],
        "assemble --verify": ["assemble", run_id, "--verify", "--store", store],
    }
    figures = {}
    for name, args in commands.items():
        import click.testing

        with click.testing.CliRunner().isolation():
            figures[name] = walk(args)
    figures["a chunk (worker start to exit)"] = chunk_walk(out)
    figures["settings (modules naming each)"] = setting_walks()
    print(json.dumps(figures, indent=2))


def chunk_walk(scratch: Path) -> dict[str, Any]:
    """The walk of one worker process's life around one chunk, in this process."""
    from chunkq.cli import cli
    from chunkq.jobs.contract.settings import env_of
    from chunkq.queue_worker import worker
    from chunkq.supervisor.server.embedded_redis import EmbeddedRedis

    corpus = scratch / "walk.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": str(i), "text": f"text number {i}"}) + "\n" for i in range(20))
    )
    store = scratch / "walk-store"
    with EmbeddedRedis(scratch / "walk-redis").start() as server:
        submit = [
            "submit",
            str(corpus),
            "--store",
            str(store),
            "--redis-url",
            server.url,
            "--chunk-size",
            "20",
        ]
        cli.main(submit, prog_name="chunkq", standalone_mode=False)
        os.environ[env_of("redis_url")] = server.url
        return profiled(lambda: worker.main(["--burst", "--max-jobs", "1", "--store", str(store)]))


SETTINGS = {  # a setting: its field name, its flag, its environment variable
    "batch_size": ("batch_size", "--batch-size", "CHUNKQ_BATCH_SIZE"),
    "recycle_after": ("recycle_after", "--recycle-after", "CHUNKQ_RECYCLE_AFTER"),
    "queue_window": ("queue_window", "--queue-window", "CHUNKQ_QUEUE_WINDOW"),
    "output_dtype": ("output_dtype", "--output-dtype", "CHUNKQ_OUTPUT_DTYPE"),
}


def setting_walks() -> dict[str, int]:
    """How many of the product's modules name each setting."""
    root = Path(__file__).resolve().parent.parent
    sources = [p for d in ("jobs", "queue_worker", "supervisor", "chunkq") for p in (root / d).rglob("*.py")]
    texts = {p: p.read_text() for p in sources if "__pycache__" not in p.parts}  # rglob skips the links
    return {name: sum(any(n in t for n in names) for t in texts.values()) for name, names in SETTINGS.items()}


if __name__ == "__main__":
    main()
