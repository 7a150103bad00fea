"""The Kubernetes manifests under deploy/k8s, checked for structure and for agreement with the code.

No cluster and no schema validator (kubeconform) here: these checks read the YAML, and
`kubectl kustomize` builds it when kubectl is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client import REGISTRY

import tracing.metrics  # noqa: F401  (registers the metrics the KEDA query may name)
from shardline.cli.main import SERVICES
from shardline.core.model_path import DEFAULT_MODEL_NAME
from tests.deploy.compose_project import REPO, SHARED_SETTINGS, settings_class

K8S = REPO / "deploy" / "k8s"
WORKLOADS = ("Deployment", "StatefulSet")
# Applied by hand where their CRDs exist, so not among kustomization.yaml's resources.
OPTIONAL = {"keda-scaledobject.yaml"}
# Each client method scheduler_svc/autoscale/kubernetes_driver.py may call, as the RBAC (API group,
# resource, verb) it needs: a new call fails the Role test below until both learn of it.
DRIVER_CALLS = {
    "read_namespaced_deployment_scale": ("apps", "deployments/scale", "get"),
    "patch_namespaced_deployment_scale": ("apps", "deployments/scale", "patch"),
    "patch_namespaced_pod": ("", "pods", "patch"),
}
# `shardline serve <name>` -> the settings class it reads.
SETTINGS = {
    "tokenizer": "tokenizer_svc.settings:TokenizerSettings",
    "scheduler": "scheduler_svc.settings:SchedulerSettings",
    "worker": "gpu_worker_svc.server.settings:WorkerSettings",
    "gateway": "gateway.settings:GatewaySettings",
    "tracing": "tracing.settings:TracingSettings",
    "batch": "batch_svc.settings:BatchSettings",
}


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def objects(kustomization) -> list[dict]:
    docs = []
    for name in kustomization["resources"]:
        docs += [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]
    return docs


def by_kind(objects: list[dict], *kinds: str) -> list[dict]:
    return [o for o in objects if o["kind"] in kinds]


def named(objects: list[dict], kind: str, name: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def shardline_containers(objects: list[dict]):
    for workload in by_kind(objects, *WORKLOADS):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if container["image"].startswith("shardline/"):
                yield workload, container


def serve_target(container: dict) -> str:
    argv = container.get("command", []) + container.get("args", [])
    assert argv[:2] == ["shardline", "serve"], argv
    return argv[2]


def test_kustomization_lists_every_manifest(kustomization):
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk - OPTIONAL


def test_every_object_has_api_version_kind_and_name(objects):
    for obj in objects:
        assert obj["apiVersion"] and obj["kind"] and obj["metadata"]["name"], obj
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names))


def test_workloads_select_their_own_pods(objects):
    for workload in by_kind(objects, *WORKLOADS):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), workload["metadata"]["name"]
        assert workload["spec"]["replicas"] >= 1


def test_every_service_runs_as_shardline_serve(objects, kustomization):
    images = {entry["name"] for entry in kustomization["images"]}
    targets = set()
    for _workload, container in shardline_containers(objects):
        target = serve_target(container)
        assert target in SERVICES, target
        assert container["image"] in images
        targets.add(target)
    assert targets == set(SERVICES)


def test_workers_get_gpus_shared_memory_and_their_pod_address(objects):
    worker = named(objects, "Deployment", "gpu-worker")
    pod = worker["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert serve_target(container) == "worker"
    env = {e["name"]: e for e in container["env"]}
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= 1 and env["SHARDLINE_TP_SIZE"]["value"] == str(gpus)
    shm = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert shm[mount["name"]]["emptyDir"]["medium"] == "Memory"
    # $(POD_IP) expands only from a variable defined earlier in the list.
    names = [e["name"] for e in container["env"]]
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert names.index("POD_IP") < names.index("SHARDLINE_ADVERTISE_ADDRESS")
    assert env["SHARDLINE_ADVERTISE_ADDRESS"]["value"] == f"$(POD_IP):{env['SHARDLINE_PORT']['value']}"
    # The autoscaler names a drained worker by its id, and the Kubernetes driver finds its pod by it.
    assert env["SHARDLINE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_one_scheduler_replaced_not_rolled(objects):
    scheduler = named(objects, "Deployment", "scheduler")
    assert scheduler["spec"]["replicas"] == 1
    assert scheduler["spec"]["strategy"]["type"] == "Recreate"


def driver_permissions() -> set[tuple[str, str, str]]:
    source = (REPO / "scheduler_svc" / "autoscale" / "kubernetes_driver.py").read_text()
    called = set(re.findall(r"self\._(?:apps|core)\.(\w+)", source))
    assert called and called <= DRIVER_CALLS.keys(), called - DRIVER_CALLS.keys()
    return {DRIVER_CALLS[method] for method in called}


def test_the_scheduler_may_do_exactly_what_its_kubernetes_driver_calls(objects):
    pod = named(objects, "Deployment", "scheduler")["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    named(objects, "ServiceAccount", account)
    subject = {"kind": "ServiceAccount", "name": account, "namespace": "shardline"}
    (binding,) = [b for b in by_kind(objects, "RoleBinding") if subject in b["subjects"]]
    assert not by_kind(objects, "ClusterRole", "ClusterRoleBinding")
    assert binding["roleRef"]["kind"] == "Role"
    rules = named(objects, "Role", binding["roleRef"]["name"])["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert granted == driver_permissions()
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    deployment = env["SHARDLINE_AUTOSCALE_K8S_DEPLOYMENT"]["value"]
    named(objects, "Deployment", deployment)
    (scale_rule,) = [rule for rule in rules if rule["resources"] == ["deployments/scale"]]
    assert scale_rule["resourceNames"] == [deployment]
    assert env["SHARDLINE_AUTOSCALE_K8S_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["SHARDLINE_AUTOSCALE_DRIVER"]["value"] == "kubernetes"
    assert env["SHARDLINE_AUTOSCALE_POLICY"]["value"] == "static"  # off until a user turns it on


def test_the_keda_scaled_object_follows_the_schedulers_desired_workers(objects):
    (scaled,) = [doc for doc in yaml.safe_load_all((K8S / "keda-scaledobject.yaml").read_text()) if doc]
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", "gpu-worker")
    named(objects, "Deployment", target["name"])
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    metric = re.fullmatch(r'max\((\w+)\{model="([^"]+)"\}\)', trigger["metadata"]["query"])
    assert metric and metric.group(1) == "shardline_autoscaler_desired_workers"
    assert metric.group(1) in {family.name for family in REGISTRY.collect()}
    # shardline-config leaves SHARDLINE_MODEL empty: the default model, served under this name.
    assert named(objects, "ConfigMap", "shardline-config")["data"]["SHARDLINE_MODEL"] == ""
    assert metric.group(2) == DEFAULT_MODEL_NAME
    # A target of 1 per replica: the HPA asks for ceil(desired workers) replicas.
    assert trigger.get("metricType", "AverageValue") == "AverageValue"
    assert float(trigger["metadata"]["threshold"]) == 1
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_services_target_ports_their_pods_expose(objects):
    workloads = by_kind(objects, *WORKLOADS)
    for service in by_kind(objects, "Service"):
        selector = service["spec"]["selector"]
        (workload,) = [w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        ports = [p for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
        exposed = {p["name"] for p in ports} | {p["containerPort"] for p in ports}
        for port in service["spec"]["ports"]:
            assert port.get("targetPort", port["port"]) in exposed, (service["metadata"]["name"], port)


def test_every_container_has_probes_on_ports_it_listens_on(objects):
    for workload in by_kind(objects, *WORKLOADS):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            ports = container.get("ports", [])
            exposed = {p["name"] for p in ports} | {p["containerPort"] for p in ports}
            for kind in ("readinessProbe", "livenessProbe"):
                probe = container[kind]
                for handler in ("grpc", "httpGet", "tcpSocket"):
                    if handler in probe:
                        assert probe[handler]["port"] in exposed, (container["name"], kind)


def test_env_references_exist(objects):
    config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in by_kind(objects, "ConfigMap")}
    secrets = {
        o["metadata"]["name"]: {**o.get("stringData", {}), **o.get("data", {})} for o in by_kind(objects, "Secret")
    }
    for workload in by_kind(objects, *WORKLOADS):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in config_maps
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in secrets
            for var in container.get("env", []):
                ref = var.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    assert ref["secretKeyRef"]["key"] in secrets[ref["secretKeyRef"]["name"]], var
                if "configMapKeyRef" in ref:
                    assert ref["configMapKeyRef"]["key"] in config_maps[ref["configMapKeyRef"]["name"]], var


def test_every_setting_is_one_the_service_reads(objects):
    shared = settings_class(SHARED_SETTINGS).model_fields
    config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in by_kind(objects, "ConfigMap")}
    for _workload, container in shardline_containers(objects):
        target = serve_target(container)
        fields = settings_class(SETTINGS[target]).model_fields
        variables = [e["name"] for e in container.get("env", []) if e["name"].startswith("SHARDLINE_")]
        assert variables, target
        for variable in variables:
            assert variable.removeprefix("SHARDLINE_").lower() in fields.keys() | shared.keys(), (target, variable)
    every_field = set(shared)
    for path in SETTINGS.values():
        every_field |= set(settings_class(path).model_fields)
    for data in config_maps.values():
        for key in data:
            assert key.startswith("SHARDLINE_") and key.removeprefix("SHARDLINE_").lower() in every_field, key


def test_addresses_name_existing_services_and_ports(objects):
    services = {s["metadata"]["name"]: {p["port"] for p in s["spec"]["ports"]} for s in by_kind(objects, "Service")}
    values = [v for o in by_kind(objects, "ConfigMap") for v in o.get("data", {}).values()]
    values += [v for o in by_kind(objects, "Secret") for v in o.get("stringData", {}).values()]
    for _workload, container in shardline_containers(objects):
        values += [e["value"] for e in container.get("env", []) if "value" in e]
    addresses = [m for v in values for m in re.findall(r"(?:^|//)([a-z][a-z0-9-]*):(\d+)", v)]
    assert {name for name, _port in addresses} >= {"scheduler", "tokenizer", "tracing", "redis"}
    for name, port in addresses:
        assert int(port) in services[name], f"{name}:{port}"


def test_scrape_annotations_name_a_metrics_port(objects):
    for workload in by_kind(objects, *WORKLOADS):
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            ports = {
                p["containerPort"]
                for c in workload["spec"]["template"]["spec"]["containers"]
                for p in c.get("ports", [])
            }
            assert int(annotations["prometheus.io/port"]) in ports, workload["metadata"]["name"]


def test_kustomize_builds_the_manifests():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    built = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    for obj in built:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "shardline", obj["metadata"]["name"]
    images = {c["image"] for o in by_kind(built, *WORKLOADS) for c in o["spec"]["template"]["spec"]["containers"]}
    assert {"shardline/service:0.1.0", "shardline/gpu-worker:0.1.0"} <= images


def test_the_disaggregated_overlay_adds_prefill_workers_and_makes_the_others_decode():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    overlay = REPO / "deploy" / "k8s-disaggregated"
    result = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    built = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    roles = {}
    for name in ("gpu-worker", "prefill-worker"):
        workload = named(built, "Deployment", name)
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        assert serve_target(container) == "worker" and container["image"] == "shardline/gpu-worker:0.1.0"
        assert workload["metadata"]["namespace"] == "shardline"
        roles[name] = {e["name"]: e.get("value") for e in container["env"]}["SHARDLINE_ROLE"]
    assert roles == {"gpu-worker": "decode", "prefill-worker": "prefill"}
    # Apart from its role, a prefill worker is a gpu-worker pod: the same GPUs, probes and address.
    base = named(built, "Deployment", "gpu-worker")["spec"]["template"]["spec"]["containers"][0]
    prefill = named(built, "Deployment", "prefill-worker")["spec"]["template"]["spec"]["containers"][0]
    for key in ("resources", "startupProbe", "readinessProbe", "livenessProbe", "ports", "volumeMounts"):
        assert prefill[key] == base[key], key
