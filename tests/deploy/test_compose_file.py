"""docker-compose.yml, .env.example and the CPU override, checked by the real Compose v2 binary."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.deploy.compose_project import (
    COMPOSE_FILE,
    CPU_OVERRIDE,
    ENV_EXAMPLE,
    REDIS_PASSWORD,
    SHARDLINE_SERVICES,
    SHARED_SETTINGS,
    env_example_variables,
    raw_config,
    resolved_config,
    run_compose,
    settings_class,
)


@pytest.mark.parametrize("profile_args", [(), ("--profile", "observability")], ids=["default", "observability"])
def test_compose_config_validates(profile_args):
    result = run_compose(*profile_args, "config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_config_validates_with_only_a_redis_password(tmp_path):
    # A first `docker compose up` before anyone copied .env.example works once the password is set.
    empty = tmp_path / "empty.env"
    empty.write_text("")
    result = run_compose("--profile", "observability", "config", "-q", env_file=empty)
    assert result.returncode == 0, result.stderr


def test_without_a_redis_password_compose_refuses_and_says_what_to_set(tmp_path):
    empty = tmp_path / "empty.env"
    empty.write_text("")
    for env_file in (empty, ENV_EXAMPLE):
        result = run_compose("config", "-q", env_file=env_file, redis_password=None)
        assert result.returncode != 0
        assert "set REDIS_PASSWORD in .env" in result.stderr


def test_redis_asks_for_the_password_and_every_service_gives_it():
    config = resolved_config()
    redis = config["services"]["redis"]
    assert redis["command"][-2:] == ["--requirepass", REDIS_PASSWORD]
    assert "ports" not in redis
    for name, service in config["services"].items():
        url = (service.get("environment") or {}).get("SHARDLINE_REDIS_URL")
        if url is not None:
            assert url == f"redis://:{REDIS_PASSWORD}@redis:6379/0", name


def test_each_image_is_built_once_with_every_base_image_a_build_argument():
    config = resolved_config()
    builders = {name: service["build"] for name, service in config["services"].items() if "build" in service}
    # One build per image: compose builds one for every service with a build section, even the same one.
    assert {name: build["target"] for name, build in builders.items()} == {
        "tracing": "service",
        "gpu-worker": "gpu-worker",
    }
    for build in builders.values():
        assert {"PYTHON_IMAGE", "CUDA_IMAGE", "PIP_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST"} <= set(
            build["args"]
        )
        assert [secret["source"] for secret in build["secrets"]] == ["pip_ca"]
    assert builders["tracing"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert builders["gpu-worker"]["args"]["TORCH_INDEX_URL"] == ""  # PyPI's CUDA build
    # The CPU worker keeps no locked-memory limit that a host with a finite one would refuse.
    cpu = resolved_config(files=(COMPOSE_FILE, CPU_OVERRIDE))["services"]["gpu-worker"]
    assert "memlock" not in cpu.get("ulimits", {}) and cpu["ulimits"]["stack"] == 67108864


def test_cpu_override_validates_and_drops_the_gpu_reservation():
    config = resolved_config(files=(COMPOSE_FILE, CPU_OVERRIDE))
    worker = config["services"]["gpu-worker"]
    assert "deploy" not in worker or not worker["deploy"].get("resources")
    # The CPU worker runs the service image, built once by the tracing service's entry.
    assert "build" not in worker and worker["image"] == config["services"]["tracing"]["image"]
    assert config["services"]["tracing"]["build"]["target"] == "service"
    assert worker["environment"]["SHARDLINE_DEVICE"] == "cpu"


@pytest.mark.parametrize(
    "old, new, error",
    [
        ("condition: service_healthy", "condition: service_happy", "condition value must be one of"),
        (
            "      scheduler:\n        condition: service_healthy",
            "      sheduler:\n        condition: service_healthy",
            'undefined service "sheduler"',
        ),
        (
            "    restart: unless-stopped\n",
            "    restart: unless-stopped\n    replicas_please: 2\n",
            "additional properties 'replicas_please' not allowed",
        ),
    ],
    ids=["bad-condition", "unknown-dependency", "unknown-key"],
)
def test_compose_config_rejects_a_broken_copy(tmp_path, old, new, error):
    """The negative control: the same check fails, and says why, once the file is wrong."""
    text = COMPOSE_FILE.read_text()
    assert old in text
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new, 1))
    result = run_compose("config", "-q", files=(broken,))
    assert result.returncode != 0
    assert error in result.stderr


def test_shardline_services_run_shardline_serve():
    services = resolved_config()["services"]
    images = {services["tracing"]["image"], services["gpu-worker"]["image"]}  # the two built here
    built_here = {name for name, service in services.items() if service["image"] in images}
    assert built_here == set(SHARDLINE_SERVICES)
    for name in built_here:
        command = services[name]["command"]
        assert command[:2] == ["shardline", "serve"], name
    assert services["gpu-worker"]["command"] == ["shardline", "serve", "worker"]
    assert {services[name]["command"][2] for name in built_here} == {
        "tokenizer",
        "scheduler",
        "worker",
        "gateway",
        "tracing",
        "batch",
    }


def test_every_service_has_a_healthcheck_a_restart_policy_and_healthy_dependencies():
    services = resolved_config("--profile", "observability")["services"]
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        assert service.get("restart") == "unless-stopped", name
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, (name, dependency)
            assert condition["condition"] == "service_healthy", (name, dependency)
    # Redis too, for the Batch API's records and queue.
    assert set(services["gateway"]["depends_on"]) == {"redis", "tokenizer", "scheduler", "gpu-worker"}
    assert set(services["batch"]["depends_on"]) == {"redis", "gateway"}
    assert set(services["scheduler"]["depends_on"]) == {"redis"}
    assert set(services["tracing"]["depends_on"]) == {"redis"}


def test_healthchecks_probe_the_port_each_service_listens_on():
    services = resolved_config()["services"]
    own_port = {
        "tokenizer": "SHARDLINE_PORT",
        "scheduler": "SHARDLINE_PORT",
        "gpu-worker": "SHARDLINE_PORT",
        "gateway": "SHARDLINE_HTTP_PORT",
        "tracing": "SHARDLINE_OTLP_PORT",
    }
    for name, variable in own_port.items():
        test = services[name]["healthcheck"]["test"]
        assert test[:2] == ["CMD", "shardline-healthcheck"], name
        assert f"localhost:{services[name]['environment'][variable]}" in test[-1], name


def test_workers_scale_without_a_fixed_port_id_or_address():
    worker = resolved_config()["services"]["gpu-worker"]
    assert "ports" not in worker and "container_name" not in worker
    # Left unset so that each replica gets its own: worker-<hostname>-<port>, and the
    # address the worker derives from its container's IP.
    assert worker["environment"].get("SHARDLINE_WORKER_ID") is None
    assert worker["environment"].get("SHARDLINE_ADVERTISE_ADDRESS") is None


@pytest.mark.parametrize("tp_size", [1, 2])
def test_worker_reserves_one_gpu_per_tensor_parallel_rank(tmp_path, tp_size):
    env = tmp_path / "tp.env"
    env.write_text(ENV_EXAMPLE.read_text().replace("SHARDLINE_TP_SIZE=1", f"SHARDLINE_TP_SIZE={tp_size}"))
    worker = resolved_config(env_file=env)["services"]["gpu-worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert device["count"] == tp_size
    assert worker["environment"]["SHARDLINE_TP_SIZE"] == str(tp_size)
    assert int(worker["shm_size"]) >= 1 << 30 and worker["ipc"] == "private"


def test_redis_keeps_an_append_only_file_on_a_volume():
    redis = resolved_config()["services"]["redis"]
    assert "--appendonly" in redis["command"] and "yes" in redis["command"]
    (mount,) = redis["volumes"]
    assert mount["type"] == "volume" and mount["target"] == "/data"


def test_env_example_documents_exactly_the_variables_compose_reads():
    text = COMPOSE_FILE.read_text()
    interpolated = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", text))
    passed_through = {
        key
        for service in raw_config()["services"].values()
        for key, value in (service.get("environment") or {}).items()
        if value is None
    }
    # Merge keys of the shared anchors are resolved by the YAML loader, so they are counted above.
    documented = set(env_example_variables()) - {"COMPOSE_PROFILES"}
    assert interpolated | passed_through == documented


def test_every_setting_a_service_gets_is_one_it_reads(monkeypatch):
    """Each SHARDLINE_* variable names a field of the service's settings, and the values of
    .env.example pass the settings' validation."""
    services = resolved_config()["services"]
    shared = settings_class(SHARED_SETTINGS)
    for name, path in SHARDLINE_SERVICES.items():
        cls = settings_class(path)
        environment = services[name].get("environment") or {}
        for variable in environment:
            field = variable.removeprefix("SHARDLINE_").lower()
            assert variable.startswith("SHARDLINE_"), (name, variable)
            assert field in cls.model_fields or field in shared.model_fields, (name, variable)
        with monkeypatch.context() as patch:
            for variable, value in environment.items():
                if value is not None:
                    patch.setenv(variable, value)
            cls()


