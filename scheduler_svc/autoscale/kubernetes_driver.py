"""A ScaleDriver that sets the replica count of each model's worker Deployment through the Kubernetes API.

A Deployment removes the pods with the lowest `controller.kubernetes.io/pod-deletion-cost`
first, so on the way down the driver gives each retired (drained) worker's pod the lowest cost
and only then lowers the replica count: the drained pods go, not workers still serving.
The cost is weighed after the controller's own ranks (unscheduled, then pending, then not-ready
pods go first), so a pod stuck Pending for want of a GPU would still go before a drained one.
A worker's id is its pod name (deploy/k8s/gpu-worker.yaml sets SHARDLINE_WORKER_ID from it).
The RBAC it needs is in deploy/k8s/autoscaler-rbac.yaml.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from shardline.core.errors import ShardlineError

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# The annotation is an int32: the lowest value goes before any pod left at the default of 0.
RETIRED_COST = str(-(2**31))


class KubernetesScaleError(ShardlineError):
    """The API server refused or could not be reached; the message says which object and why."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        # The HTTP status the API server answered, None when it was not reached.
        self.status = status


@dataclass(slots=True, frozen=True)
class KubernetesDriverConfig:
    """Where the worker Deployments are and how to reach the API server."""

    # Namespace of the worker Deployments and their pods.
    namespace: str = "shardline"
    # Model name -> the Deployment running its workers.
    deployments: Mapping[str, str] = field(default_factory=dict)
    # The Deployment of a model missing from `deployments`; None: such a model is an error.
    default_deployment: str | None = "gpu-worker"
    # Path of a kubeconfig file; None: the pod's service account, else the default kubeconfig.
    kubeconfig: str | None = None
    # Context in the kubeconfig; None: its current context.
    context: str | None = None
    # Seconds one API request may take, so that a hung API server cannot stall the autoscaler.
    request_timeout_s: float = 10.0


def load_client_configuration(settings: KubernetesDriverConfig) -> client.Configuration:
    """The API server's address and credentials: in-cluster when running in a pod, else a kubeconfig."""
    configuration = client.Configuration()
    try:
        if settings.kubeconfig is None:
            try:
                config.load_incluster_config(client_configuration=configuration)
                return configuration
            except ConfigException:
                pass  # not in a pod: a developer's kubeconfig, as kubectl would use
        config.load_kube_config(
            config_file=settings.kubeconfig,
            context=settings.context,
            client_configuration=configuration,
            persist_config=False,
        )
    except (ConfigException, OSError) as exc:
        raise KubernetesScaleError(f"no Kubernetes API configuration (in-cluster or kubeconfig): {exc}") from exc
    return configuration


class KubernetesDriver:
    """Makes a model's worker Deployment run the desired number of pods, removing drained ones first."""

    def __init__(self, settings: KubernetesDriverConfig, configuration: client.Configuration | None = None) -> None:
        self._settings = settings
        api = client.ApiClient(configuration or load_client_configuration(settings))
        self._apps = client.AppsV1Api(api)
        self._core = client.CoreV1Api(api)

    def deployment_for(self, model: str) -> str:
        """The Deployment that runs `model`'s workers."""
        name = self._settings.deployments.get(model, self._settings.default_deployment)
        if name is None:
            raise KubernetesScaleError(f"no worker Deployment configured for model {model!r}")
        return name

    def scale(self, model: str, desired: int, retired: Sequence[str]) -> None:
        """Sets `model`'s Deployment to `desired` replicas; when that is fewer, the `retired` pods go."""
        deployment = self.deployment_for(model)
        current = self._replicas(deployment)
        if desired == current:
            return
        target = desired
        if desired < current:
            # Lower the count only by the retired pods that exist: any further pod the Deployment
            # removed would be a worker that was never drained.
            removable = sum(self._mark_retired(worker) for worker in dict.fromkeys(retired))
            target = max(desired, current - removable)
        if target != current:
            log.info("scaling deployment %s/%s from %d to %d", self._settings.namespace, deployment, current, target)
            self._call(
                f"patch deployments/scale {deployment}",
                deployment,
                self._apps.patch_namespaced_deployment_scale,
                deployment,
                self._settings.namespace,
                {"spec": {"replicas": target}},
            )
        if target != desired:
            raise KubernetesScaleError(
                f"deployment {self._settings.namespace}/{deployment}: kept {target} replicas, not {desired}: "
                f"of the retired workers {list(retired)} only {current - target} are running pods, and "
                "going lower would remove workers that were not drained"
            )

    def _replicas(self, deployment: str) -> int:
        scale = self._call(
            f"get deployments/scale {deployment}",
            deployment,
            self._apps.read_namespaced_deployment_scale,
            deployment,
            self._settings.namespace,
        )
        return scale.spec.replicas or 0

    def _mark_retired(self, worker: str) -> bool:
        """Gives the worker's pod the lowest deletion cost; False when the pod is gone or going."""
        body = {"metadata": {"annotations": {DELETION_COST: RETIRED_COST}}}
        try:
            pod = self._call(
                f"patch pods {worker}", None, self._core.patch_namespaced_pod, worker, self._settings.namespace, body
            )
        except KubernetesScaleError as exc:
            if exc.status != 404:
                raise
            # Already deleted, by an earlier scale-down that this call repeats.
            return False
        # A terminating pod was already counted out of the replicas.
        return pod.metadata.deletion_timestamp is None

    def _call(self, what: str, deployment: str | None, method: Callable[..., Any], *args: Any) -> Any:
        try:
            return method(*args, _request_timeout=self._settings.request_timeout_s)
        except ApiException as exc:
            raise KubernetesScaleError(self._explain(what, deployment, exc), exc.status) from exc
        except urllib3.exceptions.HTTPError as exc:
            raise KubernetesScaleError(f"{what}: Kubernetes API server unreachable: {exc}") from exc

    def _explain(self, what: str, deployment: str | None, exc: ApiException) -> str:
        where = f"namespace {self._settings.namespace}"
        if exc.status == 403:
            return (
                f"{what} in {where}: forbidden by RBAC; bind the scheduler's ServiceAccount to the Role "
                f"in deploy/k8s/autoscaler-rbac.yaml ({exc.reason}: {exc.body})"
            )
        if exc.status == 404 and deployment is not None:
            return f"{what}: deployment {deployment!r} not found in {where} ({exc.body})"
        return f"{what} in {where}: HTTP {exc.status} {exc.reason}: {exc.body}"
