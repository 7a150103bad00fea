"""The Kubernetes driver's requests, against a local HTTP server that plays back API server responses.

No API server can run here, so a fake stands in for it: it answers each (method, path) with a
recorded response from k8s_recordings/ and keeps every request it got, so the tests check
exactly what the driver sends over the wire through the real `kubernetes` client.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from kubernetes import client

from scheduler_svc.autoscale.kubernetes_driver import (
    DELETION_COST,
    RETIRED_COST,
    KubernetesDriver,
    KubernetesDriverConfig,
    KubernetesScaleError,
    load_client_configuration,
)

RECORDINGS = Path(__file__).parent / "k8s_recordings"
SCALE = "/apis/apps/v1/namespaces/shardline/deployments/gpu-worker/scale"
RETIRED_POD = "gpu-worker-6b9f7c8d5-x2k4q"
TERMINATING_POD = "gpu-worker-6b9f7c8d5-p7m2n"
MERGE_PATCH = "application/strategic-merge-patch+json"


def pod_path(name: str) -> str:
    return f"/api/v1/namespaces/shardline/pods/{name}"


@dataclass(slots=True, frozen=True)
class Request:
    """One request the fake got."""

    # HTTP method.
    method: str
    # Path with its query string.
    path: str
    # The Content-Type header, None without a body.
    content_type: str | None
    # The JSON body, None without one.
    body: dict | None


class RecordedApiServer:
    """Answers each (method, path) with its recordings in turn (the last one repeats); 404 otherwise."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.authorizations: list[str | None] = []
        self._routes: dict[tuple[str, str], list[str]] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        # A short poll so that stopping the fake does not wait half a second per test.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def play(self, method: str, path: str, *recordings: str) -> None:
        self._routes[(method, path)] = list(recordings)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, method: str, path: str) -> tuple[int, bytes]:
        queue = self._routes.get((method, path))
        if not queue:
            return 404, b'{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}'
        recording = queue.pop(0) if len(queue) > 1 else queue[0]
        text = (RECORDINGS / recording).read_text()
        return json.loads(text).get("code", 200), text.encode()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                fake.requests.append(
                    Request(
                        self.command,
                        self.path,
                        self.headers.get("Content-Type") if raw else None,
                        json.loads(raw) if raw else None,
                    )
                )
                fake.authorizations.append(self.headers.get("Authorization"))
                status, body = fake._answer(self.command, self.path)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PATCH = _serve

            def log_message(self, format: str, *args: object) -> None:
                pass  # the test asserts on fake.requests instead

        return Handler


@pytest.fixture
def api() -> Iterator[RecordedApiServer]:
    server = RecordedApiServer()
    server.start()
    yield server
    server.stop()


def driver_for(api: RecordedApiServer, **settings) -> KubernetesDriver:
    configuration = client.Configuration(host=api.host)
    return KubernetesDriver(KubernetesDriverConfig(**settings), configuration)


def get_scale(path: str = SCALE) -> Request:
    return Request("GET", path, None, None)


def patch_replicas(replicas: int) -> Request:
    return Request("PATCH", SCALE, MERGE_PATCH, {"spec": {"replicas": replicas}})


def patch_deletion_cost(pod: str) -> Request:
    return Request("PATCH", pod_path(pod), MERGE_PATCH, {"metadata": {"annotations": {DELETION_COST: RETIRED_COST}}})


def test_scaling_up_reads_the_scale_then_patches_the_replicas(api):
    api.play("GET", SCALE, "scale-gpu-worker-2.json")
    api.play("PATCH", SCALE, "scale-gpu-worker-3.json")
    driver_for(api).scale("default", 3, [])
    assert api.requests == [get_scale(), patch_replicas(3)]


def test_scaling_down_annotates_the_retired_pod_before_lowering_the_replicas(api):
    api.play("GET", SCALE, "scale-gpu-worker-3.json", "scale-gpu-worker-2.json")
    api.play("PATCH", pod_path(RETIRED_POD), "pod-gpu-worker-6b9f7c8d5-x2k4q.json")
    api.play("PATCH", SCALE, "scale-gpu-worker-2.json")
    driver = driver_for(api)
    driver.scale("default", 2, [RETIRED_POD])
    assert api.requests == [get_scale(), patch_deletion_cost(RETIRED_POD), patch_replicas(2)]
    # The scheduler retries with the same arguments: the count is right, so nothing is patched.
    driver.scale("default", 2, [RETIRED_POD])
    assert api.requests[3:] == [get_scale()]


