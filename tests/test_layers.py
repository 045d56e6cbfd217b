"""The layers ARCHITECTURE.md draws, checked on the source: jobs/ -> queue_worker/ -> supervisor/ ->
the front door (chunkq/cli, chunkq/api.py). A module imports only its own layer and those before it,
at the top of a file or inside a function alike."""

from __future__ import annotations

import ast
import re
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


# The rooms inside supervisor/ and jobs/ (ARCHITECTURE.md, "The rooms"). A supervisor module imports
# only its own room and those before it; the modules beside the rooms (what the commands ask for,
# and `chunkq run`) may use all four.
SUPERVISOR_ROOMS = {"store": 0, "result": 1, "submit": 2, "watch": 3}
BESIDE_THE_ROOMS = len(SUPERVISOR_ROOMS)
LONG_MODULE_LINES = 450
TORCH = ("torch", "transformers", "sentence_transformers")


def _supervisor_rank(parts: list[str]) -> int:
    return SUPERVISOR_ROOMS.get(parts[0], BESIDE_THE_ROOMS) if parts else BESIDE_THE_ROOMS


def test_each_supervisor_room_imports_only_itself_and_the_rooms_before_it() -> None:
    folder = FOLDERS["supervisor"]
    modules = list(folder.rglob("*.py"))
    assert {p.parent.name for p in modules} >= set(SUPERVISOR_ROOMS)
    backward = []
    for path in modules:
        own = _supervisor_rank(list(path.relative_to(folder).parts[:-1]))
        for name in _imports(path):
            parts = name.split(".")
            if parts[:2] != ["chunkq", "supervisor"] or len(parts) < 3:
                continue
            if _supervisor_rank(parts[2:3]) > own:
                backward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert backward == []


def test_the_jobs_contract_imports_only_itself_and_never_torch() -> None:
    folder = FOLDERS["jobs"]
    contract = list((folder / "contract").glob("*.py"))
    assert len(contract) > 10
    wrong = []
    for path in contract:
        for name in _imports(path):
            parts = name.split(".")
            outside = parts[:2] == ["chunkq", "jobs"] and len(parts) > 2 and parts[2] != "contract"
            if outside or parts[0] in TORCH:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    # the computation and the kinds never reach up to the job function that uses them
    for path in [*(folder / "compute").glob("*.py"), *(folder / "kinds").glob("*.py")]:
        wrong += [f"{path.relative_to(ROOT)} imports {n}" for n in _imports(path) if n == "chunkq.jobs.embed"]
    assert wrong == []


def test_every_room_says_what_it_owns_and_what_it_may_import() -> None:
    rooms = [ROOT / "jobs" / r for r in ("contract", "compute", "kinds")]
    rooms += [ROOT / "supervisor" / r for r in SUPERVISOR_ROOMS]
    for room in rooms:
        doc = ast.get_docstring(ast.parse((room / "__init__.py").read_text())) or ""
        assert len(doc) > 150 and "import" in doc.lower(), room


def test_no_module_is_longer_than_the_house_allows_unless_architecture_names_it() -> None:
    """ARCHITECTURE.md's "Modules over 450 lines" names each longer one and the seam to split it."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    listed = text[text.index("### Modules over 450 lines") :]
    listed = listed[: listed.index("\n## ")]
    folders = [ROOT / d for d in ("jobs", "queue_worker", "supervisor")]
    folders += [ROOT / "chunkq" / d for d in ("cli", "tools", "sinks")]
    paths = [p for f in folders for p in f.rglob("*.py")] + [ROOT / "chunkq" / "api.py"]
    long = {str(p.relative_to(ROOT)) for p in paths if len(p.read_text().splitlines()) > LONG_MODULE_LINES}
    assert sorted(m for m in long if f"`{m}`" not in listed) == []


def test_the_architecture_names_every_module() -> None:
    """The inventory under ARCHITECTURE.md's "Layers" names every module of the house, so a reader
    who follows it misses none (a module is named by its file name, or bare in its room's list:
    "`contract/` (specs, manifest, ...)")."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    inventory = text[text.index("### Layers") : text.index("## Where each decision lives")]
    folders = [ROOT / d for d in ("jobs", "queue_worker", "supervisor")]
    folders += [ROOT / "chunkq" / d for d in ("cli", "tools", "sinks")]
    paths = [p for f in folders for p in f.rglob("*.py")] + [ROOT / "chunkq" / "api.py"]
    named = set(re.findall(r"(\w+)\.py", inventory)) | set(re.findall(r"[(,]\s*(\w+)(?=\s*[,)])", inventory))
    unnamed = sorted(
        str(p.relative_to(ROOT))
        for p in paths
        if p.stem not in ("__init__", "__main__") and p.stem not in named
    )
    assert unnamed == []


def test_a_worker_side_process_imports_nothing_of_the_front_door() -> None:
    """The pool, its fork server and each worker import the ``chunkq`` package; its API is loaded on
    first use, so they do not import the supervisor through it (0.3 s of CPU each: BENCHMARKS.md,
    "A small run's own cost"). ``chunkq.run`` still answers."""
    said = _a_new_interpreters_answer(
        "import sys, chunkq.queue_worker.pool, chunkq.queue_worker.worker, chunkq.queue_worker.fork_server\n"
        "print(sorted(m for m in sys.modules if m == 'chunkq.api' or m.startswith('chunkq.supervisor')))\n"
        "import chunkq; print(chunkq.run.__module__)"
    )
    assert said.split("\n")[:2] == ["[]", "chunkq.api"], said


def test_the_command_line_imports_what_only_some_commands_use_when_they_use_it() -> None:
    """rich (the bar on a terminal), prometheus_client (``--metrics-port``) and the pool's modules
    (``chunkq pool``) cost 10-100 ms of CPU each in every command that imports them: importing the
    command line imports none of them (BENCHMARKS.md, "A small run's own cost, again")."""
    said = _a_new_interpreters_answer(
        "import sys, chunkq.cli\n"
        "optional = ('rich', 'prometheus_client', 'chunkq.queue_worker.pool')\n"
        "print(sorted(m for m in optional if m in sys.modules))"
    )
    assert said.strip() == "[]", said


def _a_new_interpreters_answer(probe: str) -> str:
    """What ``probe`` prints in a new interpreter: what it imports is its own, not this process's."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    ).stdout
