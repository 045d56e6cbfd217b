"""Issue 51.1-51.3: a model's identity covers every file its load reads, whatever the layout; what it
cannot cover is refused before the run in one line; a hub snapshot edited in place is not its commit."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from chunkq.jobs.compute.model_identity import model_identity
from chunkq.jobs.contract.errors import ConfigError
from chunkq.queue_worker.exit_codes import EXIT_CONFIG
from tests.helpers import make_texts, max_abs_diff, result_of, run_cli, write_corpus
from tests.tiny_models import bundled_copy, perturb_weights


def _dot_named_pooling(folder: Path) -> Path:
    """The bundled model with its pooling module in a folder named ``.pooling``: a layout
    sentence-transformers loads, and the one the identity used to leave out."""
    bundled_copy(folder)
    (folder / "1_Pooling").rename(folder / ".pooling")
    modules = json.loads((folder / "modules.json").read_text())
    for module in modules:
        if module["path"] == "1_Pooling":
            module["path"] = ".pooling"
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


def _edit_json(path: Path, **changes: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _cls_pooling(folder: Path, pooling: str = ".pooling") -> None:
    """A change to a module's config that changes every vector: mean pooling becomes CLS."""
    _edit_json(folder / pooling / "config.json", pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)


@pytest.mark.slow
def test_a_module_config_changed_in_a_dot_named_folder_is_encoded_again_not_served(tmp_path: Path) -> None:
    """51.1 end to end: a run, then the pooling module's config changed (every vector moves by up to
    0.7), then the same texts again in the same store: encoded again and equal to the new model's
    encode (before: "40 from the vector cache, 0 encoded", max abs diff 0.70)."""
    from sentence_transformers import SentenceTransformer

    model = _dot_named_pooling(tmp_path / "model")
    ids, texts = make_texts(40, seed=51)
    store = tmp_path / "store"
    common = ["--store", str(store), "--chunk-size", "20", "--model", str(model)]
    first = run_cli("run", str(write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl")), *common)
    assert first.returncode == 0, first.stderr[-3000:]
    before = model_identity(str(model))
    _cls_pooling(model)
    assert model_identity(str(model)) != before
    corpus = write_corpus(tmp_path / "b.jsonl", [f"b{i}" for i in ids], texts, "jsonl")
    again = run_cli("run", str(corpus), *common)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "40 encoded, 0 from the vector cache" in again.stdout + again.stderr
    runs = sorted((store / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    from chunkq.jobs.contract.run_files import RunLayout

    layout = RunLayout(store, runs[-1].name)
    got, got_ids = result_of(layout)
    want = SentenceTransformer(str(model), device="cpu").encode(texts)
    assert got_ids == [f"b{i}" for i in ids] and max_abs_diff(got, want) <= 1e-5
    verified = run_cli("assemble", layout.run_id, "--store", str(store), "--verify")
    assert verified.returncode == 0, verified.stderr


@pytest.mark.slow
def test_a_module_path_outside_the_folder_is_refused_before_the_run_in_one_line(tmp_path: Path) -> None:
    """51.1: an absolute path in modules.json crashed five workers in turn, and the terminal said
    only "the worker pool exited"; now the run is refused before anything starts."""
    model = bundled_copy(tmp_path / "model")
    modules = json.loads((model / "modules.json").read_text())
    modules[1]["path"] = str(model / "1_Pooling")
    (model / "modules.json").write_text(json.dumps(modules))
    ids, texts = make_texts(5, seed=1)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    refused = run_cli("run", str(corpus), "--store", str(tmp_path / "store"), "--model", str(model))
    assert refused.returncode == EXIT_CONFIG, refused.stderr[-3000:]
    said = refused.stderr.strip().splitlines()
    assert len(said) == 1 and "modules.json puts module '1' at" in said[0], said
    assert "worker pool" not in refused.stderr and not (tmp_path / "store" / "runs").exists()


def test_every_file_in_the_folder_is_in_the_identity_dot_named_too_and_git_left_out(tmp_path: Path) -> None:
    model = _dot_named_pooling(tmp_path / "model")
    identity = model_identity(str(model))
    _cls_pooling(model)
    assert model_identity(str(model)) != identity
    (model / ".notes").write_text("a file no load reads today is still a file a load could read")
    assert model_identity(str(model)) not in (identity, None)
    changed = model_identity(str(model))
    (model / ".git").mkdir()
    (model / ".git" / "index").write_bytes(os.urandom(64))  # what `git status` rewrites
    assert model_identity(str(model)) == changed


def test_a_path_a_config_names_outside_the_folder_is_refused_whatever_its_key(tmp_path: Path) -> None:
    model = bundled_copy(tmp_path / "model")
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    config = model / "tokenizer_config.json"
    original = config.read_text()
    for value in (str(outside), "../elsewhere.json", "~/" + os.path.relpath(outside, Path.home())):
        _edit_json(config, some_file_a_future_release_reads=value)
        with pytest.raises(
            ConfigError, match=r"some_file_a_future_release_reads names .* not among the model"
        ):
            model_identity(str(model))
        config.write_text(original)
    # A path that does not exist here cannot be read here (older tokenizer configs carry their
    # author's paths), nor can a token or a name.
    _edit_json(config, tokenizer_file="/home/someone/.cache/tokenizer.json", note="a/b", mark="/")
    assert model_identity(str(model)) is not None
    _edit_json(model / "1_Pooling" / "config.json", nested={"deep": [str(outside)]})
    with pytest.raises(ConfigError, match=r"1_Pooling/config.json nested.deep.\[0\] names"):
        model_identity(str(model))


def test_the_keys_transformers_sets_from_the_load_path_are_not_read(tmp_path: Path) -> None:
    """The two exempt keys name another model here (one whose vectors differ), and the load's
    vectors are this folder's: transformers overwrites them and never opens what they name."""
    from sentence_transformers import SentenceTransformer

    model = bundled_copy(tmp_path / "model")
    other = bundled_copy(tmp_path / "other")
    _cls_pooling(other, "1_Pooling")
    text = ["a sentence to encode"]
    want = SentenceTransformer(str(model), device="cpu").encode(text)
    _edit_json(model / "config.json", _name_or_path=str(other))
    _edit_json(model / "tokenizer_config.json", name_or_path=str(other))
    assert model_identity(str(model)) is not None
    assert max_abs_diff(SentenceTransformer(str(model), device="cpu").encode(text), want) == 0


def test_code_the_folder_does_not_hold_is_refused_or_named_with_its_release(tmp_path: Path) -> None:
    model = bundled_copy(tmp_path / "model")
    _edit_json(model / "config.json", auto_map={"AutoModel": "someone/else--modeling.Model"})
    with pytest.raises(ConfigError, match="takes code from another repository"):
        model_identity(str(model))
    _edit_json(model / "config.json", auto_map={"AutoModel": "modeling.Model"})  # in the folder: hashed
    plain = model_identity(str(model))
    assert plain is not None and "+" not in plain
    modules_file = model / "modules.json"
    modules = json.loads(modules_file.read_text())
    for kind, refusal in (("other/repo--custom.Pooling", "from another repository"), ("", None)):
        modules[1]["type"] = kind or "numpy.Pooling"  # an installed package's class
        modules_file.write_text(json.dumps(modules))
        if refusal:
            with pytest.raises(ConfigError, match=refusal):
                model_identity(str(model))
        else:
            # Its files alone: such a class loads only under --trust-remote-code, whose load is
            # watched for the code it runs (tests/jobs/test_model_code.py).
            named = model_identity(str(model))
            assert named is not None and named.startswith("files:") and "+" not in named
    modules[1] = {**modules[1], "type": "sentence_transformers.models.Pooling", "path": ".git/pooling"}
    modules_file.write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="under version control's records"):
        model_identity(str(model))


def _hub_cache(root: Path, source: Path, commit: str) -> Path:
    """``source`` laid out as the hub cache lays a download out: each file a blob named by the hub's
    hash (git's blob sha1, sha256 for the weights, kept in LFS), linked from the commit's snapshot."""
    repo = root / "models--chunkq-test--mini"
    (repo / "blobs").mkdir(parents=True)
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.suffix == ".safetensors":
            name = hashlib.sha256(data).hexdigest()
        else:
            name = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
        (repo / "blobs" / name).write_bytes(data)
        link = repo / "snapshots" / commit / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / name, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_a_hub_snapshot_edited_in_place_is_identified_by_its_bytes_not_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """51.3: the commit names the snapshot while each file is still its blob; an edit through the link
    (the blob changed under its name) or over it (the link replaced by a file, as `sed -i` does) makes
    it another model, whose vectors no earlier run of the commit is served for."""
    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model

    commit = "0123456789abcdef0123456789abcdef01234567"
    import huggingface_hub.constants

    # Read once at import: a process that imported the hub library before this test keeps its value.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _hub_cache(tmp_path / "hub", Path(resolve_model(BUNDLED_MODEL)), commit)
    whole = model_identity("chunkq-test/mini")
    assert whole is not None and whole.startswith(f"hub:chunkq-test/mini@{commit}:")
    pooling = snapshot / "1_Pooling" / "config.json"
    _edit_json(pooling, pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)  # through the link
    through = model_identity("chunkq-test/mini")
    assert through is not None and through.startswith("files:")
    text = pooling.read_text()
    pooling.unlink()
    pooling.write_text(text + " ")  # over it: a file where the link was
    over = model_identity("chunkq-test/mini")
    assert over is not None and over.startswith("files:") and over != through
    blob = Path(os.path.realpath(snapshot / "model.safetensors"))  # an LFS blob, named by its sha256
    fd = os.open(blob, os.O_RDWR)
    try:  # one bit of the last byte of the weights' data
        last = blob.stat().st_size - 1
        os.pwrite(fd, bytes([os.pread(fd, 1, last)[0] ^ 1]), last)
    finally:
        os.close(fd)
    assert model_identity("chunkq-test/mini") not in (over, None)


def _shards(folder: Path, where: str) -> None:
    """The weights moved to ``where`` (relative to ``folder``, or absolute) and named there by a
    sharded checkpoint's index, as transformers reads it (its ``weight_map``)."""
    from safetensors.torch import load_file

    names = list(load_file(folder / "model.safetensors"))
    target = Path(where) if os.path.isabs(where) else folder / where
    target.parent.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").rename(target)
    index = {"metadata": {}, "weight_map": {name: where for name in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_what_a_config_names_must_be_a_file_the_identity_hashed_however_it_is_written(tmp_path: Path) -> None:
    """The hostile pass of issue 51: each of these changed vectors while the identity stayed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    refused = {
        "under .git": ".git/model.safetensors",
        "a newline in its folder's name": str(tmp_path / "new\nline" / "model.safetensors"),
        "looks like a URL": "x://../../outside/model.safetensors",
        "through a link, then ..": "lnk/../model.safetensors",
    }
    for case, where in refused.items():
        model = bundled_copy(tmp_path / case.replace(" ", "-"))
        (model / "x:").mkdir()
        (outside / "deep").mkdir(exist_ok=True)
        if "lnk" in where:
            (model / "lnk").symlink_to(outside / "deep")  # hashed: outside/deep, not what its .. reaches
            _shards(model, str(outside / "model.safetensors"))  # where lnk/.. lands
            index = json.loads((model / "model.safetensors.index.json").read_text())
            index["weight_map"] = dict.fromkeys(index["weight_map"], where)
            (model / "model.safetensors.index.json").write_text(json.dumps(index))
        elif "URL" in case:
            _shards(model, str(outside / "model.safetensors"))  # where x:/../.. lands
            index = json.loads((model / "model.safetensors.index.json").read_text())
            index["weight_map"] = dict.fromkeys(index["weight_map"], where)
            (model / "model.safetensors.index.json").write_text(json.dumps(index))
        else:
            _shards(model, where)
        with pytest.raises(ConfigError, match="not among the model's files"):
            model_identity(str(model))
    padded = bundled_copy(tmp_path / "padded")
    _shards(padded, str(outside / "padded.safetensors"))
    index = padded / "model.safetensors.index.json"
    index.write_text(index.read_text()[:-1] + " " * (17 << 20) + "}")  # was skipped past 16 MiB
    with pytest.raises(ConfigError, match="not among the model's files"):
        model_identity(str(padded))


def test_a_name_resolved_from_the_working_directory_or_the_hub_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = bundled_copy(tmp_path / "model")
    config = model / "sentence_bert_config.json"
    original = config.read_text()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tokrel_tok").mkdir()
    (tmp_path / "tokrel_tok" / "tokenizer.json").write_text("{}")
    _edit_json(config, tokenizer_name_or_path="tokrel_tok")  # transformers resolves it from the cwd
    with pytest.raises(ConfigError, match="tokenizer_name_or_path names 'tokrel_tok', which is not among"):
        model_identity(str(model))
    config.write_text(original)
    _edit_json(config, tokenizer_name_or_path="acme/tok")
    with pytest.raises(ConfigError, match="names 'acme/tok', another model by its hub name"):
        model_identity(str(model))
    config.write_text(original)
    (tmp_path / "notes").mkdir()
    _edit_json(config, note="notes", mark="~")
    (model / "deep.json").write_text("[" * 3000 + "]" * 3000)  # past json's recursion: a crash before
    assert model_identity(str(model)) is not None  # a value that is not a path key, "~", deep JSON


def test_a_link_to_one_of_two_checkpoints_is_hashed_as_what_it_points_at(tmp_path: Path) -> None:
    """Each real folder was read once: a link to either of two checkpoints gave one identity."""
    model = bundled_copy(tmp_path / "model")
    shutil.copytree(model, tmp_path / "ckpt-b")
    perturb_weights(tmp_path / "ckpt-b")
    (model / "ckpt-b").symlink_to(tmp_path / "ckpt-b")
    (model / "current").symlink_to(model)  # a link back up: skipped, or the walk never ends
    first = model_identity(str(model))
    (model / "ckpt-a").symlink_to(tmp_path / "ckpt-b")
    assert model_identity(str(model)) not in (first, None)


def test_two_files_never_hash_as_one_split_otherwise(tmp_path: Path) -> None:
    """Name and bytes joined by zero bytes: one file's bytes could be cut into a file and a name."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "one").write_bytes(b"x\0two\0y")
    (b / "one").write_bytes(b"x")
    (b / "two").write_bytes(b"y")
    from chunkq.jobs.compute.model_identity import _digest, model_files

    assert _digest(model_files(a)) != _digest(model_files(b))


def test_the_working_directory_is_not_imported_by_a_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from chunkq.jobs.compute import model_reads

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", str(tmp_path), *sys.path])
    model_reads.no_working_directory_imports()
    assert "" not in sys.path and str(tmp_path) not in sys.path


def test_a_hub_snapshot_completed_later_or_relinked_under_one_commit_is_another_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit alone: a download with --include, completed later, or a link moved to another blob
    of the same repository, kept the commit and changed the vectors."""
    import huggingface_hub.constants

    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model

    commit = "fedcba9876543210fedcba9876543210fedcba98"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _hub_cache(tmp_path / "hub", Path(resolve_model(BUNDLED_MODEL)), commit)
    whole = model_identity("chunkq-test/mini")
    pooling = snapshot / "1_Pooling" / "config.json"
    target = os.readlink(pooling)
    pooling.unlink()  # as `hf download --include` leaves it, before the rest comes
    partial = model_identity("chunkq-test/mini")
    pooling.symlink_to(target)
    assert model_identity("chunkq-test/mini") == whole != partial
    other = next(p for p in (tmp_path / "hub").rglob("blobs/*") if len(p.name) == 40 and p.name not in target)
    modules = snapshot / "modules.json"
    modules.unlink()
    modules.symlink_to(os.path.relpath(other, modules.parent))  # another blob, named by its own hash
    assert model_identity("chunkq-test/mini") not in (whole, partial, None)


def test_sentence_transformers_own_cache_is_the_one_identified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With SENTENCE_TRANSFORMERS_HOME set, sentence-transformers loads hub models from it; the
    identity read the hub's default cache instead."""
    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model

    commit = "0011223344556677889900112233445566778899"
    _hub_cache(tmp_path / "st-home", Path(resolve_model(BUNDLED_MODEL)), commit)
    monkeypatch.setenv("SENTENCE_TRANSFORMERS_HOME", str(tmp_path / "st-home"))
    found = model_identity("chunkq-test/mini")
    assert found is not None and found.startswith(f"hub:chunkq-test/mini@{commit}:")