def test_no_patch_when_the_count_is_already_right(api):
    api.play("GET", SCALE, "scale-gpu-worker-2.json")
    driver_for(api).scale("default", 2, [RETIRED_POD])
    assert api.requests == [get_scale()]


def test_a_retired_worker_without_a_pod_never_lowers_the_count(api):
    # Lowering the replicas with no pod marked would let the Deployment remove a serving worker.
    api.play("GET", SCALE, "scale-gpu-worker-3.json")
    api.play("PATCH", pod_path(RETIRED_POD), "status-not-found-pod.json")
    with pytest.raises(KubernetesScaleError, match="kept 3 replicas, not 2"):
        driver_for(api).scale("default", 2, [RETIRED_POD])
    assert api.requests == [get_scale(), patch_deletion_cost(RETIRED_POD)]


def test_a_terminating_retired_pod_is_not_counted_again(api):
    api.play("GET", SCALE, "scale-gpu-worker-3.json")
    api.play("PATCH", pod_path(TERMINATING_POD), "pod-gpu-worker-6b9f7c8d5-p7m2n-terminating.json")
    api.play("PATCH", pod_path(RETIRED_POD), "pod-gpu-worker-6b9f7c8d5-x2k4q.json")
    api.play("PATCH", SCALE, "scale-gpu-worker-2.json")
    with pytest.raises(KubernetesScaleError, match="kept 2 replicas, not 1"):
        driver_for(api).scale("default", 1, [TERMINATING_POD, RETIRED_POD])
    assert api.requests == [
        get_scale(),
        patch_deletion_cost(TERMINATING_POD),
        patch_deletion_cost(RETIRED_POD),
        patch_replicas(2),
    ]


def test_forbidden_names_rbac_and_the_resource(api):
    api.play("GET", SCALE, "status-forbidden-scale.json")
    with pytest.raises(KubernetesScaleError, match="forbidden by RBAC") as raised:
        driver_for(api).scale("default", 3, [])
    assert raised.value.status == 403
    assert "get deployments/scale gpu-worker" in str(raised.value)
    assert "deploy/k8s/autoscaler-rbac.yaml" in str(raised.value)


def test_a_missing_deployment_is_named(api):
    api.play("GET", SCALE, "status-not-found-deployment.json")
    with pytest.raises(KubernetesScaleError, match="deployment 'gpu-worker' not found in namespace shardline"):
        driver_for(api).scale("default", 3, [])


def test_each_model_scales_its_own_deployment(api):
    path = "/apis/apps/v1/namespaces/shardline/deployments/llama-workers/scale"
    api.play("GET", path, "scale-llama-workers-1.json")
    driver = driver_for(api, deployments={"llama": "llama-workers"}, default_deployment=None)
    driver.scale("llama", 1, [])
    with pytest.raises(KubernetesScaleError, match="no worker Deployment configured for model 'qwen'"):
        driver.scale("qwen", 1, [])
    assert api.requests == [get_scale(path)]


def test_an_unreachable_api_server_is_a_scale_error():
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    configuration = client.Configuration(host=f"http://127.0.0.1:{port}")
    configuration.retries = 0
    with pytest.raises(KubernetesScaleError, match="unreachable") as raised:
        KubernetesDriver(KubernetesDriverConfig(), configuration).scale("default", 3, [])
    assert raised.value.status is None


def test_outside_a_cluster_the_kubeconfig_gives_the_server_and_token(api, tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "test", "cluster": {"server": api.host}}],
                "users": [{"name": "scheduler", "user": {"token": "recorded-token"}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "scheduler"}}],
                "current-context": "test",
            }
        )
    )
    api.play("GET", SCALE, "scale-gpu-worker-2.json")
    KubernetesDriver(KubernetesDriverConfig(kubeconfig=str(kubeconfig))).scale("default", 2, [])
    assert api.requests == [get_scale()]
    assert api.authorizations == ["Bearer recorded-token"]


def test_a_missing_kubeconfig_is_a_scale_error(tmp_path):
    with pytest.raises(KubernetesScaleError, match="no Kubernetes API configuration"):
        load_client_configuration(KubernetesDriverConfig(kubeconfig=str(tmp_path / "absent")))
