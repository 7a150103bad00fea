"""PEFT adapters read and checked against the model before anything is touched: every refusal names
the adapter and the field or tensor at fault."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save
from transformers import LlamaConfig, PreTrainedModel

from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.loader import load_config
from gpu_worker_svc.model.lora_adapter import LoraAdapterError, lora_targets, read_lora_adapter
from tests.gpu_worker_svc.model.random_checkpoints import random_hf_model
from tests.gpu_worker_svc.peft_adapters import ATTENTION, MLP, AdapterSpec, make_adapter

SHAPE = dict(vocab_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _tiny(hidden: int) -> PreTrainedModel:
    return random_hf_model(LlamaConfig(hidden_size=hidden, **SHAPE), seed=3)


@pytest.fixture(scope="module")
def tiny_model() -> PreTrainedModel:
    return _tiny(64)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory, tiny_model) -> ModelConfig:
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model.save_pretrained(folder)
    return load_config(folder)


@pytest.fixture(scope="module")
def adapter_folder(tmp_path_factory, tiny_model) -> Path:
    folder = tmp_path_factory.mktemp("adapter")
    make_adapter(tiny_model, folder, AdapterSpec(8, tuple(ATTENTION + MLP), alpha=16.0))
    return folder


def _copy(source: Path, target: Path, config: dict | None = None, weights: bytes | None = None) -> Path:
    target.mkdir(exist_ok=True)
    cfg = json.loads((source / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    data = (source / "adapter_model.safetensors").read_bytes() if weights is None else weights
    (target / "adapter_model.safetensors").write_bytes(data)
    return target


def test_a_peft_adapter_is_read_with_its_scaling(adapter_folder, tiny_config):
    adapter = read_lora_adapter("good", adapter_folder, tiny_config)
    assert adapter.rank == 8
    assert len(adapter.weights) == 2 * 7  # two layers, seven modules each
    a, b = adapter.weights[(1, "k_proj")]
    assert a.shape == (8, 64) and b.shape == (32, 8)
    raw = load_file(adapter_folder / "adapter_model.safetensors")
    key = next(k for k in raw if "layers.1.self_attn.k_proj.lora_B" in k)
    torch.testing.assert_close(b, raw[key] * (16.0 / 8))


def test_rslora_scales_by_the_square_root_of_the_rank(adapter_folder, tiny_config, tmp_path):
    folder = _copy(adapter_folder, tmp_path / "rs", {"use_rslora": True})
    plain = read_lora_adapter("plain", adapter_folder, tiny_config)
    rs = read_lora_adapter("rs", folder, tiny_config)
    ratio = rs.weights[(0, "q_proj")][1] / plain.weights[(0, "q_proj")][1]
    torch.testing.assert_close(ratio, torch.full_like(ratio, 8 / math.sqrt(8)))


def test_the_identity_is_the_files_not_the_name(adapter_folder, tiny_config, tmp_path):
    same = read_lora_adapter("other-name", _copy(adapter_folder, tmp_path / "same"), tiny_config)
    assert same.identity == read_lora_adapter("good", adapter_folder, tiny_config).identity
    other = read_lora_adapter("x", _copy(adapter_folder, tmp_path / "alpha", {"lora_alpha": 4}), tiny_config)
    assert other.identity != same.identity


def test_an_adapter_for_another_base_model_is_refused_naming_the_tensor(tmp_path_factory, tiny_config):
    folder = tmp_path_factory.mktemp("wide")
    make_adapter(_tiny(128), folder, AdapterSpec(8, ("q_proj",)))
    with pytest.raises(LoraAdapterError, match=r"'wide'.*layers\.0\.q_proj\.lora_A: shape \(8, 128\).*64 inputs"):
        read_lora_adapter("wide", folder, tiny_config)


def test_a_rank_above_the_limit_is_refused(adapter_folder, tiny_config):
    with pytest.raises(LoraAdapterError, match="'big': r: rank 8 is above max_lora_rank 4"):
        read_lora_adapter("big", adapter_folder, tiny_config, max_rank=4)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"peft_type": "IA3"}, "peft_type"),
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 0}, "r"),
        ({"lora_alpha": "sixteen"}, "lora_alpha"),
    ],
)
def test_settings_it_cannot_serve_are_refused_naming_them(adapter_folder, tiny_config, tmp_path, change, field):
    with pytest.raises(LoraAdapterError, match=f"'bad': {field}: "):
        read_lora_adapter("bad", _copy(adapter_folder, tmp_path / "bad", change), tiny_config)


def test_missing_and_corrupt_files_are_refused_naming_them(adapter_folder, tiny_config, tmp_path):
    with pytest.raises(LoraAdapterError, match="'gone': lora_path: .* is not a folder"):
        read_lora_adapter("gone", tmp_path / "nowhere", tiny_config)
    torn = (adapter_folder / "adapter_model.safetensors").read_bytes()[:100]
    with pytest.raises(LoraAdapterError, match="'torn': adapter_model.safetensors: not a readable safetensors"):
        read_lora_adapter("torn", _copy(adapter_folder, tmp_path / "torn", weights=torn), tiny_config)
    no_config = _copy(adapter_folder, tmp_path / "no-config")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(LoraAdapterError, match="'nc': adapter_config.json: missing"):
        read_lora_adapter("nc", no_config, tiny_config)
    bad_json = _copy(adapter_folder, tmp_path / "bad-json")
    (bad_json / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraAdapterError, match="'bj': adapter_config.json: not valid JSON"):
        read_lora_adapter("bj", bad_json, tiny_config)


def _weights(tensors: dict[str, torch.Tensor]) -> bytes:
    return save(tensors)


def test_tensors_it_cannot_place_are_refused_naming_them(adapter_folder, tiny_config, tmp_path):
    prefix = "base_model.model.model.layers.0"
    cases = {
        "lm_head": ({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}, "not a LoRA A or B weight"),
        "layer": ({"base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64)}, "layer 5"),
        "half": ({f"{prefix}.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64)}, "has no lora_B weight"),
        "nan": ({f"{prefix}.mlp.down_proj.lora_A.weight": torch.full((8, 128), float("nan"))}, "NaN"),
        "both": (
            {
                f"{prefix}.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64),
                f"{prefix}.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8),
                f"{prefix}.self_attn.qkv_proj.lora_A.weight": torch.zeros(8, 64),
                f"{prefix}.self_attn.qkv_proj.lora_B.weight": torch.zeros(128, 8),
            },
            "adapted both fused and as q_proj",
        ),
    }
    for case, (tensors, problem) in cases.items():
        folder = _copy(adapter_folder, tmp_path / case, weights=_weights(tensors))
        with pytest.raises(LoraAdapterError, match=f"'{case}'.*{problem}"):
            read_lora_adapter(case, folder, tiny_config)


def test_a_fused_qkv_target_covers_every_row_of_the_fused_layer(adapter_folder, tiny_config, tmp_path):
    prefix = "base_model.model.model.layers.1.self_attn.qkv_proj"
    q_kv = 64 + 2 * 32
    tensors = {f"{prefix}.lora_A.weight": torch.ones(4, 64), f"{prefix}.lora_B.weight": torch.ones(q_kv, 4)}
    folder = _copy(adapter_folder, tmp_path / "fused", weights=_weights(tensors))
    adapter = read_lora_adapter("fused", folder, tiny_config)
    targets = lora_targets(tiny_config)
    [(row, a, b)] = adapter.parts(1, targets)["self_attn.qkv_proj"]
    assert (row, a.shape, b.shape) == (0, (4, 64), (q_kv, 4))
    assert adapter.parts(0, targets) == {}
