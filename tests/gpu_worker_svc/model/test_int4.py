"""The int4 weight-only mode: the kernel against its own dequantization, and the engine with the real model."""

from __future__ import annotations

import pytest
import torch

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.model.layers.int4 import GROUP_SIZE, Int4Weight, quantize_int4


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


@pytest.mark.slow
def test_int4_engine_tracks_fp32_and_stays_deterministic():
    prompts = [torch.randint(100, 49152, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (9, 30, 61)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engines = {q: LLMEngine(EngineConfig(runner=RunnerConfig(quantization=q, num_blocks=64),
                                         scheduler=SchedulerConfig(max_num_seqs=8)))
               for q in (None, "int4")}
    try:
        logits = {}
        for q, e in engines.items():
            from gpu_worker_svc.model.attention_metadata import StepBatch

            batch = StepBatch(torch.tensor(prompts[1]), torch.tensor([0]), torch.tensor([30]), torch.tensor([[0, 1]]))
            logits[q] = e.runner.execute(batch)[0]
        cos = torch.nn.functional.cosine_similarity(logits[None], logits["int4"], dim=0)
        assert cos > 0.99
        assert logits[None].topk(5).indices[0] in logits["int4"].topk(5).indices
        alone = [engines["int4"].generate([p], greedy)[0].token_ids for p in prompts]
        batched = [r.token_ids for r in engines["int4"].generate(prompts, greedy)]
        assert batched == alone
    finally:
        for e in engines.values():
            e.shutdown()
