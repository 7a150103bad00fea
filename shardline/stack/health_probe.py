"""Whether a service is up: its gRPC health check, or its HTTP health endpoint."""

from __future__ import annotations

import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def healthy(health: str) -> bool:
    """A gRPC address's health check, or an HTTP health URL's."""
    return http_ok(health) if health.startswith("http://") else grpc_serving(health)


def grpc_serving(address: str) -> bool:
    """Whether the gRPC health check at `address` answers SERVING."""
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def http_ok(url: str) -> bool:
    """Whether `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False
