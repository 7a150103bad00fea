"""The same model from each checkpoint form the loader reads: sharded safetensors, and GGUF per storage type."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import LlamaConfig, PreTrainedModel

from gpu_worker_svc.engine.model_runner import ModelRunner, RunnerConfig
from gpu_worker_svc.model.loader import load_config
from shardline.core.gguf_file import GGUFFile
from tests.gpu_worker_svc.model.paged_driver import PagedDriver
from tests.gpu_worker_svc.model.random_checkpoints import (
    hf_logits,
    random_hf_model,
    random_prompts,
    write_gguf,
)

TOL = 1e-4
# hidden 64 and intermediate 128: every 2-D weight's rows split into whole 32-value quant blocks.
CONFIG = dict(
    vocab_size=251,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


@pytest.fixture(scope="module")
def hf_model() -> PreTrainedModel:
    return random_hf_model(LlamaConfig(tie_word_embeddings=False, **CONFIG), seed=7)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(CONFIG["vocab_size"], [1, 9, 40], seed=7)


def _runner_logits(model_path: Path, prompts: list[list[int]], tp: int = 1) -> torch.Tensor:
    """Last-token logits of each prompt, all prefilled in one step."""
    runner = ModelRunner(RunnerConfig(model=str(model_path), tp_size=tp, num_blocks=32, quantization="none"))
    try:
        driver = PagedDriver(runner)
        seqs = [driver.add(p) for p in prompts]
        return driver.step({s: len(p) for s, p in zip(seqs, prompts)})
    finally:
        runner.shutdown()


def _assert_matches(ours: torch.Tensor, model: PreTrainedModel, prompts: list[list[int]]) -> None:
    for row, prompt in zip(ours, prompts, strict=True):
        assert (row - hf_logits(model, prompt)[-1]).abs().max().item() <= TOL


def test_sharded_safetensors_with_index(hf_model, prompts, tmp_path):
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(shards) >= 3 and {p.name for p in shards} == set(index["weight_map"].values())
    _assert_matches(_runner_logits(tmp_path, prompts), hf_model, prompts)


def _gguf_reference(
    hf_model: PreTrainedModel, path: Path, qtype: GGMLQuantizationType, extra: dict[str, np.ndarray] | None = None
) -> PreTrainedModel:
    """Writes `hf_model` to `path` as `qtype`; returns the HF model holding exactly the stored weights."""
    reference = copy.deepcopy(hf_model)
    reference.load_state_dict(
        write_gguf(hf_model, path, qtype, extra=extra), strict=not hf_model.config.tie_word_embeddings
    )
    return reference


def _llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for a model with llama3 rope scaling."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_ctx = rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


GGUF_TYPES = [GGMLQuantizationType[t] for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")]


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
def test_gguf_matches_hf_on_the_stored_weights(hf_model, prompts, tmp_path, qtype):
    path = tmp_path / f"tiny-llama.{qtype.name}.gguf"
    reference = _gguf_reference(hf_model, path, qtype)
    stored = GGUFFile(path).tensors
    assert stored["blk.0.attn_q.weight"].qtype == qtype and stored["output_norm.weight"].qtype.name == "F32"
    _assert_matches(_runner_logits(path, prompts), reference, prompts)


def test_gguf_without_output_tensor_ties_embeddings(prompts, tmp_path):
    tied = random_hf_model(LlamaConfig(tie_word_embeddings=True, **CONFIG), seed=8)
    path = tmp_path / "tiny-llama-tied.Q8_0.gguf"
    reference = _gguf_reference(tied, path, GGMLQuantizationType.Q8_0)
    assert "output.weight" not in GGUFFile(path).tensors
    assert load_config(path).tie_word_embeddings
    _assert_matches(_runner_logits(path, prompts), reference, prompts)


@pytest.mark.slow
def test_quantized_gguf_at_tp2(hf_model, prompts, tmp_path):
    """Each rank dequantizes only its rows (Q/K un-permuted per head) or cuts whole rows by column."""
    path = tmp_path / "tiny-llama.Q4_1.gguf"
    reference = _gguf_reference(hf_model, path, GGMLQuantizationType.Q4_1)
    _assert_matches(_runner_logits(path, prompts, tp=2), reference, prompts)


def test_gguf_rope_freqs_carry_llama3_rope_scaling(prompts, tmp_path):
    """Llama 3.1+ GGUF files carry their rope scaling as a `rope_freqs` tensor, with no scaling metadata."""
    # An original context of 32 puts most of head_dim 16's frequencies in the scaled band, so
    # ignoring the tensor would move the logits of these prompts far past TOL.
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    scaled = random_hf_model(LlamaConfig(tie_word_embeddings=False, **(CONFIG | {"rope_parameters": rope})), seed=7)
    path = tmp_path / "tiny-llama3.F32.gguf"
    freqs = _llama3_rope_freqs(rope, CONFIG["hidden_size"] // CONFIG["num_attention_heads"])
    reference = _gguf_reference(scaled, path, GGMLQuantizationType.F32, extra={"rope_freqs.weight": freqs})
    cfg = load_config(path)
    assert cfg.rope_scaling is None and cfg.rope_freq_factors == pytest.approx(freqs.tolist())
    _assert_matches(_runner_logits(path, prompts), reference, prompts)


def test_rope_freqs_of_the_wrong_length_are_refused():
    from gpu_worker_svc.model.layers.rotary import RotaryEmbedding

    with pytest.raises(ValueError, match="rope_freqs has 3 factors; head_dim 16 needs 8"):
        RotaryEmbedding(16, 8, 10000.0, None, torch.float32, [1.0, 2.0, 4.0])
