"""The layers ARCHITECTURE.md draws, checked on the source: jobs/ -> queue_worker/ -> supervisor/ ->
the front door (chunkq/cli, chunkq/api.py). A module imports only its own layer and those before it,
at the top of a file or inside a function alike."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"jobs": 0, "queue_worker": 1, "supervisor": 2, "cli": 3, "api": 3, "tools": 3, "sinks": 3}
FOLDERS = {"jobs": ROOT / "jobs", "queue_worker": ROOT / "queue_worker", "supervisor": ROOT / "supervisor"}


def _layer_of_import(name: str) -> int | None:
    parts = name.split(".")
    if parts[0] != "chunkq" or len(parts) < 2:
        return None
    return LAYERS.get(parts[1])


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_each_module_imports_only_its_own_layer_and_those_before_it() -> None:
    modules = [(layer, p) for layer, folder in FOLDERS.items() for p in folder.rglob("*.py")]
    modules += [("cli", p) for p in (ROOT / "chunkq" / "cli").glob("*.py")]
    modules += [("api", ROOT / "chunkq" / "api.py")]
    modules += [("tools", p) for p in (ROOT / "chunkq" / "tools").glob("*.py")]
    modules += [("sinks", p) for p in (ROOT / "chunkq" / "sinks").glob("*.py")]
    assert len(modules) > 60
    upward = []
    for layer, path in modules:
        for name in _imports(path):
            target = _layer_of_import(name)
            if target is not None and target > LAYERS[layer]:
                upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert upward == []
