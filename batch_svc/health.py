"""The batch worker's /health and /metrics, served from a thread beside Celery's own loop.

/health is 200 once the worker consumes from the broker and Redis answers; 503 otherwise, so that
compose and Kubernetes restart or hold back a worker that cannot run chunks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import redis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: no log line each
        pass


class HealthServer:
    def __init__(self, port: int, redis_url: str) -> None:
        self.ready = threading.Event()  # set when the worker starts consuming
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self._server: WSGIServer = make_server("0.0.0.0", port, self._app, handler_class=_Quiet)
        self.port = self._server.server_port
        threading.Thread(target=self._server.serve_forever, name="batch-health", daemon=True).start()

    def healthy(self) -> bool:
        if not self.ready.is_set():
            return False
        try:
            return bool(self._redis.ping())
        except redis.RedisError:
            return False

    def _app(self, environ: dict, start: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            start("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
            return [generate_latest()]
        if path == "/health":
            ok = self.healthy()
            start("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"not ready\n"]
        start("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    def stop(self) -> None:
        self._server.shutdown()
