"""How long the same ``chunkq run`` takes to finish a run whose first command died with a chunk in hand,
against a fresh run of the same corpus in another store, measured in the same session.

    python bench/resume.py [--rows 40] [--repeats 3] [--own-redis] [--out resume.json]

Each repeat starts ``chunkq run`` whose chunk 1 takes 60 s on its first attempt (``CHUNKQ_FAULTS``'s
``slow``), stops it once that chunk has started (``kill -9`` of the command, then Ctrl-C twice:
SIGINT, then SIGINT again once it said it drains; or SIGKILL to every process of it at once, as
systemd, ``docker stop`` and Slurm end a run past their grace period), and times the same command
run again until it exits with the result published. ``--own-redis``: every command on a Redis of
its own started here (``--redis-url``, each pair of commands under a run id of its own), as users
with a Redis of their own run it, instead of the embedded one. The rerun's chunk 1 is its only real
work: what it waits for beside it is what this measures (before the sixteenth session a rerun after
kill -9 waited out the dead supervisor's Redis lock: 11.7 s against a fresh run's 3.8 s; before the
seventeenth, a rerun on the user's own Redis after every process was killed waited 61 s for the
chunk's heartbeat).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLOW = json.dumps([{"kind": "slow", "chunks": [1], "attempts": [1], "seconds": 60}])


def corpus_file(path: Path, rows: int) -> Path:
    """A JSONL corpus of ``rows`` distinct short texts (a fixed seed: the same in every session)."""
    words = "queue chunk worker model vector corpus shard retry fresh process context".split()
    pick = random.Random(7)
    with open(path, "w") as fh:
        for i in range(rows):
            fh.write(json.dumps({"id": f"r{i}", "text": " ".join(pick.choices(words, k=12))}) + "\n")
    return path


def run_command(
    corpus: Path, store: Path, redis_url: str | None = None, run_id: str = "", chunk_size: int = 10
) -> list[str]:
    """``chunkq run`` of ``corpus`` in ``store``; ``redis_url``: on that Redis under ``run_id``."""
    own = ["--redis-url", redis_url, "--run-id", run_id] if redis_url else []
    return [
        sys.executable,
        "-m",
        "chunkq.cli",
        "run",
        str(corpus),
        "--store",
        str(store),
        "--chunk-size",
        str(chunk_size),
        *own,
    ]


def _timed(cmd: list[str], env: dict[str, str]) -> float:
    started = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return time.monotonic() - started


def _stopped(cmd: list[str], env: dict[str, str], log: Path, how: str) -> None:
    """The first command, stopped once chunk 1 runs: every process it started gone before returning."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env={**env, "CHUNKQ_FAULTS": SLOW}, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while "FAULT slow" not in log.read_text(errors="replace"):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit(f"chunk 1 never started: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    if how.startswith("kill -9"):
        import psutil

        family = [proc_ := psutil.Process(proc.pid), *proc_.children(recursive=True)]
        for member in family if how == "kill -9 of every process" else family[:1]:
            member.kill()
        psutil.wait_procs(family, timeout=60)
    else:
        proc.send_signal(signal.SIGINT)
        while "press Ctrl+C again" not in log.read_text(errors="replace") and proc.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)


@contextlib.contextmanager
def _redis(tmp: Path, own: bool) -> Iterator[str | None]:
    """The URL of a Redis of its own for every command, or None (each uses its embedded one)."""
    if not own:
        yield None
        return
    from chunkq.supervisor.server.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis(tmp / "own-redis").start()
    try:
        yield server.url
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--own-redis", action="store_true", help="a Redis of its own, not the embedded one")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    samples: dict[str, list[float]] = {
        "fresh run": [],
        "rerun after kill -9": [],
        "rerun after kill -9 of every process": [],
        "rerun after Ctrl-C twice": [],
    }
    loads = []
    with (
        tempfile.TemporaryDirectory(prefix="chunkq-resume-") as tmp,
        _redis(Path(tmp), args.own_redis) as url,
    ):
        corpus = corpus_file(Path(tmp) / "corpus.jsonl", args.rows)
        for repeat in range(args.repeats):
            for number, name in enumerate(samples):
                store = Path(tmp) / f"store-{repeat}-{number}"
                cmd = run_command(corpus, store, url, f"resume-{repeat}-{number}")
                if name != "fresh run":
                    _stopped(cmd, env, Path(tmp) / "first.log", name.removeprefix("rerun after "))
                samples[name].append(_timed(cmd, env))
                shutil.rmtree(store, ignore_errors=True)
            loads.append(os.getloadavg()[0])
    fresh = statistics.median(samples["fresh run"])
    where = "its own Redis (--redis-url)" if args.own_redis else "the embedded Redis"
    print(
        f"{args.rows} rows in chunks of 10 on {where}, {args.repeats} repeats, "
        f"load {min(loads):.2f}-{max(loads):.2f}"
    )
    print("| command | median s | samples | against a fresh run |\n|---|---|---|---|")
    for name, seconds in samples.items():
        median = statistics.median(seconds)
        shown = ", ".join(f"{s:.1f}" for s in seconds)
        print(f"| {name} | {median:.1f} | {shown} | {median / fresh:.2f}x |")
    if args.out:
        args.out.write_text(
            json.dumps(
                {"rows": args.rows, "own_redis": args.own_redis, "samples": samples, "loads": loads}, indent=2
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
