"""Issue 63.1: a --trust-remote-code model's identity covers the code its load and first encode run
outside its folder (jobs/compute/model_code.py); what cannot be identified is refused in one line
unless --accept-unidentified-code, which turns the vector cache off."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from chunkq.jobs.compute import code_probe, model_code
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.queue_worker.exit_codes import EXIT_CONFIG
from tests.helpers import make_texts, max_abs_diff, result_of, run_cli, write_corpus
from tests.tiny_models import bundled_copy

# A bound for the tests that run several watched loads (each a fresh interpreter loading the model
# and compiling its modules from source): 120-240 s at rest, over 300 s beside two busy cores.
LOADS_TIMEOUT = 900

# What every test module class ends with: sentence-transformers saves and loads it by its config.
_SAVE_AND_LOAD = """
    def save(self, output_path, *args, **kwargs):
        self.save_config(output_path)

    @classmethod
    def load(cls, model_name_or_path="", subfolder="", **kwargs):
        return cls()
"""

# An installed package's sentence-transformers module: it scales each vector by a number read from a
# data file of its own, and adds one from another package it imports; neither is in the model's folder.
_MODULE = (
    """
import json, os
from sentence_transformers.base.modules.module import Module
import {const}
{extra}

class Shift(Module):
    config_keys: list = []

    def forward(self, features):
        with open(os.path.join(os.path.dirname(__file__), "scale.json")) as fh:
            scale = json.load(fh)["scale"]
        features["sentence_embedding"] = features["sentence_embedding"] * scale + {const}.SHIFT
        return features
"""
    + _SAVE_AND_LOAD
)


def _site(root: Path, name: str, extra: str = "") -> Path:
    """Packages ``<name>pool`` (the module class) and ``<name>const`` (what it imports) under ``root``."""
    (root / f"{name}pool").mkdir(parents=True)
    (root / f"{name}const").mkdir()
    (root / f"{name}pool" / "__init__.py").write_text(_MODULE.format(const=f"{name}const", extra=extra))
    (root / f"{name}pool" / "scale.json").write_text('{"scale": 1.0}')
    (root / f"{name}const" / "__init__.py").write_text("SHIFT = 0.0\n")
    for package in (f"{name}pool", f"{name}const"):  # installed, as pip installs them
        info = root / f"{package}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
        (info / "top_level.txt").write_text(f"{package}\n")
        files = [p.relative_to(root).as_posix() for p in (root / package).iterdir()]
        (info / "RECORD").write_text("".join(f"{f},,\n" for f in [*files, f"{info.name}/RECORD"]))
    return root


def _shifted_model(folder: Path, name: str) -> Path:
    """The bundled model with the package's module between its pooling and its normalisation."""
    bundled_copy(folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "shift", "path": "shift", "type": f"{name}pool.Shift"})
    for index, module in enumerate(modules):
        module["idx"] = index
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "shift").mkdir()
    (folder / "shift" / "config.json").write_text("{}")
    return folder


def _fresh_encode(model: Path, site: Path, texts: list[str], **env_extra: str) -> np.ndarray:
    """A plain encode, the reference a user would compare with: in this process, the site's packages
    imported afresh from their source as a fresh interpreter would import them (one took ~4 s of
    CPU a reference, seven a file)."""
    from sentence_transformers import SentenceTransformer

    packages = {p.name for p in site.iterdir() if p.is_dir() and not p.name.endswith(".dist-info")}
    for name in [m for m in sys.modules if m.partition(".")[0] in packages]:
        del sys.modules[name]
    importlib.invalidate_caches()
    saved_env, saved_bytecode = dict(os.environ), sys.dont_write_bytecode
    sys.path.insert(0, str(site))
    sys.dont_write_bytecode = True  # a file rewritten within its second keeps its size: no stale .pyc
    try:
        os.environ.update(env_extra)
        loaded = SentenceTransformer(str(model), device="cpu", trust_remote_code=True)
        return np.asarray(loaded.encode(texts))
    finally:
        sys.path.remove(str(site))
        sys.dont_write_bytecode = saved_bytecode
        os.environ.clear()
        os.environ.update(saved_env)


