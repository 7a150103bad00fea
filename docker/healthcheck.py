#!/usr/bin/env python
"""Container healthcheck: exits 0 when a Shardline service says it is serving.

    shardline-healthcheck grpc HOST:PORT   # grpc.health.v1 Check, overall status
    shardline-healthcheck http URL         # an HTTP GET that answers 200 (the gateway's /health)

Compose and Kubernetes exec probes run it; the images ship no curl or grpc_health_probe.
"""

import sys
import urllib.request

TIMEOUT_S = 3.0


def grpc_serving(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            print(f"{address}: {exc.code().name}", file=sys.stderr)
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as reply:
            return reply.status == 200
    except OSError as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return False


def main(argv: list[str]) -> int:
    checks = {"grpc": grpc_serving, "http": http_ok}
    if len(argv) != 2 or argv[0] not in checks:
        print(__doc__, file=sys.stderr)
        return 2
    return 0 if checks[argv[0]](argv[1]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
