"""The layers ARCHITECTURE.md draws (docs/house.md in detail), checked on the source: jobs/ ->
queue_worker/ -> supervisor/ -> the front door (chunkq/cli, chunkq/api.py). A module imports only its
own layer and those before it, at the top of a file or inside a function alike."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"jobs": 0, "queue_worker": 1, "supervisor": 2, "cli": 3, "api": 3, "tools": 3, "sinks": 3}
FRONT_DOOR = 3
_FRONT_DOOR_NAMES = ("chunkq.__main__", "chunkq.api", "chunkq.run", "chunkq.embed", "chunkq.RunResult")
FOLDERS = {"jobs": ROOT / "jobs", "queue_worker": ROOT / "queue_worker", "supervisor": ROOT / "supervisor"}


def _layer_of_import(name: str) -> int | None:
    parts = name.split(".")
    if parts[0] != "chunkq":
        return None
    if len(parts) < 2:
        return FRONT_DOOR  # `import chunkq`: the package's own module is the front door's
    return LAYERS.get(parts[1], FRONT_DOOR if name.startswith(_FRONT_DOOR_NAMES) else None)


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


# The rooms inside supervisor/ and jobs/ (ARCHITECTURE.md's table). A supervisor module imports
# only its own room and those before it; the modules beside the rooms (what the commands ask for,
# and `chunkq run`) may use all six.
SUPERVISOR_ROOMS = {"corpus": 0, "store": 1, "server": 2, "result": 3, "submit": 4, "watch": 5}
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
    rooms = [ROOT / "jobs" / r for r in ("contract", "queue", "drills", "compute", "kinds")]
    rooms += [ROOT / "supervisor" / r for r in SUPERVISOR_ROOMS]
    for room in rooms:
        doc = ast.get_docstring(ast.parse((room / "__init__.py").read_text())) or ""
        assert len(doc) > 150 and "import" in doc.lower(), room


RQ_DOOR = ROOT / "jobs" / "queue" / "rq_api.py"
HOUSE = ROOT / "docs" / "house.md"
ONE_SCREEN = 60  # lines: ARCHITECTURE.md is the map, docs/house.md the rest


def test_the_architecture_is_one_screen_with_a_row_for_every_room() -> None:
    """Issue 66.9: ARCHITECTURE.md was 540 lines; now a map and a table of rooms, every room (a
    package of the house) in it, the detail in docs/house.md."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    assert len(text.splitlines()) <= ONE_SCREEN
    rooms = {
        p.parent for d in ("jobs", "queue_worker", "supervisor") for p in (ROOT / d).rglob("__init__.py")
    }
    rows = set(re.findall(r"^\| `([\w/]+)/`", text, re.M))
    missing = sorted(str(r.relative_to(ROOT)) for r in rooms if str(r.relative_to(ROOT)) not in rows)
    assert len(rooms) >= 10 and missing == []


def _product_modules() -> list[Path]:
    folders = [ROOT / d for d in ("jobs", "queue_worker", "supervisor")]
    folders += [ROOT / "chunkq" / d for d in ("cli", "tools", "sinks")]
    return [p for f in folders for p in f.rglob("*.py")] + [ROOT / "chunkq" / "api.py"]


def _reaches_rq(names: list[str]) -> list[str]:
    return [n for n in names if n == "rq" or n.startswith("rq.")]


def test_the_queue_is_behind_one_door() -> None:
    """Issue 66.4: RQ was imported by 16 modules in all four layers; now by ``jobs/queue/rq_api.py``
    alone (rq-dashboard, a separate package, by the dashboard that serves it)."""
    through = [
        str(p.relative_to(ROOT)) for p in _product_modules() if p != RQ_DOOR and _reaches_rq(_imports(p))
    ]
    assert through == []
    assert _reaches_rq(_imports(RQ_DOOR))  # the door itself: the check sees an import of rq
    # What still calls RQ's classes through the door rather than the queue room's functions, each
    # by nature: the worker (an RQ worker), the job (its own job) and the dashboard (rq-dashboard's).
    # The tracker's bulk reads, the enqueueing and the pool's watchdog moved into the room.
    direct = {
        "chunkq.jobs.embed",
        "chunkq.queue_worker.worker",
        "chunkq.queue_worker.chunk_worker",
        "chunkq.tools.dashboard",
    }
    graph = import_graph()
    callers = {m for m, to in graph.items() if "chunkq.jobs.queue.rq_api" in to}
    assert sorted(callers - direct) == sorted(m for m in callers if m.startswith("chunkq.jobs.queue."))
    queue_room = {p.stem for p in (ROOT / "jobs" / "queue").glob("*.py")}
    assert {"rq_api", "queueing", "run_queues", "abandon", "allowlist", "nopickle", "jobmeta"} <= queue_room
    assert {"enqueue", "queue_lists"} <= queue_room


