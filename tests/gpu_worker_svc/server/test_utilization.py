import dataclasses

import pytest

from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.server.utilization import H200, DevicePeak, StepCostModel, device_peak

# Small enough to count by hand: h=8, 2 heads of 4 (q width 8), 1 KV head (kv width 4), tied embeddings.
TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=100,
    hidden_size=8,
    intermediate_size=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    tie_word_embeddings=True,
)


def test_costs_count_layers_per_token_head_per_row_and_attention_per_pair():
    cost = StepCostModel.for_model(TINY, dtype_bytes=2, device_peak=DevicePeak(1e6, 1e5), tp_size=2)
    # Per layer: qkv 8*(8+4+4) + o 8*8 + mlp 3*8*16 + 2 norms of 8 = 592; plus the final norm.
    assert cost.layer_params == 2 * 592 + 8
    assert cost.head_params == 100 * 8
    assert cost.weight_bytes == (2 * 592 + 8 + 800) * 2
    assert cost.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2  # K and V, layers, KV heads, head_dim, bytes
    assert cost.peak == DevicePeak(2e6, 2e5)  # two ranks
    # 10 tokens in 2 sequences, 30 causal pairs, 50 KV positions read.
    flops = 2 * (1192 * 10 + 800 * 2) + 4 * 2 * 2 * 4 * 30
    assert cost.flops(10, 2, 30) == flops
    assert cost.bytes(50) == 3984 + 32 * 50
    mfu, mbu = cost.utilization(10, 2, 30, 50, step_time_s=0.5)
    assert mfu == pytest.approx(flops / 0.5 / 2e6)
    assert mbu == pytest.approx((3984 + 1600) / 0.5 / 2e5)


def test_an_untied_head_adds_weight_bytes_but_no_per_token_flops():
    untied = StepCostModel.for_model(dataclasses.replace(TINY, tie_word_embeddings=False), 2, H200, 1)
    assert untied.layer_params == 2 * 592 + 8
    assert untied.weight_bytes == (2 * 592 + 8 + 2 * 800) * 2


def test_a_moe_token_costs_its_top_k_experts_while_a_step_reads_every_expert():
    moe = dataclasses.replace(
        TINY, architecture="MixtralForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
    )
    cost = StepCostModel.for_model(moe, 2, H200, 1)
    # Per layer: attention 192 and 2 norms of 8, the router 4*8, and each expert 3*8*16 = 384.
    assert cost.layer_params == 2 * (192 + 16 + 32 + 2 * 384) + 8
    assert cost.weight_bytes == (2 * (192 + 16 + 32 + 4 * 384) + 8 + 800) * 2


def test_decode_of_the_default_model_on_h200_is_bandwidth_bound():
    smollm = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
    )
    cost = StepCostModel.for_model(smollm, 2, H200, 1)
    # 32 sequences decoding one token each at 512 tokens of context, in 2 ms.
    mfu, mbu = cost.utilization(32, 32, 32 * 512, 32 * 512, 0.002)
    assert 0 < mfu < mbu < 1


def test_empty_or_unmeasured_steps_report_zero():
    cost = StepCostModel.for_model(TINY, 4, H200, 1)
    assert cost.utilization(0, 0, 0, 0, 0.01) == (0.0, 0.0)
    assert cost.utilization(5, 1, 15, 5, 0.0) == (0.0, 0.0)


def test_device_peak_defaults_and_overrides():
    assert device_peak("cuda", None, None, 0.5, 20.0) == H200
    assert device_peak("cpu", None, None, 0.5, 20.0) == DevicePeak(0.5e12, 20e9)
    assert device_peak("cuda", 312.0, 2039.0, 0.5, 20.0) == DevicePeak(312e12, 2039e9)
