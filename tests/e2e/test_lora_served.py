"""LoRA adapters through the whole stack: named at start (--lora on `shardline up`), listed with their
parent, named by a request's model over HTTP and gRPC, refused by name when unknown, and a request
moved after its worker dies continues with its adapter, identically."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from benchmarks.lora import write_adapter
from gpu_worker_svc.model.loader import load_config
from shardline.client import ShardlineClient
from shardline.stack.local_stack import StackConfig
from tests.e2e.conftest import log_dir, running_stack
from tests.e2e.http_client import get, post

pytestmark = [pytest.mark.slow, pytest.mark.extended]

PROMPT = "Write one sentence about the sea."


@pytest.fixture(scope="module")
def adapter_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    cfg = load_config(None)
    for seed, name in enumerate(("support", "legal", "late")):
        write_adapter(folder / name, cfg, rank=8, seed=seed, alpha=64)  # strong: a confident text changes too
    (folder / "broken").mkdir()  # refused at load: the workers serve the others
    return folder


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory, adapter_folder):
    folder = adapter_folder
    config = StackConfig.on_free_ports(
        workers=2,
        data_dir=tmp_path_factory.mktemp("lora-data"),
        log_dir=log_dir(tmp_path_factory, "lora"),
        # float32 weights: with GGUF's, an adapter's tokens are not bitwise the same after a move (docs/lora.md).
        env={
            "HEARTBEAT_INTERVAL_S": "0.5",
            "KV_CACHE_BYTES": str(64 << 20),
            "ALLOW_RUNTIME_LORA_UPDATING": "1",
            "QUANTIZATION": "none",
        },
        lora_adapters=",".join(f"{n}={folder / n}" for n in ("support", "legal", "broken")),
    )
    with running_stack(config) as stack:
        yield stack


def _completion(url: str, model: str, **extra) -> tuple[int, dict]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extra}
    return post(f"{url}/v1/completions", body)


def test_models_lists_the_adapters_with_their_parent(lora_stack):
    status, raw = get(f"http://127.0.0.1:{lora_stack.config.http_port}/v1/models")
    cards = {card["id"]: card for card in json.loads(raw)["data"]}
    assert status == 200 and set(cards) == {"SmolLM2-135M-Instruct", "support", "legal"}
    assert cards["support"]["parent"] == cards["legal"]["parent"] == "SmolLM2-135M-Instruct"
    assert cards["SmolLM2-135M-Instruct"]["parent"] is None


def test_a_request_naming_an_adapter_runs_with_it(lora_stack):
    url = f"http://127.0.0.1:{lora_stack.config.http_port}"
    texts = {}
    for model in ("SmolLM2-135M-Instruct", "support", "legal"):
        status, resp = _completion(url, model)
        assert status == 200 and resp["model"] == model, resp
        texts[model] = resp["choices"][0]["text"]
    assert len(set(texts.values())) == 3
    with ShardlineClient(f"127.0.0.1:{lora_stack.config.grpc_port}", timeout=120) as client:
        grpc_text = client.generate(PROMPT, model="support", max_tokens=16, temperature=0, ignore_eos=True).text
        assert {m.name: m.parent for m in client.models()}["legal"] == "SmolLM2-135M-Instruct"
    assert grpc_text == texts["support"]


def test_an_unknown_adapter_is_404_naming_it(lora_stack):
    status, resp = _completion(f"http://127.0.0.1:{lora_stack.config.http_port}", "broken")
    assert status == 404 and "'broken'" in resp["error"]["message"] and "'support'" in resp["error"]["message"]


def test_adapters_load_and_unload_at_run_time(lora_stack, adapter_folder):
    url = f"http://127.0.0.1:{lora_stack.config.http_port}"
    folder = adapter_folder
    assert _completion(url, "late")[0] == 404
    status, _ = post(f"{url}/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(folder / "broken")})
    assert status == 400
    req = urllib.request.Request(
        f"{url}/v1/load_lora_adapter", json.dumps({"lora_name": "late", "lora_path": str(folder / "late")}).encode()
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200 and b"'late' added" in resp.read()
    status, resp = _completion(url, "late")
    assert status == 200 and resp["model"] == "late"
    with ShardlineClient(f"127.0.0.1:{lora_stack.config.grpc_port}", timeout=120) as client:
        assert "late" in {m.name for m in client.models()}
    req = urllib.request.Request(f"{url}/v1/unload_lora_adapter", json.dumps({"lora_name": "late"}).encode())
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
    assert _completion(url, "late")[0] == 404
    assert post(f"{url}/v1/unload_lora_adapter", {"lora_name": "late"})[0] == 404


def test_a_request_moved_after_its_worker_dies_continues_with_its_adapter(lora_stack):
    params = dict(model="legal", max_tokens=40, temperature=0.8, seed=5, ignore_eos=True)
    with ShardlineClient(f"127.0.0.1:{lora_stack.config.grpc_port}", timeout=120) as client:
        reference = client.generate(PROMPT, **params)
        stream = client.stream(PROMPT, **params)
        tokens: list[int] = []
        for chunk in stream:
            tokens += chunk.token_ids
            if len(tokens) >= 8:
                break
        victim = client.get_request(chunk.request_id).worker_id
        lora_stack.kill(victim)
        t_kill = time.monotonic()
        for chunk in stream:
            tokens += chunk.token_ids
        info = client.get_request(chunk.request_id)
    assert tokens == reference.token_ids
    assert info.attempt == 2 and info.worker_id not in ("", victim)
    assert time.monotonic() - t_kill < 60
