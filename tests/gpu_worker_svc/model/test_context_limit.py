"""The worker's context limit and the model's rotary table come from one place, dummy models included."""

from __future__ import annotations

import pytest

from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.dummy import dummy_config
from gpu_worker_svc.model.loader import MAX_ROTARY_POSITIONS, load_model, rotary_positions
from gpu_worker_svc.model.parallel import TPGroup


def test_a_dummy_models_rotary_table_covers_the_context_the_worker_admits():
    cfg = dummy_config("dummy:smollm2-135m")
    model = load_model("dummy:smollm2-135m", TPGroup())
    # The worker refuses requests past rotary_positions(cfg); a shorter table would crash a step instead.
    assert model.model.rotary.cos.shape[0] == rotary_positions(cfg) == cfg.max_position_embeddings
    assert rotary_positions(cfg, 512) == 512
    assert rotary_positions(dummy_config("dummy:llama-3.2-1b")) == MAX_ROTARY_POSITIONS


def _hf_config(arch: str, **extra) -> dict:
    return {
        "architectures": [arch],
        "vocab_size": 32000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 32768,
        **extra,
    }


@pytest.mark.parametrize(
    ("arch", "extra", "context"),
    [
        pytest.param("MistralForCausalLM", {"sliding_window": 4096}, 4096, id="mistral-v0.1-window-caps-the-context"),
        pytest.param("MistralForCausalLM", {"sliding_window": None}, 32768, id="no-window"),
        pytest.param("MistralForCausalLM", {"sliding_window": 65536}, 32768, id="window-past-the-context"),
        pytest.param(
            "Qwen2ForCausalLM", {"sliding_window": 4096, "use_sliding_window": False}, 32768, id="qwen2-window-off"
        ),
        pytest.param("Qwen2ForCausalLM", {"sliding_window": 4096}, 32768, id="qwen2-window-off-by-default"),
        pytest.param(
            "Qwen2ForCausalLM", {"sliding_window": 4096, "use_sliding_window": True}, 4096, id="qwen2-window-on"
        ),
        pytest.param("Qwen3ForCausalLM", {"sliding_window": 4096}, 32768, id="qwen3-window-off-by-default"),
        pytest.param(
            "Qwen3ForCausalLM", {"sliding_window": 4096, "use_sliding_window": True}, 4096, id="qwen3-window-on"
        ),
        pytest.param("Phi3ForCausalLM", {"sliding_window": 2047}, 2047, id="phi3-mini-4k-window-caps-the-context"),
    ],
)
def test_the_context_stops_at_a_sliding_window(arch, extra, context):
    """Full causal attention equals sliding-window attention only within the window."""
    cfg = ModelConfig.from_hf_dict(_hf_config(arch, **extra))
    assert cfg.max_position_embeddings == context == rotary_positions(cfg)
