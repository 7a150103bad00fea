"""The tenants file's YAML kept in a Redis key instead of a file (SHARDLINE_TENANTS_REDIS_KEY).

Every gateway then reads the same tenants from the Redis they already share, and one command
changes them all without a restart: `redis-cli -x SET shardline:tenants < tenants.yaml`. The
text is the tenants file's (gateway/tenancy/tenants.py), keys stored as sha256 digests. A thread polls
the key, so a request never waits on Redis; while Redis cannot be read, or the new text does not
parse, the tenants read before stay in force and the problem is logged once.
"""

from __future__ import annotations

import logging
import threading

import redis

from gateway.tenancy.tenants import RELOAD_CHECK_S, TenantDirectory, TenantsFileError, TenantTable, parse_tenants

log = logging.getLogger(__name__)

_TIMEOUT_S = 2.0


class RedisTenantDirectory(TenantDirectory):
    """The tenants in a Redis key, kept current by a polling thread; `close()` stops it."""

    def __init__(self, redis_url: str, key: str, check_interval_s: float = RELOAD_CHECK_S) -> None:
        self._key = key
        self._name = f"tenants key {key!r}"
        self._check_interval_s = check_interval_s
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=_TIMEOUT_S, socket_connect_timeout=_TIMEOUT_S)
        self._text = self._get()  # a key missing or broken at start fails the start, as a file does
        self._table = parse_tenants(self._text.decode("utf-8", "replace"), self._name)
        self._problem: str | None = None  # what was last logged, so that it is logged once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="tenants-poll", daemon=True)
        self._thread.start()

    def table(self) -> TenantTable:
        return self._table

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * _TIMEOUT_S)
        self._redis.close()

    def _get(self) -> bytes:
        try:
            text = self._redis.get(self._key)
        except redis.RedisError as exc:
            raise TenantsFileError(f"{self._name}: Redis cannot be read: {exc}") from exc
        if text is None:
            raise TenantsFileError(f"{self._name}: not set in Redis (SET it to a tenants file's YAML)")
        return text

    def _poll(self) -> None:
        while not self._stop.wait(self._check_interval_s):
            try:
                text = self._get()
                if text == self._text:
                    self._settle()
                    continue
                table = parse_tenants(text.decode("utf-8", "replace"), self._name)
            except TenantsFileError as exc:
                if str(exc) != self._problem:
                    self._problem = str(exc)
                    log.error("%s; keeping the tenants read before", exc)
                continue
            self._text, self._table = text, table
            self._problem = None
            log.info("%s reloaded: %d tenants, %d keys", self._name, len(table.tenants), len(table.by_digest))

    def _settle(self) -> None:
        if self._problem is not None:
            log.info("%s readable again; its tenants are unchanged", self._name)
            self._problem = None
