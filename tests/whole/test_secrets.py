"""Issue 51.6: a password in a URL is shown nowhere. Every command that takes a URL is given one with
a password (as written and in the forms that escaped before: an unencoded "/", no "//", the query)
on its error paths, and the password must not appear in its stdout, its stderr, the store, or a
crash file."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest

from chunkq.jobs.contract import masking
from chunkq.jobs.contract.redaction import redact, redacted, remember, secrets_of
from chunkq.jobs.contract.run import Run
from chunkq.queue_worker.exit_codes import EXIT_INTERNAL
from chunkq.supervisor.result.assemble import assemble
from tests.helpers import make_texts, run_cli, write_corpus, write_encoded_run, write_ragged_run

SECRET = "S3cret/pa@Word9"  # noqa: S105 - an unencoded "/" and "@": the forms a hand-typed password takes
PIECES = ("S3cret", "Word9")  # what a client quotes of it when it splits the URL at the "/"
PLAIN = "Plain-Secret-42"  # a password that makes a URL a client can read


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _crash_files() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("chunkq-crash-*.txt"))


def _everything_written(store: Path, done: Any, before: set[Path]) -> str:
    found = [done.stdout, done.stderr]
    for path in [*store.rglob("*"), *(_crash_files() - before)]:
        if path.is_file():
            found.append(path.read_bytes().decode("utf-8", "replace"))
    return "\n".join(found)


def test_a_password_is_found_and_masked_in_every_form_a_url_is_written() -> None:
    forms = {  # what libpq and redis-py cannot read is shown as its scheme alone (issue 63.3)
        f"postgresql://u:{SECRET}@127.0.0.1:5999/db": "postgresql://...",
        f"postgresql:u:{SECRET}@host/db": "postgresql:...",
        f"redis://:{SECRET}@127.0.0.1:6379/0": "redis://...",
        f"postgresql://u@/db?host=/run&password={SECRET}&table=t": "postgresql://u:***@/db?host=/run&table=t",
        f"postgresql://u:{PLAIN}@127.0.0.1:5999/db?table=t": "postgresql://u:***@127.0.0.1:5999/db?table=t",
        f"redis://:{PLAIN}@127.0.0.1:6379/0": "redis://:***@127.0.0.1:6379/0",
        # the password where the user name goes (no ":"): Redis takes no login without a password
        f"redis://{PLAIN}@127.0.0.1:6379/0": "redis://***@127.0.0.1:6379/0",
    }
    for url, shown in forms.items():
        assert SECRET in secrets_of(url) or PLAIN in secrets_of(url), url
        assert redacted(url) == shown
        said = redact(f"could not reach {url}: refused")  # a free line: masked by shape and memory
        assert said.startswith("could not reach ") and not any(p in said for p in (SECRET, PLAIN, *PIECES))
    remember(f"redis://:{SECRET}@h")
    assert redact(f"the server said: wrong password {SECRET!r}") == "the server said: wrong password '***'"
    assert (
        redact("at 12:30 see http://localhost:8080/x and a@b")
        == "at 12:30 see http://localhost:8080/x and a@b"
    )


# Issue 63.3: what a user pastes when a password holds a character a URL must encode, in every form
# the connecting libraries take (URLs with and without "//", a user name with "@", the password in the
# query, libpq's keyword strings, quoted or not). Each password is two five-character words around
# the character, so a client that splits it and quotes a piece is caught too.
SPECIALS = "/@:#?% &=+'\"\\"
WORDS = ("Xq7Zk", "Wp3Lm")


NO_SCHEME = (":", "", "me:", "redis//:", "redis:/:", "redis:", "//:")


def malformed_forms(port: int) -> list[tuple[str, str]]:
    """(password, address) for every special character and form."""
    forms = []
    for char in SPECIALS:
        pw = f"{WORDS[0]}{char}{WORDS[1]}"
        forms += [
            (pw, f"redis://:{pw}@127.0.0.1:{port}/0"),
            (pw, f"redis://me:{pw}@127.0.0.1:{port}"),
            (pw, f"rediss://me:{pw}@127.0.0.1:{port}/1"),
            (pw, f"redis://127.0.0.1:{port}/0?password={pw}"),
            (pw, f"unix:///nowhere/redis.sock?password={pw}"),
            (pw, f"unix://:{pw}@/nowhere/redis.sock"),
            (pw, f"redis://127.0.0.1:{port}/0?password={pw}&db=0"),
            (pw, f"postgresql://u:{pw}@127.0.0.1:{port}/db?table=t"),
            (pw, f"postgresql://u@corp:{pw}@127.0.0.1:{port}/db?table=t"),
            (pw, f"postgresql:u:{pw}@127.0.0.1:{port}/db?table=t"),
            (pw, f"postgresql://127.0.0.1:{port}/db?user=u&password={pw}&table=t"),
            (pw, f"postgres://u:{pw}@[::1:{port}/db?table=t"),
            (pw, f"host=127.0.0.1 port={port} user=u password={pw} dbname=db"),
            (pw, f"host=127.0.0.1 port={port} user=u password='{pw}' dbname=db"),
            # a Redis URL without its scheme, or with it mistyped (the hostile pass's 3b)
            # ("A:B@host" and "redis:A:B@host" are user A, password B: those with ":"-free ones)
            *(
                (pw, f"{t}{pw}@127.0.0.1:{port}")
                for t in NO_SCHEME
                if t not in ("", "redis:") or ":" not in pw
            ),
        ]
    return forms


def _leaks(text: str, pw: str) -> list[str]:
    return [piece for piece in (pw, *WORDS) if piece in text]


def test_every_malformed_form_is_shown_as_its_library_reads_it_and_never_with_its_password() -> None:
    for pw, form in malformed_forms(5999):
        masking._REMEMBERED.clear()  # each form alone, as a fresh process is given it
        remember(form)  # as every chunkq process does with its arguments
        shown = redacted(form)
        assert _leaks(shown, pw) == [], (form, shown)
        assert _leaks(redact(f"the client said: {form} failed ({pw})"), pw) == [], form


@pytest.mark.slow
def test_no_command_shows_a_malformed_forms_password(tmp_path: Path) -> None:
    """Every form through the commands that take it: status (--redis-url, and CHUNKQ_REDIS_URL) and
    export (--to). Nothing of the password is written, and each ends in one line (no traceback)."""
    store, crashes = tmp_path / "store", _crash_files()
    assemble(Run.of(write_encoded_run(store, "dense", 20, 10, 4)))
    port = _free_port()
    # Through the commands, the characters the hostile pass used; the unit test above takes them all.
    typed = ("redis://", "rediss://", "unix://", "postgres", "host=")  # a scheme-less form: "@" alone
    forms = [
        (pw, f) for pw, f in malformed_forms(port) if set(pw) & set("/@# &" if f.startswith(typed) else "@")
    ]
    for pw, form in forms:
        if form.startswith(("redis", "unix", "//", ":", "me:", WORDS[0])):
            runs = [run_cli("status", "dense", "--store", str(store), "--redis-url", form, timeout=60)]
            runs.append(run_cli("status", "dense", "--store", str(store), CHUNKQ_REDIS_URL=form, timeout=60))
        else:
            runs = [run_cli("export", "dense", "--store", str(store), "--to", form, timeout=60)]
        if form.startswith("unix://:"):  # a terminal that cannot show every character: still masked
            runs.append(
                run_cli(
                    "status", "dense", "--store", str(store), "--redis-url", form, PYTHONIOENCODING="ascii"
                )
            )
        for done in runs:
            written = _everything_written(store, done, crashes)
            assert _leaks(written, pw) == [], (form, done.stderr)
            assert done.returncode not in (0, EXIT_INTERNAL) and "Traceback" not in done.stderr, (
                form,
                done.stderr,
            )


@pytest.mark.slow
def test_no_command_shows_a_password_on_any_path(
    tmp_path: Path,
    postgres: str,
) -> None:
    store, crashes = tmp_path / "store", _crash_files()
    dense = write_encoded_run(store, "dense", 20, 10, 4)
    assemble(Run.of(dense))
    assemble(Run.of(write_ragged_run(store, "sparse", rows=20, chunk_size=10)))
    ids, texts = make_texts(5, seed=6)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    port, socket_folder = _free_port(), postgres.split("host=", 1)[1]
    redis_urls = [f"redis://:{SECRET}@127.0.0.1:{port}/0", f"redis://me:{SECRET}@127.0.0.1:{port}"]
    to_urls = [
        f"postgresql://u:{SECRET}@127.0.0.1:{port}/db",  # no ?table=
        f"postgresql://u:{SECRET}@127.0.0.1:{port}/db?table=t",  # nothing listens
        f"postgresql:u:{SECRET}@127.0.0.1:{port}/db?table=t",  # no "//"
        f"postgresql://postgres:{PLAIN}@/postgres?host={socket_folder}&table=ok",  # written
        f"postgresql://postgres@/postgres?host={socket_folder}&password={PLAIN}&table=ok2",
        f"postgresql://postgres:{SECRET}@/postgres?host={socket_folder}&table=ok3",
        f"postgresql://u:{SECRET}@127.0.0.1:{port}/db?table=bad-name",
        f"lancedb://u:{SECRET}@nowhere",
        f"lancedb://me:{PLAIN}@/{socket_folder}/t",  # read by LanceDB as an object store named "me"
        f"mysql://u:{SECRET}@127.0.0.1/db",
    ]
    commands: list[list[str]] = []
    for url in redis_urls:
        common = ["--store", str(store), "--redis-url", url]
        commands += [
            ["submit", str(corpus), *common],
            ["pool", *common, "--max-jobs", "1"],
            ["supervise", "dense", *common],
            ["status", "dense", *common],
            ["runs", *common, "--json"],
            ["doctor", *common],
            ["run", str(corpus), *common],
        ]
    for url in to_urls:
        for run_id in ("dense", "sparse"):
            commands += [
                ["export", run_id, "--store", str(store), "--to", url, *json] for json in ([], ["--json"])
            ]
    for args in commands:
        done = run_cli(*args, timeout=120)
        written = _everything_written(store, done, crashes)
        assert not any(s in written for s in (SECRET, PLAIN, *PIECES)), (args, done.stdout, done.stderr)
        assert done.returncode != EXIT_INTERNAL, (args, done.stderr)  # every form is said in one line
    # The variable every command reads, and a URL that reaches the server: its success lines too.
    env_done = run_cli("status", "dense", "--store", str(store), CHUNKQ_REDIS_URL=redis_urls[0], timeout=60)
    assert not any(s in _everything_written(store, env_done, crashes) for s in (SECRET, *PIECES))
    written = run_cli("export", "dense", "--store", str(store), "--to", to_urls[3], "--json")
    assert written.returncode == 0 and "postgres:***@" in written.stdout, written.stderr


def test_a_redis_url_its_client_would_read_as_another_address_is_refused_without_its_password() -> None:
    """redis-py reads port 0 as no port (6379: perhaps another server) and drops a stray "]" of an
    IPv6 host; either is refused before anything connects, in one line without the password."""
    from chunkq.jobs.contract.errors import ConfigError
    from chunkq.supervisor.request import check_redis_url

    for url in ("redis://localhost:0", "redis://me:s3cret-pw@127.0.0.1:00/0", "redis://[::1]]:6379"):
        with pytest.raises(ConfigError) as refused:
            check_redis_url(url)
        assert "s3cret-pw" not in str(refused.value)
        assert ("port 0" in str(refused.value)) == ("]]" not in url), refused.value
    for url in ("redis://localhost:6379", "redis://[::1]:6379/0", "redis://localhost", "unix:///tmp/r.sock"):
        check_redis_url(url)
    done = run_cli("status", "any", "--redis-url", "redis://localhost:0", timeout=60)
    assert done.returncode == 2 and "port 0 is no Redis server's port" in done.stderr, done.stderr
