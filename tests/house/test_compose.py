"""compose.yaml is valid and says what the README promises (no container engine runs here, so
``docker-compose config`` from Debian's package validates it; `make test` installs it)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = shutil.which("docker-compose")
ENV = {
    "REDIS_PASSWORD": "s3cret-for-test",
    "CHUNKQ_RUN_ID": "demo",
    "CHUNKQ_CORPUS": "sample.jsonl",
    "CHUNKQ_DASHBOARD_PASSWORD": "dash-s3cret",
}

pytestmark = pytest.mark.skipif(
    TOOL is None and not os.environ.get("CI"), reason="docker-compose not installed (make test installs it)"
)


def _config(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    assert TOOL is not None, "docker-compose is required in CI"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CHUNKQ_", "REDIS_"))}
    return subprocess.run(
        [TOOL, "-f", str(ROOT / "compose.yaml"), "config", *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_compose_file_is_valid_and_complete() -> None:
    result = _config(ENV)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert set(_config(ENV, "--services").stdout.split()) == {"redis", "supervisor", "pool", "dashboard"}
    assert "--appendonly" in text and "--requirepass" in text and "s3cret-for-test" in text
    assert "driver: nvidia" in text and "gpu" in text  # GPU reservation on the pool
    assert "redis://:s3cret-for-test@redis:6379/0" in text
    # Only the dashboard is published, on the host's loopback only, and it requires a password.
    assert text.count("ports:") == 1 and "- 127.0.0.1:9181:9181/tcp" in text
    assert "CHUNKQ_DASHBOARD_PASSWORD: dash-s3cret" in text
    assert "stop_grace_period" in text


@pytest.mark.parametrize("missing", sorted(ENV))
def test_required_settings_are_refused_when_missing(missing: str) -> None:
    env = {k: v for k, v in ENV.items() if k != missing}
    result = _config(env, "-q")
    assert result.returncode != 0 and f"set {missing}" in result.stderr


def test_every_compose_variable_is_documented_in_the_readme() -> None:
    import re

    names = set(re.findall(r"\$\{([A-Z_]+)", (ROOT / "compose.yaml").read_text()))
    readme = (ROOT / "docs" / "settings.md").read_text() + (ROOT / "docs" / "operations.md").read_text()
    assert names and all(name in readme for name in names), names - {n for n in names if n in readme}


def test_the_pool_settings_compose_sets_are_the_schemas_and_the_readme_names_them_all() -> None:
    """compose.yaml reaches the pool through CHUNKQ_* variables: each must be one the CLI reads."""
    import re

    from chunkq.jobs.contract.settings import schema

    schema_envs = {meta.env_name(name) for name, meta, _ in schema() if meta.cli and meta.env_name(name)}
    shared = {"CHUNKQ_REDIS_URL", "CHUNKQ_STORE", "CHUNKQ_QUEUE", "CHUNKQ_MAX_ATTEMPTS"}
    pool = (ROOT / "compose.yaml").read_text().split("\n  pool:\n", 1)[1].split("\n  dashboard:\n", 1)[0]
    set_there = set(re.findall(r"^\s+(CHUNKQ_[A-Z_]+):", pool, flags=re.MULTILINE))
    assert set_there and set_there <= schema_envs | shared, set_there - schema_envs - shared
    readme = (ROOT / "docs" / "settings.md").read_text()
    assert {name for name in schema_envs if f"`{name}`" not in readme} == set()
