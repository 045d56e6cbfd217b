"""The walk of a command through the house (issue 66): which of chunkq's modules it passes through,
in the order each of its functions is first called.

``python bench/walks.py STORE RUN_ID`` runs ``status``, ``report``, ``export`` and
``assemble --verify`` of a published run in this process under ``sys.setprofile`` and prints, for
each, its *stays* (runs of consecutive first calls in one module), *rooms* (distinct modules) and
*returns* (stays in a module already left once: stays - rooms), as JSON. A function called again is
not counted again, so loops do not inflate the walk; what is counted is how often following the
command's path means opening another file, and how often one already read.
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
        cli.main(args, prog_name="chunkq", standalone_mode=False)
    except SystemExit:
        pass
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
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
