"""The CPU weight formats (int8, fp16, int4, and fp32 packed for oneDNN): each kernel against its own
reference weight, batch invariance, smoothing, and the engine with the real model in each mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.model.attention_metadata import StepBatch
from gpu_worker_svc.model.layers.fp16 import FP16Weight
from gpu_worker_svc.model.layers.int4 import GROUP_SIZE, Int4Weight, quantize_int4
from gpu_worker_svc.model.layers.int8 import ONEDNN_MIN_ROWS, Int8Weight, onednn_int8_agrees, quantize_int8
from gpu_worker_svc.model.layers.onednn import OneDNNWeight
from gpu_worker_svc.model.layers.smoothing import SmoothingGroup, smooth


def _dequantize(packed_codes: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    n, k = packed_codes.shape
    sz = scales_zeros.float().transpose(0, 1)  # [N, K/G, 2]
    groups = packed_codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
    return ((groups - 8) * sz[..., :1] + sz[..., 1:]).view(n, k)


@pytest.mark.parametrize("shape", [(960, 576), (576, 192), (49152, 576)])
def test_int4_matmul_equals_its_dequantized_weight(shape):
    torch.manual_seed(0)
    w = torch.randn(shape)
    layer = Int4Weight(w)
    # Recover the codes the same way quantize_int4 made them, to build the exact reference weight.
    n, k = shape
    groups = w.view(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = groups.amin(-1), groups.amax(-1)
    codes = ((groups - lo[..., None]) / ((hi - lo) / 15).clamp(min=1e-10)[..., None]).round().clamp(0, 15)
    reference_w = _dequantize(codes.view(n, k), layer.scales_zeros)
    x = torch.randn(7, k)
    y = layer.matmul(x)
    ref = x.to(torch.bfloat16).float() @ reference_w.T
    assert y.dtype == torch.float32 and y.shape == (7, n)
    assert (y - ref).abs().max() <= 0.01 * ref.abs().max()  # bf16 output rounding only
    assert (reference_w - w).abs().max() <= 0.6 * ((hi - lo) / 15).max()  # within half a step (+ bf16)


def test_int4_rows_are_batch_invariant():
    torch.manual_seed(1)
    layer = Int4Weight(torch.randn(3072, 576))
    x = torch.randn(16, 576)
    assert torch.equal(layer.matmul(x), torch.cat([layer.matmul(x[i : i + 1]) for i in range(16)]))


def test_int4_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(8, 40))


def test_int8_matmul_equals_its_quantized_operands():
    torch.manual_seed(2)
    w, x = torch.randn(960, 576), torch.randn(7, 576)
    y = Int8Weight(w).matmul(x)
    codes, scale = quantize_int8(w)
    assert codes.abs().max() <= 63  # 7-bit weights: u8 x s8 pairs never saturate int16
    absmax = x.abs().amax(-1, keepdim=True)
    x_codes = (x / absmax * 127).round()  # 8-bit activations, per row
    ref = (x_codes @ codes.float().T) * (absmax / 127) * scale
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max())
    assert (y - x @ w.T).norm() / (x @ w.T).norm() < 0.03


def test_int8_rows_are_bitwise_batch_invariant():
    torch.manual_seed(3)
    layer = Int8Weight(torch.randn(3072, 576))
    x = torch.randn(37, 576) * torch.linspace(0.1, 50, 37)[:, None]  # rows of very different scales
    full = layer.matmul(x)
    assert torch.equal(full, torch.cat([layer.matmul(x[i : i + 1]) for i in range(37)]))
    assert torch.equal(full[5:9], layer.matmul(x[5:9]))


def test_fp16_matmul_rounds_only_the_weights():
    torch.manual_seed(4)
    w, x = torch.randn(576, 1536), torch.randn(5, 1536)
    ref = x @ w.half().float().T
    assert torch.allclose(FP16Weight(w).matmul(x), ref, rtol=1e-4, atol=1e-4)


def test_smoothing_is_exact_before_quantization():
    """Dividing the producer by s and multiplying s into the weight leaves the product unchanged."""
    torch.manual_seed(5)
    gamma, w = torch.rand(64) + 0.5, torch.randn(32, 64)
    x = torch.randn(10, 64)
    x[:, 3] *= 40  # an outlier channel

    class Consumer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.quant = torch.nn.Parameter(w.clone(), requires_grad=False), None

    consumer, norm_weight = Consumer(), gamma.clone()
    forward = lambda: consumer.quant.matmul(x * norm_weight)  # noqa: E731 - the calibration pass
    scales = smooth([SmoothingGroup(consumer, lambda s: norm_weight.div_(s))], forward)
    s = scales[consumer]
    assert s[3] > 3 * s.median()  # the outlier channel is scaled down the most
    assert torch.allclose((x * norm_weight) @ (w * s).T, (x * gamma) @ w.T, rtol=1e-5, atol=1e-4)
    assert consumer.quant is None and torch.equal(consumer.weight, w)  # the caller quantizes w * s


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "fp16", "int4"])
def test_quantized_engine_tracks_fp32_and_stays_deterministic(mode):
    prompts = [
        torch.randint(100, 49152, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 30, 61)
    ]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engines = {
        q: LLMEngine(
            EngineConfig(runner=RunnerConfig(quantization=q, num_blocks=64), scheduler=SchedulerConfig(max_num_seqs=8))
        )
        for q in (None, mode)
    }
    try:
        logits = {}
        for q, e in engines.items():
            batch = StepBatch(torch.tensor(prompts[1]), torch.tensor([0]), torch.tensor([30]), torch.tensor([[0, 1]]))
            logits[q] = e.runner.execute(batch)[0]
        cos = torch.nn.functional.cosine_similarity(logits[None], logits[mode], dim=0)
        assert cos > {"fp16": 0.99999, "int8": 0.99, "int4": 0.99}[mode]
        assert logits[None].topk(5).indices[0] in logits[mode].topk(5).indices
        alone = [engines[mode].generate([p], greedy)[0].token_ids for p in prompts]
        batched = [r.token_ids for r in engines[mode].generate(prompts, greedy)]
        assert batched == alone
    finally:
        for e in engines.values():
            e.shutdown()


def test_unknown_quantization_is_refused():
    from gpu_worker_svc.model.layers.quantize import quantize_model

    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(torch.nn.Linear(2, 2), "nf4")


@pytest.mark.parametrize("rows", [1, 3, 16, 300])
def test_onednn_packed_matmul_equals_the_fp32_linear(rows):
    w, x = torch.randn(96, 80), torch.randn(rows, 80)
    torch.testing.assert_close(
        OneDNNWeight(w).matmul(x.view(rows, 1, 80)), F.linear(x, w).view(rows, 1, 96), rtol=1e-5, atol=1e-5
    )


@pytest.mark.slow
def test_float32_engine_packs_for_onednn_by_default_with_unchanged_tokens():
    prompts = [
        torch.randint(100, 49152, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 30, 61)
    ]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for packed in (True, False):
        engine = LLMEngine(EngineConfig(runner=RunnerConfig(onednn_weights=packed, num_blocks=64, quantization="none")))
        try:
            head = engine.runner._shard.model.lm_head
            assert isinstance(head.quant, OneDNNWeight) if packed else head.quant is None
            tokens[packed] = [r.token_ids for r in engine.generate(prompts, greedy)]
        finally:
            engine.shutdown()
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536)])
def test_int8_onednn_and_fbgemm_kernels_agree_bitwise(shape):
    """Large batches take oneDNN's kernel, small ones fbgemm's: a row's result must not change with it."""
    torch.manual_seed(5)
    layer = Int8Weight(torch.randn(*shape) * 0.05)
    # oneDNN takes large batches only where this process found it equal to fbgemm (AVX2: yes;
    # AVX-512 VNNI: no, and fbgemm takes them).
    assert (layer.onednn is not None) == onednn_int8_agrees()
    rows = ONEDNN_MIN_ROWS + 3
    x = torch.randn(rows, shape[1]) * torch.logspace(-2, 2, rows)[:, None]
    big = layer.matmul(x)  # oneDNN
    small = torch.cat([layer.matmul(x[i : i + 64]) for i in range(0, rows, 64)])  # fbgemm
    assert torch.equal(big, small)


@pytest.mark.parametrize("tied", [True, False])
def test_packing_drops_every_original_weight_but_the_embedding(tied):
    from gpu_worker_svc.model.config import ModelConfig
    from gpu_worker_svc.model.families.llama import LlamaForCausalLM
    from gpu_worker_svc.model.layers.quantize import pack_fp32_for_onednn
    from gpu_worker_svc.model.parallel import TPGroup

    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(cfg, TPGroup(), torch.float32, 16)
    assert pack_fp32_for_onednn(model) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    embedding = model.model.embed_tokens.weight
    assert embedding is not None  # lookups still need it
    assert (model.lm_head.weight is embedding) if tied else model.lm_head.weight is None
    assert model.model.layers[0].mlp.down_proj.weight is None


def test_the_worker_settings_name_every_quantization():
    """The settings check formats by name before torch loads; the names must stay those quantize_model makes."""
    from gpu_worker_svc.model.cpu_weight_formats import CPU_WEIGHT_FORMATS
    from gpu_worker_svc.model.layers.quantize import QUANTIZATIONS

    assert CPU_WEIGHT_FORMATS == ["auto", "none", *sorted([*QUANTIZATIONS, "gguf"])]