def test_no_module_is_longer_than_the_house_allows_unless_architecture_names_it() -> None:
    """docs/house.md's "Modules over 450 lines" names each longer one and the seam to split it."""
    text = HOUSE.read_text()
    listed = text[text.index("### Modules over 450 lines") :]
    listed = listed[: listed.index("\n## ")]
    folders = [ROOT / d for d in ("jobs", "queue_worker", "supervisor")]
    folders += [ROOT / "chunkq" / d for d in ("cli", "tools", "sinks")]
    paths = [p for f in folders for p in f.rglob("*.py")] + [ROOT / "chunkq" / "api.py"]
    long = {str(p.relative_to(ROOT)) for p in paths if len(p.read_text().splitlines()) > LONG_MODULE_LINES}
    assert sorted(m for m in long if f"`{m}`" not in listed) == []


def test_the_architecture_names_every_module() -> None:
    """The inventory under docs/house.md's "Layers" names every module of the house, so a reader
    who follows it misses none (a module is named by its file name, or bare in its room's list:
    "`contract/` (specs, manifest, ...)")."""
    text = HOUSE.read_text()
    inventory = text[text.index("### Layers") : text.index("## Where each decision lives")]
    folders = [ROOT / d for d in ("jobs", "queue_worker", "supervisor")]
    folders += [ROOT / "chunkq" / d for d in ("cli", "tools", "sinks")]
    paths = [p for f in folders for p in f.rglob("*.py")] + [ROOT / "chunkq" / "api.py"]
    named = set(re.findall(r"(\w+)\.py", inventory))
    for listed in re.findall(r"`\w+/` \(([^)]*)\)", inventory):  # a room's list: its one-word items only
        named |= {item.strip() for item in re.split(r"[,:]", listed) if re.fullmatch(r"\s*\w+\s*", item)}
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
        "import sys, chunkq.queue_worker.processes.pool, chunkq.queue_worker.worker\n"
        "import chunkq.queue_worker.processes.fork_server\n"
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
        "optional = ('rich', 'prometheus_client', 'chunkq.queue_worker.processes.pool')\n"
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


def _module_names() -> dict[str, Path]:
    """Every module of the house by the name it is imported as."""
    found = {}
    for folder, package in (("jobs", "chunkq.jobs"), ("queue_worker", "chunkq.queue_worker"),
                            ("supervisor", "chunkq.supervisor"), ("chunkq", "chunkq")):  # fmt: skip
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if folder == "chunkq" and parts[0] == "jobs":
                continue  # the link to jobs/, found above
            found[".".join([package, *(p for p in parts if p != "__init__")])] = path
    return found


def _runtime_imports(path: Path) -> list[str]:
    """What a module imports when it runs (at its top or in a function; not `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    names = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (the package itself where a name is not a module), every
    import a module runs included: a function-level import hides a cycle from nobody."""
    modules = _module_names()

    def module_of(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {module_of(n) for n in _runtime_imports(path)}
        graph[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_the_import_graph_has_no_cycle_function_level_imports_included() -> None:
    """Issue 66.3: four import circles were hidden by function-level imports; the layer tests read
    each import but never the graph."""
    graph = import_graph()
    assert len(graph) > 150 and sum(map(len, graph.values())) > 500  # the whole graph, not a sample
    assert cycles(graph) == []


def test_the_cycle_check_sees_an_injected_cycle_and_the_front_door() -> None:
    """The checks fail on what they are for: a cycle made of two imports inside functions, and a
    room's `import chunkq` (the front door's module) as an upward arrow."""
    graph = import_graph()
    graph["chunkq.jobs.contract.units"].add("chunkq.jobs.contract.run_files")
    graph["chunkq.jobs.contract.run_files"].add("chunkq.jobs.contract.units")
    assert ["chunkq.jobs.contract.run_files", "chunkq.jobs.contract.units"] in cycles(graph)
    assert _layer_of_import("chunkq") == FRONT_DOOR > LAYERS["queue_worker"]
    assert _layer_of_import("chunkq.api") == FRONT_DOOR and _layer_of_import("chunkq.jobs.kinds") == 0


def test_reading_a_published_result_never_reaches_the_submit_room() -> None:
    """Issue 66.5: export and the sinks reached into supervisor/submit/ (the corpus reader for
    --columns, the tokenizer for --tokens); nothing they import, however deep, is of that room now."""
    graph = import_graph()
    readers = [*(m for m in graph if m.startswith("chunkq.sinks"))]
    reached, todo = set(readers), list(readers)
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in reached:
                reached.add(target)
                todo.append(target)
    assert "chunkq.supervisor.result.reader" in reached  # the walk follows the imports
    assert sorted(m for m in reached if m.startswith("chunkq.supervisor.submit")) == []
