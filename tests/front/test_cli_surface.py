"""What a user sees before anything runs: every option documented with its variable, the README's
one list of variables, model names resolved offline, and one installed import name."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import click
import pytest
import redis

from chunkq.cli import cli
from chunkq.jobs.compute import model_refs
from chunkq.jobs.contract.errors import ConfigError
from tests.helpers import cli_env, run_cli

ROOT = Path(__file__).resolve().parents[2]
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]


def _commands() -> list[tuple[str, click.Command]]:
    assert isinstance(cli, click.Group)
    return sorted(cli.commands.items())


def test_every_option_has_help_shows_its_variable_and_every_command_takes_redis_and_log_level() -> None:
    missing_help, hidden_env = [], []
    for name, command in _commands():
        options = {p.name: p for p in command.params if isinstance(p, click.Option)}
        assert {"redis_url", "log_level"} <= set(options), name
        for option in options.values():
            if option.hidden:
                continue
            if not option.help:
                missing_help.append(f"{name} {option.opts[0]}")
            if option.envvar and not option.show_envvar:
                hidden_env.append(f"{name} {option.opts[0]}")
        assert command.help, name
    assert missing_help == [] and hidden_env == []
    assert not any(p.required for _, c in _commands() for p in c.params if p.name == "redis_url")


def _variables_in_code() -> set[str]:
    found: set[str] = set()
    for folder in ("jobs", "queue_worker", "supervisor"):
        for path in (ROOT / folder).rglob("*.py"):
            found |= set(re.findall(r"\"(CHUNKQ_[A-Z_]+)\"", path.read_text()))
    for _, command in _commands():
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            found |= {envvar} if isinstance(envvar, str) else set(envvar or ())
    from chunkq.jobs.contract.settings import schema

    found |= {meta.env_name(name) for name, meta, _ in schema() if meta.env_name(name)}  # type: ignore[misc]
    return found


def test_the_settings_page_lists_every_environment_variable_once() -> None:
    section = (ROOT / "docs" / "settings.md").read_text()
    listed = re.findall(r"`(CHUNKQ_[A-Z_]+)`", section)
    duplicates = sorted({v for v in listed if listed.count(v) > 1})
    assert duplicates == []
    assert sorted(_variables_in_code() - set(listed)) == []
    assert sorted(set(listed) - _variables_in_code()) == []


def test_log_level_works_after_the_subcommand_and_help_shows_the_variables(tmp_path: Path) -> None:
    quiet = run_cli("runs", "--store", str(tmp_path), "--log-level", "WARNING")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    wrong = run_cli("runs", "--store", str(tmp_path), "--log-level", "LOUD")
    assert wrong.returncode == 2 and "Invalid value for '--log-level'" in wrong.stderr
    # (that the level reaches what a command logs: test_user_path's submit with --log-level WARNING)
    help_text = " ".join(run_cli("status", "--help").stdout.split())
    assert "env var: CHUNKQ_REDIS_URL" in help_text and "env var: CHUNKQ_STORE" in help_text


@pytest.mark.parametrize(
    "name",
    [
        "all-MiniLM-L6-v2",
        "sentence-transformers/all-MiniLM-L6-v2",
        "all-minilm-l6-v2",
        model_refs.BUNDLED_MODEL,
    ],
)
def test_the_bundled_models_names_resolve_to_the_installed_copy(name: str) -> None:
    assert model_refs.check_model(name) == model_refs.BUNDLED_MODEL


def _cache_a_model(cache: Path, repo_id: str) -> None:
    """A model as huggingface_hub lays out its cache (refs/main names the snapshot)."""
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("abc123")
    snapshot = folder / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")


def test_a_model_in_the_hub_cache_is_used_and_one_missing_is_refused_with_advice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"
    _cache_a_model(cache, "sentence-transformers/all-mpnet-base-v2")
    _cache_a_model(cache, "BAAI/bge-small-en-v1.5")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert model_refs.check_model("BAAI/bge-small-en-v1.5") == "BAAI/bge-small-en-v1.5"
    assert model_refs.check_model("all-mpnet-base-v2") == "sentence-transformers/all-mpnet-base-v2"
    assert model_refs.check_model(str(tmp_path)) == str(tmp_path)  # a local folder
    with pytest.raises(ConfigError, match="neither a local folder nor in the Hugging Face cache") as err:
        model_refs.check_model("BAAI/bge-large-en-v1.5")
    assert "hf download BAAI/bge-large-en-v1.5" in str(err.value)
    with pytest.raises(ConfigError, match="no such folder"):
        model_refs.check_model(str(tmp_path / "nosuch" / "model"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # downloads allowed: the workers fetch it
    assert model_refs.check_model("BAAI/bge-large-en-v1.5") == "BAAI/bge-large-en-v1.5"


def test_the_wheel_installs_one_top_level_name(tmp_path: Path) -> None:
    """chunkq's folders install as chunkq.jobs, chunkq.queue_worker and chunkq.supervisor, never as
    top-level `supervisor` (PyPI's supervisord) or `jobs`."""
    source = tmp_path / "src"  # a copy: building in the tree would leave build/ behind
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):  # README.md: the project's readme, in pyproject.toml
        shutil.copy(ROOT / name, source / name)
    for name in ("chunkq", "jobs", "queue_worker", "supervisor"):
        shutil.copytree(
            ROOT / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [*PIP_WHEEL, "-w", str(wheels), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = wheels.glob("chunkq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"chunkq"}
    # every module of the tree, the rooms' sub-packages included (each must be in pyproject's list)
    root = Path(__file__).resolve().parents[2]
    tree = [
        f"chunkq/{p.relative_to(root).as_posix()}"
        for d in ("jobs", "queue_worker", "supervisor")
        for p in (root / d).rglob("*.py")
    ]
    tree += [
        p.relative_to(root).as_posix()
        for p in (root / "chunkq").rglob("*.py")
        if p.parts[len(root.parts) + 1] in ("cli", "tools", "sinks") or p.parent == root / "chunkq"
    ]
    assert len(tree) > 100 and "chunkq/supervisor/watch/supervise.py" in tree
    assert sorted(set(tree) - set(names)) == []
    top_level = next(n for n in names if n.endswith("top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["chunkq"]


@pytest.mark.slow
def test_a_reader_that_stops_reading_is_not_an_internal_error(encoded_run: Any) -> None:
    """Issue 21.14: `chunkq status RUN | head -1` was exit 70 "internal error: BrokenPipeError"."""
    from tests.helpers import CLI, cli_env

    layout, _, _ = encoded_run
    proc = subprocess.Popen(
        [*CLI, "status", layout.run_id, "--store", str(layout.store)],
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # what `head -1` does once it has its line
    assert proc.wait(timeout=120) == 141
    said = proc.stderr.read()
    assert b"error" not in said and b"Traceback" not in said, said


@pytest.mark.parametrize("command", ["status", "report", "clean", "assemble", "export"])
def test_a_run_that_is_not_in_the_store_is_not_found(command: str, tmp_path: Path) -> None:
    extra = ["--out", str(tmp_path / "x")] if command in ("export", "report") else []
    result = run_cli(command, "nosuch", "--store", str(tmp_path / "store"), *extra)
    assert result.returncode == 13, result.stderr
    assert "run nosuch not found in store" in result.stderr and "`chunkq runs` lists" in result.stderr


def test_supervise_of_a_run_that_is_not_in_the_store_writes_nothing(tmp_path: Path, redis_url: str) -> None:
    """Its log file lives in the run's folder: a missing run must not get a folder for it."""
    store = tmp_path / "store"
    result = run_cli("supervise", "nosuch", "--store", str(store), "--redis-url", redis_url)
    assert result.returncode == 13 and "run nosuch not found in store" in result.stderr, result.stderr
    assert not (store / "runs" / "nosuch").exists()


def test_runs_tells_runs_of_one_corpus_apart_by_file_format_and_options(
    tmp_path: Path, connection: Any
) -> None:
    """Issue 24.8: the same texts as JSONL, CSV and Parquet, one with other options."""
    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
    from chunkq.jobs.contract.specs import EncodeOptions
    from chunkq.supervisor.corpus.records import CorpusOptions
    from chunkq.supervisor.submit.identity import SubmitRequest
    from chunkq.supervisor.submit.submission import submit
    from tests.helpers import make_texts, write_corpus

    ids, texts = make_texts(6, seed=1)
    store = tmp_path / "store"
    for fmt, encode in (
        ("jsonl", EncodeOptions()),
        ("csv", EncodeOptions()),
        ("parquet", EncodeOptions(truncate_dim=64)),
    ):
        corpus = write_corpus(tmp_path / f"notes.{fmt}", ids, texts, fmt)
        submit(
            SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions(fmt), chunk_size=3, encode=encode),
            connection,
        )
    table = run_cli("runs", "--store", str(store)).stdout.splitlines()
    assert table[0].split()[:6] == ["RUN", "STATE", "ROWS", "CORPUS", "MODEL", "OPTIONS"]
    rows = {line.split()[3] + " " + line.split()[4]: line for line in table[1:]}
    assert set(rows) == {"notes.jsonl (jsonl)", "notes.csv (csv)", "notes.parquet (parquet)"}
    assert "chunk_size=3 truncate_dim=64" in rows["notes.parquet (parquet)"]
    assert "truncate_dim" not in rows["notes.csv (csv)"] and "chunk_size=3" in rows["notes.csv (csv)"]


def test_the_pool_that_chunkq_run_starts_is_queue_worker_itself_and_says_what_it_needs() -> None:
    """chunkq run starts `python -m chunkq.queue_worker` (not the CLI again); by hand, without its
    settings, it names the variable and the command people use, exit 2."""
    from chunkq.jobs.contract.settings import SETTINGS_JSON_ENV

    env = {k: v for k, v in cli_env(forks=False).items() if k != SETTINGS_JSON_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "chunkq.queue_worker"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and SETTINGS_JSON_ENV in done.stderr and "chunkq pool" in done.stderr


@pytest.mark.slow
def test_a_wrong_or_missing_redis_password_names_redis_and_its_url_masked(
    redis_url: str, tmp_path: Path
) -> None:
    """Issue 37.17: a wrong password printed only Redis's `invalid username-password pair or user is
    disabled.`, naming neither Redis nor the server."""
    from urllib.parse import urlsplit

    real = urlsplit(redis_url)
    wrong = redis_url.replace(f":{real.password}@", ":not-the-password@")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": 1, "text": "a text"}\n')
    done = run_cli("submit", str(corpus), "--store", str(tmp_path / "s"), "--redis-url", wrong)
    assert done.returncode == 7, done.stderr
    assert f"Redis at redis://:***@127.0.0.1:{real.port}/0 refused the password" in done.stderr
    assert "not-the-password" not in done.stderr and "Traceback" not in done.stderr
    # None at all: Redis's own words are about HELLO, a command the user never gave.
    none = run_cli(
        "submit",
        str(corpus),
        "--store",
        str(tmp_path / "s"),
        "--redis-url",
        f"redis://{real.hostname}:{real.port}/0",
    )
    assert none.returncode == 7, none.stderr
    assert f"Redis at redis://127.0.0.1:{real.port}/0 wants a password, which the URL lacks" in none.stderr


@pytest.mark.slow
def test_doctor_calls_a_redis_without_durable_persistence_a_problem(tmp_path: Path) -> None:
    """Issue 37.17: `doctor` said "all good" with append-only off, though README asks for it."""
    from chunkq.supervisor.server.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        good = run_cli("doctor", "--store", str(tmp_path / "s"), "--redis-url", server.url)
        assert good.returncode == 0 and "all good" in good.stdout, good.stdout
        redis.Redis.from_url(server.url).config_set("appendfsync", "always")
        strict = run_cli("doctor", "--store", str(tmp_path / "s"), "--redis-url", server.url)
        assert strict.returncode == 0 and "all good" in strict.stdout, strict.stdout
        redis.Redis.from_url(server.url).config_set("appendfsync", "no")
        loose = run_cli("doctor", "--store", str(tmp_path / "s"), "--redis-url", server.url)
        assert loose.returncode == 1 and "appendfsync no: a server killed or its host" in loose.stdout
        assert "`appendfsync everysec`" in loose.stdout
    finally:
        server.stop()


def test_the_readme_is_a_first_screen_and_every_page_it_links_exists() -> None:
    """Issue 37.8: README was 448 lines, the quick start under lock, rename and exit-code detail."""
    readme = (ROOT / "README.md").read_text()
    assert readme.startswith("# chunkq\n\n```bash\nmake demo") and len(readme.splitlines()) <= 100
    links = re.findall(r"\]\(([^)#]+\.md)\)", readme)
    assert {"docs/settings.md", "docs/failures.md", "docs/exit-codes.md", "SECURITY.md"} <= set(links)
    assert all((ROOT / link).is_file() for link in links), [
        link for link in links if not (ROOT / link).is_file()
    ]
    for page in (ROOT / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#:]+\.md)\)", page.read_text()):
            assert (page.parent / link).resolve().is_file(), (page.name, link)


def test_help_is_in_sections_and_help_all_gives_every_options_whole_text() -> None:
    """Issue 45.12: `run --help` was 229 lines of full paragraphs in one flat list."""
    from click.testing import CliRunner

    from chunkq.cli import cli
    from chunkq.cli.help_sections import first_sentence

    runner = CliRunner()
    brief = runner.invoke(cli, ["run", "--help"], terminal_width=80)
    whole = runner.invoke(cli, ["run", "--help-all"], terminal_width=80)
    assert brief.exit_code == 0 and whole.exit_code == 0, brief.output + whole.output
    assert len(brief.output.splitlines()) <= 150 < len(whole.output.splitlines())
    for title in ("The corpus:", "The model:", "Encoding:", "Workers and GPUs:", "Where:"):
        assert title in brief.output and title in whole.output
    flat_brief, flat_whole = " ".join(brief.output.split()), " ".join(whole.output.split())
    flags = [p.opts[0] for p in cli.commands["run"].params if isinstance(p, click.Option) and not p.hidden]
    assert len(flags) > 40
    assert [f for f in flags if f not in flat_brief] == [] and [f for f in flags if f not in flat_whole] == []
    # --help: each option's first sentence with its variable and default; --help-all: the rest too
    assert "env var: CHUNKQ_STORE; default: chunkq-store" in flat_brief
    assert "Nothing is downloaded unless HF_HUB_OFFLINE=0" in flat_whole
    assert "Nothing is downloaded" not in flat_brief
    assert "--help-all says what each does" in flat_brief
    assert first_sentence("Text put before every text, e.g. 'query: '. More.") == (
        "Text put before every text, e.g. 'query: '."
    )
    assert (
        first_sentence("A model (bundled:all-MiniLM-L6-v2. also). Then.")
        == "A model (bundled:all-MiniLM-L6-v2. also)."
    )