def test_healthcheck_commands_are_plain_argv():
    # CMD healthchecks run without a shell: no quoting or pipes may hide inside an argument.
    for name, service in resolved_config()["services"].items():
        test = service["healthcheck"]["test"]
        if test[0] == "CMD":
            assert all(shlex.split(arg) == [arg] for arg in test[1:]), name


def test_bind_mounts_point_into_the_repository():
    services = resolved_config("--profile", "observability")["services"]
    for name, service in services.items():
        for mount in service.get("volumes", []):
            if mount["type"] == "bind":
                assert Path(mount["source"]).exists(), (name, mount["source"])


def test_the_deploy_guide_documents_every_variable():
    guide = (COMPOSE_FILE.parent / "docs" / "deploy.md").read_text()
    section = guide[guide.index("## Deploy with docker compose") :]
    end = section.find("\n## ")
    section = section if end < 0 else section[:end]
    missing = [name for name in env_example_variables() if f"`{name}`" not in section]
    assert not missing
    # And the other way: a setting the guide's table offers must reach its service through .env.
    tabled = {
        name
        for row in section.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`([A-Z][A-Z0-9_]*)`", row.split("|")[1])
    }
    assert tabled - set(env_example_variables()) == set()


def test_the_disaggregated_override_adds_prefill_workers_and_makes_the_others_decode():
    disaggregated = COMPOSE_FILE.parent / "deploy" / "compose" / "disaggregated.yml"
    cpu_prefill = COMPOSE_FILE.parent / "deploy" / "compose" / "cpu-prefill-worker.yml"
    assert "prefill-worker" not in resolved_config()["services"]  # the default stack is unchanged
    for files, image in (
        ((COMPOSE_FILE, disaggregated), "shardline/gpu-worker:0.1.0"),
        ((COMPOSE_FILE, CPU_OVERRIDE, disaggregated, cpu_prefill), "shardline/service:0.1.0"),
    ):
        services = resolved_config(files=files)["services"]
        worker, prefill = services["gpu-worker"], services["prefill-worker"]
        assert (worker["environment"]["SHARDLINE_ROLE"], prefill["environment"]["SHARDLINE_ROLE"]) == (
            "decode",
            "prefill",
        )
        # Apart from its role, a prefill worker is a gpu-worker replica, run from the image that one builds.
        assert prefill["image"] == worker["image"] == image and "build" not in prefill
        for key in ("command", "volumes", "deploy", "depends_on", "healthcheck"):
            assert prefill.get(key) == worker.get(key), key
        unrole = {k: v for k, v in worker["environment"].items() if k != "SHARDLINE_ROLE"}
        assert {k: v for k, v in prefill["environment"].items() if k != "SHARDLINE_ROLE"} == unrole
