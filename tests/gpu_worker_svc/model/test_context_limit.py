"""The worker's context limit and the model's rotary table come from one place, dummy models included; a
sliding window is the attention's, per layer, and never caps the context."""

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
    ("arch", "extra", "window", "sliding"),
    [
        pytest.param("MistralForCausalLM", {"sliding_window": 4096}, 4096, [True, True], id="mistral-every-layer"),
        pytest.param("MistralForCausalLM", {"sliding_window": None}, None, [], id="no-window"),
        pytest.param("MistralForCausalLM", {"sliding_window": 65536}, None, [], id="window-past-the-context"),
        pytest.param(
            "Qwen2ForCausalLM", {"sliding_window": 4096, "use_sliding_window": False}, None, [], id="qwen2-window-off"
        ),
        pytest.param("Qwen2ForCausalLM", {"sliding_window": 4096}, None, [], id="qwen2-window-off-by-default"),
        pytest.param(
            "Qwen2ForCausalLM",
            {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 1},
            4096,
            [False, True],
            id="qwen2-window-from-max-window-layers",
        ),
        pytest.param(
            "Qwen2ForCausalLM",
            {"sliding_window": 4096, "use_sliding_window": True},
            None,
            [],
            id="qwen2-default-max-window-layers-28-leaves-two-layers-global",
        ),
        pytest.param("Qwen3ForCausalLM", {"sliding_window": 4096}, None, [], id="qwen3-window-off-by-default"),
        pytest.param(
            "Qwen3ForCausalLM",
            {"sliding_window": 4096, "use_sliding_window": True, "layer_types": ["sliding_attention"] * 2},
            4096,
            [True, True],
            id="qwen3-layer-types",
        ),
        pytest.param("Phi3ForCausalLM", {"sliding_window": 2047}, 2047, [True, True], id="phi3-mini-4k"),
        pytest.param("Gemma2ForCausalLM", {"sliding_window": 4096}, 4096, [True, False], id="gemma2-every-other"),
        pytest.param(
            "Gemma3ForCausalLM",
            {"sliding_window": 512, "num_hidden_layers": 6, "sliding_window_pattern": 3},
            512,
            [True, True, False, True, True, False],
            id="gemma3-pattern",
        ),
    ],
)
def test_a_sliding_window_is_enforced_per_layer_and_never_caps_the_context(arch, extra, window, sliding):
    """The paged attention enforces the window, so the context stays the model's whole one."""
    cfg = ModelConfig.from_hf_dict(_hf_config(arch, **extra))
    assert cfg.max_position_embeddings == 32768 == rotary_positions(cfg)
    assert (cfg.sliding_window, cfg.sliding_layers) == (window, sliding)
    per_layer = [window if slides else None for slides in sliding] or [None] * cfg.num_layers
    assert [cfg.window_of(i) for i in range(cfg.num_layers)] == per_layer
