"""The gateway's settings: from the environment, with its flags on top."""

from __future__ import annotations

import pytest

from gateway.main import parse_settings


def test_gateway_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDLINE_API_KEYS", "a, b,,c")
    monkeypatch.setenv("SHARDLINE_HTTP_PORT", "9000")
    settings = parse_settings([])
    assert (settings.api_keys, settings.http_port, settings.grpc_port) == (["a", "b", "c"], 9000, 50051)
    assert settings.gateway_id.startswith("gateway-") and settings.gateway_id != parse_settings([]).gateway_id
    settings = parse_settings(["--http-port", "0", "--api-keys", "k", "--scheduler-address", "sched:1"])
    assert (settings.http_port, settings.api_keys, settings.scheduler_address) == (0, ["k"], "sched:1")


def test_an_empty_variable_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    # docker compose passes `SHARDLINE_X:` through as an empty string when .env leaves it blank.
    monkeypatch.setenv("SHARDLINE_DEFAULT_MAX_TOKENS", "")
    monkeypatch.setenv("SHARDLINE_MAX_PROMPT_TOKENS", "")
    settings = parse_settings([])
    assert (settings.default_max_tokens, settings.max_prompt_tokens) == (None, None)
