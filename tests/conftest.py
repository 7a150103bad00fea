"""Fixtures shared by every test package."""

from collections.abc import Iterator

import pytest
import redis

from shardline.stack.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real redis-server, started once per test session."""
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """URL of the session's redis-server, with database 0 emptied for this test."""
    client = redis.Redis.from_url(redis_server)
    try:
        client.flushdb()
    finally:
        client.close()
    yield redis_server