def _latest(store: Path) -> RunLayout:
    runs = sorted((store / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    return RunLayout(store, runs[-1].name)


@pytest.mark.slow
@pytest.mark.timeout(LOADS_TIMEOUT)
def test_code_outside_the_folder_changed_is_encoded_again_not_served_from_the_cache(tmp_path: Path) -> None:
    """The hostile pass's two variants: the package a module class imports, then a data file it reads,
    changed after a run; the same texts again in the same store are encoded again and equal a fresh
    encode. Before: "0 encoded, 40 from the vector cache", max abs diff 1.25 and 15.2."""
    site = _site(tmp_path / "site", "shift")
    model = _shifted_model(tmp_path / "model", "shift")
    ids, texts = make_texts(40, seed=63)
    store = tmp_path / "store"
    common = ["--store", str(store), "--chunk-size", "20", "--model", str(model), "--trust-remote-code"]
    env = {"PYTHONPATH": str(site), "CHUNKQ_FORK_SERVER_SOCKET": ""}  # the pool's own imports the package
    first = run_cli("run", str(write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl")), *common, **env)
    assert first.returncode == 0, first.stderr[-3000:]
    changes = [
        (site / "shiftconst" / "__init__.py", "SHIFT = 0.5\n"),
        (site / "shiftpool" / "scale.json", '{"scale": 3.0}'),
    ]
    for round_, (path, text) in enumerate(changes):
        path.write_text(text)
        corpus = write_corpus(tmp_path / f"b{round_}.jsonl", [f"b{round_}-{i}" for i in ids], texts, "jsonl")
        again = run_cli("run", str(corpus), *common, **env)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "40 encoded, 0 from the vector cache" in again.stdout + again.stderr, again.stderr[-2000:]
        got, got_ids = result_of(_latest(store))
        assert got_ids == [f"b{round_}-{i}" for i in ids]
        assert max_abs_diff(got, _fresh_encode(model, site, texts)) <= 1e-5
    manifest = json.loads(_latest(store).manifest.read_text())
    listed = {entry["name"] for entry in manifest["model_code"]}
    assert listed == {"shiftconst/__init__.py", "shiftpool/__init__.py", "shiftpool/scale.json"}
    assert manifest["model_identity"].endswith(
        model_code.CODE_TAG
        + model_code.Listing(
            tuple((e["name"], e["sha256"], e["package"]) for e in manifest["model_code"])
        ).digest()
    )


# A module class whose forward imports a helper only for batches larger than the canary's four texts:
# code the load and its warm-up never run (the hostile pass's 1a, a lazy import for some inputs).
_LATE_MODULE = (
    """
from sentence_transformers.base.modules.module import Module

class Shift(Module):
    config_keys: list = []

    def forward(self, features):
        if features["sentence_embedding"].shape[0] > 4:
            import {name}late
            features["sentence_embedding"] = features["sentence_embedding"] + {name}late.SHIFT
        return features
"""
    + _SAVE_AND_LOAD
)


@pytest.mark.slow
@pytest.mark.timeout(LOADS_TIMEOUT)
def test_code_only_the_encode_reads_keeps_the_runs_vectors_out_of_the_cache(tmp_path: Path) -> None:
    """A helper the forward imports only for some inputs, changed after a run: the same texts again
    are encoded again, equal to a fresh encode (on the code before, all 40 came from the cache)."""
    site = _site(tmp_path / "site", "late")
    (site / "latepool" / "__init__.py").write_text(_LATE_MODULE.format(name="late"))
    (site / "latelate").mkdir()
    (site / "latelate" / "__init__.py").write_text("SHIFT = 0.0\n")
    model = _shifted_model(tmp_path / "model", "late")
    ids, texts = make_texts(40, seed=64)
    store = tmp_path / "store"
    common = ["--store", str(store), "--chunk-size", "20", "--model", str(model), "--trust-remote-code"]
    env = {"PYTHONPATH": str(site), "CHUNKQ_FORK_SERVER_SOCKET": ""}
    first = run_cli("run", str(write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl")), *common, **env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "latelate/__init__.py" in first.stderr and "stay out of the vector cache" in first.stderr
    (site / "latelate" / "__init__.py").write_text("SHIFT = 0.5\n")
    corpus = write_corpus(tmp_path / "b.jsonl", [f"b-{i}" for i in ids], texts, "jsonl")
    again = run_cli("run", str(corpus), *common, **env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "40 encoded, 0 from the vector cache" in again.stdout + again.stderr, again.stderr[-2000:]
    got, _ = result_of(_latest(store))
    assert max_abs_diff(got, _fresh_encode(model, site, texts)) <= 1e-5


def test_a_load_is_listed_by_what_it_reads_outside_the_shared_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recording itself: a package's module and data file are listed by their names below their
    import root, with their bytes; the model's own files, the standard library, chunkq's requirements
    and /proc are not; a file edited in place is other bytes; a program run is unidentified."""
    site = tmp_path / "site"
    (site / "recpkg").mkdir(parents=True)
    (site / "recpkg" / "__init__.py").write_text("VALUE = 1\n")
    (site / "recpkg" / "data.txt").write_text("one")
    covered = tmp_path / "model.json"
    covered.write_text("{}")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()

    def load() -> str:
        importlib.import_module("recpkg")
        importlib.import_module("numpy.polynomial.hermite")  # a requirement's (numpy), whatever is new
        importlib.import_module("wave")  # the standard library
        Path("/proc/self/status").read_text()
        covered.read_text()
        return (site / "recpkg" / "data.txt").read_text()

    value, listing = model_code.record(load, {str(covered.resolve())})
    assert value == "one" and listing.unidentified == ()
    assert [name for name, _, _ in listing.files] == ["recpkg/__init__.py", "recpkg/data.txt"]
    (site / "recpkg" / "data.txt").write_text("two")
    _, edited = model_code.record(lambda: (site / "recpkg" / "data.txt").read_text(), set())
    assert edited.files[0][0] == "recpkg/data.txt" and edited.files[0][1] != listing.files[1][1]
    assert model_code.merged(listing, edited).digest() != listing.digest()
    _, ran = model_code.record(lambda: subprocess.run(["true"], check=True), set())
    assert ran.unidentified and "runs another program" in ran.unidentified[0]
    differs = edited.differences(json.loads(json.dumps(listing.to_json())))
    assert differs == ["recpkg/data.txt: other bytes", "recpkg/__init__.py: read by the run's load, not here"]


def test_a_watched_load_runs_its_modules_source_never_a_forged_bytecode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A .pyc beside a listed module, forged with its source's mtime and size (the hostile pass's
    1b: Python trusts the header, so the workers ran 0.9 where the listed source says 0.5, and every
    row came from the cache), is not what the load runs: it compiles the source the listing hashed."""
    import importlib.util
    import marshal

    site = tmp_path / "site"
    (site / "forgedpkg").mkdir(parents=True)
    source = site / "forgedpkg" / "__init__.py"
    source.write_text("BIAS = 0.5\n")
    forged = compile("BIAS = 0.9\n", str(source), "exec")
    stat = source.stat()
    header = importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
    header += int(stat.st_mtime).to_bytes(4, "little") + (stat.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    cached = Path(importlib.util.cache_from_source(str(source)))
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_bytes(header + marshal.dumps(forged))
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()

    bias, listing = model_code.record(lambda: importlib.import_module("forgedpkg").BIAS, set())
    assert bias == 0.5
    assert [name for name, _, _ in listing.files] == ["forgedpkg/__init__.py"]
    assert cached.read_bytes() == header + marshal.dumps(forged)  # nothing written in its place
    del sys.modules["forgedpkg"]
    assert importlib.import_module("forgedpkg").BIAS == 0.9  # unwatched, Python runs the forged one
    del sys.modules["forgedpkg"]


def test_a_file_opened_relative_to_a_folder_held_open_cannot_be_identified(tmp_path: Path) -> None:
    """os.open(name, dir_fd=folder): its audit event names no folder, so what was read cannot be
    hashed (the hostile pass's 1g: a data file read so was left out of the listing)."""
    (tmp_path / "load.txt").write_text("0.5")

    def load() -> bytes:
        folder = os.open(tmp_path, os.O_RDONLY)
        try:
            fd = os.open("load.txt", os.O_RDONLY, dir_fd=folder)
            try:
                return os.read(fd, 100)
            finally:
                os.close(fd)
        finally:
            os.close(folder)

    value, listing = model_code.record(load, set())
    assert value == b"0.5"
    assert any("'load.txt' relative to a folder" in why for why in listing.unidentified), listing
    late = model_code.LateReads(model_code.Listing(), set())  # the same read in an encode, after the load
    model_code._LATE.append(late)
    try:
        load()
        assert any("'load.txt' relative to a folder" in why for why in late.drain("/nonexistent")), late
    finally:
        model_code._LATE.remove(late)


def test_a_worker_whose_code_differs_from_the_runs_is_refused_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker loads the model and lists what its load read; the run's listing (the manifest's) says
    the package's data file had other bytes: the chunk is refused, naming the file."""
    from chunkq.jobs.compute import models
    from chunkq.jobs.compute.model_identity import check_loaded as check_model
    from chunkq.jobs.contract.specs import ChunkSpec, EncodeOptions

    site = _site(tmp_path / "site", "wrk")
    model = _shifted_model(tmp_path / "model", "wrk")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    options = EncodeOptions(trust_remote_code=True)
    loaded = models.get_model(str(model), "cpu", "fp32", options)
    try:
        listing = loaded.code
        assert {n for n, _, _ in listing.files} == {
            "wrkconst/__init__.py",
            "wrkpool/__init__.py",
            "wrkpool/scale.json",
        }
        chunk = ChunkSpec("r1", 0, 0, 1, str(model), str(tmp_path), options)
        value = loaded.identity_value
        assert check_model(chunk, value, loaded, listing.to_json()) == value
        run = [
            dict(e, sha256="0" * 64) if e["name"] == "wrkpool/scale.json" else e for e in listing.to_json()
        ]
        theirs = model_code.with_code(
            model_code.files_part(value),
            model_code.from_json({"files": run, "unidentified": [], "paths": {}}),
        )
        with pytest.raises(
            ConfigError, match=r"runs other code on this host .*wrkpool/scale.json: other bytes"
        ):
            check_model(chunk, theirs, loaded, run)
        accepted = model_code.with_code(model_code.files_part(value), None)
        assert check_model(chunk, accepted, loaded, None) == accepted  # the run accepted the risk by name
    finally:
        models.forget(str(model), "cpu", "fp32", options)


@pytest.mark.slow
@pytest.mark.timeout(LOADS_TIMEOUT)
def test_code_that_connects_while_it_loads_is_refused_unless_accepted_by_name(tmp_path: Path) -> None:
    """A module class that opens a connection while it loads: chunkq cannot say what it brought, so
    the run is refused before it starts, in one line; --accept-unidentified-code runs it without the
    vector cache, and --cache with it is refused."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> None:  # every load connects: the probe's, then each worker's
        with contextlib.suppress(OSError):
            while True:
                listener.accept()[0].close()

    threading.Thread(target=answer, daemon=True).start()
    try:
        extra = f"import socket\nsocket.create_connection(('127.0.0.1', {port})).close()\n"
        site = _site(tmp_path / "site", "net", extra)
        model = _shifted_model(tmp_path / "model", "net")
        ids, texts = make_texts(12, seed=7)
        corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
        store = tmp_path / "store"
        common = ["--store", str(store), "--model", str(model), "--trust-remote-code", "--chunk-size", "6"]
        env = {"PYTHONPATH": str(site), "CHUNKQ_FORK_SERVER_SOCKET": ""}
        refused = run_cli("run", str(corpus), *common, forks=False, **env)
        assert refused.returncode == EXIT_CONFIG, refused.stderr[-2000:]
        line = refused.stderr.strip().splitlines()[-1]
        assert "cannot identify the code it runs: it connects to ('127.0.0.1', " in line, line
        assert "--accept-unidentified-code" in line and not (store / "runs").exists()
        both = run_cli(
            "run", str(corpus), *common, "--accept-unidentified-code", "--cache", forks=False, **env
        )
        assert both.returncode == EXIT_CONFIG and "leave --cache out" in both.stderr
        accepted = run_cli("run", str(corpus), *common, "--accept-unidentified-code", **env)
        assert accepted.returncode == 0, accepted.stderr[-3000:]
        layout = _latest(store)
        manifest = json.loads(layout.manifest.read_text())
        assert manifest["model_identity"].endswith("+code:unidentified")
        assert "vector_cache" not in manifest["identity"] and not (store / "cache").exists()
        got, got_ids = result_of(layout)
        assert got_ids == ids and max_abs_diff(got, _fresh_encode(model, site, texts)) <= 1e-5
    finally:
        listener.close()


@pytest.mark.slow
def test_transformers_copy_of_a_models_own_code_is_in_its_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose config maps AutoModel to code in its folder: transformers runs it from its copy
    in HF_MODULES_CACHE, which the listing names; a hand edit of that copy (issue 51's case left
    open) is either undone by the next load or another identity, never the same one."""
    from chunkq.jobs.compute.model_identity import model_identity

    model = bundled_copy(tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    auto_map = {"AutoModel": "modeling_x.XModel", "AutoConfig": "configuration_x.XConfig"}
    config.update(auto_map=auto_map, model_type="xbert", architectures=["XModel"])
    (model / "config.json").write_text(json.dumps(config))
    (model / "configuration_x.py").write_text(
        "from transformers import BertConfig\n\nclass XConfig(BertConfig):\n    model_type = 'xbert'\n"
    )
    (model / "modeling_x.py").write_text(
        "from transformers import BertModel\nfrom .configuration_x import XConfig\n\n"
        "class XModel(BertModel):\n    config_class = XConfig\n"
    )
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    identity = model_identity(str(model))
    assert identity is not None
    first = code_probe.probe(str(model), {"trust_remote_code": True})
    (copy,) = [n for n, _, _ in first.files if n.endswith("modeling_x.py")]
    assert copy.startswith("transformers_modules/model/") and not first.unidentified
    copied = Path(first.paths[copy])
    copied.write_text(copied.read_text() + "\nXModel.forward_edited = True\n")
    again = code_probe.probe(str(model), {"trust_remote_code": True})
    edited = copied.read_text().endswith("forward_edited = True\n")
    assert (again.digest() != first.digest()) if edited else (again.digest() == first.digest())


_SEEN_ELSEWHERE = (
    """
import json, os, threading
from sentence_transformers.base.modules.module import Module

class Shift(Module):
    config_keys: list = []

    def __init__(self):
        super().__init__()
        box = []
        reader = threading.Thread(target=lambda: box.append(float(open({data!r}).read())))
        reader.start()
        reader.join()
        flagged = 1.0 if os.path.exists({flag!r}) else 0.0
        self.shift = box[0] + float(os.environ.get("SHIFT_BY", "0")) + flagged

    def forward(self, features):
        features["sentence_embedding"] = features["sentence_embedding"] + self.shift
        return features
"""
    + _SAVE_AND_LOAD
)


@pytest.mark.slow
@pytest.mark.timeout(LOADS_TIMEOUT)
def test_what_the_listing_cannot_see_is_caught_by_the_canary_and_never_served(tmp_path: Path) -> None:
    """The hostile pass's round two: a file read in a thread of its own (now listed: every thread's
    opens are recorded), an environment variable and a file's mere existence (no file is read: the
    canary's vectors moved, so the cache refuses to serve, and --no-cache encodes every row)."""
    data, flag = tmp_path / "shift.txt", tmp_path / "flag"
    data.write_text("0.0")
    site = _site(tmp_path / "site", "seen")
    (site / "seenpool" / "__init__.py").write_text(_SEEN_ELSEWHERE.format(data=str(data), flag=str(flag)))
    model = _shifted_model(tmp_path / "model", "seen")
    ids, texts = make_texts(12, seed=9)
    store = tmp_path / "store"
    common = ["--store", str(store), "--model", str(model), "--trust-remote-code", "--chunk-size", "6"]
    env = {"PYTHONPATH": str(site), "CHUNKQ_FORK_SERVER_SOCKET": ""}

    def run(name: str, *extra: str, **more: str) -> object:
        corpus = write_corpus(tmp_path / f"{name}.jsonl", [f"{name}{i}" for i in ids], texts, "jsonl")
        return run_cli("run", str(corpus), *common, *extra, **env, **more)

    assert run("a").returncode == 0  # type: ignore[attr-defined]
    data.write_text("0.5")  # read in a thread: listed, another identity, encoded again
    again = run("b")
    assert again.returncode == 0 and "12 encoded, 0 from the vector cache" in again.stdout  # type: ignore[attr-defined]
    assert max_abs_diff(result_of(_latest(store))[0], _fresh_encode(model, site, texts)) <= 1e-5
    for change in ("env", "flag"):
        more = {"SHIFT_BY": "2.0"} if change == "env" else {}
        if change == "flag":
            flag.write_text("")
        refused = run(f"c{change}", forks=False, **more)
        line = refused.stderr.strip().splitlines()[-1]  # type: ignore[attr-defined]
        assert (
            refused.returncode == EXIT_CONFIG
            and "behaves differently than when the store's vector cache" in line
        )  # type: ignore[attr-defined]
        assert "give --no-cache" in line
        fresh = run(f"d{change}", "--no-cache", **more)
        assert fresh.returncode == 0, fresh.stderr[-2000:]  # type: ignore[attr-defined]
        want = _fresh_encode(model, site, texts, **more)
        assert max_abs_diff(result_of(_latest(store))[0], want) <= 1e-5
        flag.unlink(missing_ok=True)


def test_native_code_and_datagrams_cannot_be_identified(tmp_path: Path) -> None:
    """The process's own native symbols (``ctypes.CDLL(None)``: libc's ``system``) and a datagram
    sent without a connection are reported as unidentified; a library opened by path is read."""
    import ctypes
    import ctypes.util

    _, native = model_code.record(lambda: ctypes.CDLL(None), set())
    assert native.unidentified == ("it calls the process's own native code (ctypes.CDLL(None))",)
    _, sent = model_code.record(
        lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", 9)), set()
    )
    assert sent.unidentified and sent.unidentified[0].startswith("it sends to ('127.0.0.1', 9)")
    lib = tmp_path / "libmine.so"  # a library of the model's own, outside the system's folders
    found = ctypes.util.find_library("m")
    assert found is not None
    system = [Path(folder) / found for folder in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu")]
    shutil.copyfile(next(p for p in system if p.exists()), lib)
    _, opened = model_code.record(lambda: ctypes.CDLL(str(lib)), set())
    assert str(lib) in [name for name, _, _ in opened.files] and opened.unidentified == ()
