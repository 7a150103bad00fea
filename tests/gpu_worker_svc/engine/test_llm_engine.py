"""The engine with the real default model: determinism, prefix caching, KV pressure, TP.

These are the properties the cluster's failover relies on: a request's tokens do
not depend on its batch, on preemption, or on being resumed from its own prefix.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.ngram_proposer import SpeculativeConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(
    max_tokens=24,
    temperature=0.9,
    top_p=0.95,
    top_k=50,
    seed=1234,
    ignore_eos=True,
    repetition_penalty=1.1,
    frequency_penalty=0.2,
)


def _engine(
    num_blocks: int | None = None, tp: int = 1, max_num_seqs: int = 32, quantization: str = "auto"
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            runner=RunnerConfig(tp_size=tp, num_blocks=num_blocks, cpu_kv_bytes=64 << 20, quantization=quantization),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512),
        )
    )


@pytest.fixture(scope="module")
def engine():
    e = _engine()
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def tiny_engine():
    """10 blocks of 16 tokens: room for ~3 of the requests below at once, so they preempt."""
    e = _engine(num_blocks=10)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(100, 49152, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (16,), generator=g)
    ]


def _params(base: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(base, seed=seed if base.temperature > 0 else None)


@pytest.fixture(scope="module")
def alone(engine, prompts):
    """Reference: each of the first 4 prompts run by itself, greedy and seeded."""
    return {
        kind: [engine.generate([p], _params(base, i))[0].token_ids for i, p in enumerate(prompts[:4])]
        for kind, base in (("greedy", GREEDY), ("seeded", SEEDED))
    }


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_batched_equals_alone(engine, prompts, alone, kind):
    base = GREEDY if kind == "greedy" else SEEDED
    # 16 mixed requests: the 4 references plus others with different params and lengths.
    params = [
        _params(base, i) if i < 4 else SamplingParams(max_tokens=8 + i, temperature=0.5 * (i % 3), seed=i, min_p=0.05)
        for i in range(16)
    ]
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results[:4]] == alone[kind]
    assert all(len(r.token_ids) == 24 for r in results[:4])


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_preempted_equals_alone(tiny_engine, prompts, alone, kind):
    base = GREEDY if kind == "greedy" else SEEDED
    preempted = 0
    for i, p in enumerate(prompts[:4]):
        tiny_engine.add_request(f"p{kind}{i}", p, _params(base, i))
    outputs: dict[str, list[int]] = {f"p{kind}{i}": [] for i in range(4)}
    while tiny_engine.has_unfinished:
        step = tiny_engine.step()
        preempted += step.stats.num_preempted if step.stats else 0
        for o in step.outputs:
            outputs[o.request_id] += o.new_token_ids
    assert preempted > 0, "the KV budget was meant to force preemption"
    assert [outputs[f"p{kind}{i}"] for i in range(4)] == alone[kind]
    assert tiny_engine.block_pool.num_used_blocks == 0


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("cut", [1, 11])
def test_resumed_from_own_prefix(engine, prompts, alone, kind, cut):
    base = GREEDY if kind == "greedy" else SEEDED
    for i, p in enumerate(prompts[:2]):
        full = alone[kind][i]
        engine.add_request(f"r{kind}{cut}{i}", p, _params(base, i), output_token_ids=full[:cut])
        rest: list[int] = []
        while engine.has_unfinished:
            for o in engine.step().outputs:
                assert o.offset == cut + len(rest)
                rest += o.new_token_ids
        assert full[:cut] + rest == full


def test_prefix_cache_computes_only_new_tokens(engine):
    g = torch.Generator().manual_seed(99)
    shared = torch.randint(100, 49152, (160,), generator=g).tolist()  # 10 full blocks
    first = shared + [101, 102, 103]
    second = shared + [201, 202, 203, 204, 205]
    engine.block_pool.enable_prefix_caching = False  # the reference is computed cold
    try:
        cold = engine.generate([second], GREEDY)[0].token_ids
    finally:
        engine.block_pool.enable_prefix_caching = True
    engine.generate([first], dataclasses.replace(GREEDY, max_tokens=2))
    engine.add_request("second", second, dataclasses.replace(GREEDY))
    computed = cached = num_cached = 0
    tokens: list[int] = []
    while engine.has_unfinished:
        step = engine.step()
        computed += step.stats.num_prefill_tokens if step.stats else 0
        cached += step.stats.prefix_cache_hit_tokens if step.stats else 0
        for o in step.outputs:
            tokens += o.new_token_ids
            num_cached = o.num_cached_tokens
    assert cached == 160 and num_cached == 160
    assert computed == len(second) - 160  # only the 5 new prompt tokens were prefilled
    assert tokens == cold


def test_pressure_every_request_finishes(tiny_engine, engine, prompts):
    params = [SamplingParams(max_tokens=12 + i % 5, temperature=0.0, ignore_eos=True) for i in range(12)]
    expected = engine.generate(prompts[:12], params)
    got = tiny_engine.generate(prompts[:12], params)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert all(r.finish_reason == "length" for r in got)
    assert tiny_engine.block_pool.num_used_blocks == 0


def test_abort_frees_blocks(engine, prompts):
    engine.add_request("to-abort", prompts[5], dataclasses.replace(GREEDY, max_tokens=100))
    for _ in range(3):
        engine.step()
    assert engine.block_pool.num_used_blocks > 0
    assert engine.abort_request("to-abort")
    out = engine.step()
    assert [(o.request_id, o.finish_reason) for o in out.outputs] == [("to-abort", "abort")]
    assert engine.block_pool.num_used_blocks == 0 and not engine.has_unfinished


def test_stop_conditions_and_logprobs(engine, prompts):
    greedy = engine.generate([prompts[0]], GREEDY)[0].token_ids
    stop_at = greedy[5]
    r = engine.generate(
        [prompts[0]], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_at], logprobs=3)
    )[0]
    assert r.finish_reason == "stop" and r.token_ids == greedy[: greedy.index(stop_at) + 1]
    assert len(r.logprobs) == len(r.token_ids)
    assert all(lp.token_id == t and len(lp.top) == 3 and lp.top[0][0] == t for lp, t in zip(r.logprobs, r.token_ids))


def test_tp3_matches_tp1(prompts):
    # In fp32: ranks sum a row-parallel layer's partial products in another order than one rank does,
    # and 8-bit activations (gguf, int8) would turn that last-bit difference into other tokens.
    # Prompt logprobs on half of them: every rank joins the LM head's gather for their rows.
    params = [dataclasses.replace(GREEDY, prompt_logprobs=2 if i % 2 else None) for i in range(4)]
    phrase = prompts[5][:9]
    repeating = [phrase * 4]  # its drafts hit: every rank computes the LM head for them too
    tp1 = _engine(quantization="none")
    try:
        expected = tp1.generate(prompts[:4], params)
        expected_drafted = tp1.generate(repeating, GREEDY)
    finally:
        tp1.shutdown()
    tp3 = _engine(tp=3, quantization="none")
    try:
        got = tp3.generate(prompts[:4], params)
        tp3.config.speculative = SpeculativeConfig(num_speculative_tokens=4)
        drafted = tp3.generate(repeating, GREEDY)
    finally:
        tp3.shutdown()
    assert [r.token_ids for r in drafted] == [r.token_ids for r in expected_drafted]
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    for r, e in zip(got[1::2], expected[1::2]):
        assert [lp.token_id for lp in r.prompt_logprobs] == [lp.token_id for lp in e.prompt_logprobs]
        assert [lp.logprob for lp in r.prompt_logprobs] == pytest.approx(
            [lp.logprob for lp in e.prompt_logprobs], abs=1e-3
        )
    assert got[0].prompt_logprobs is None


def test_logit_bias_steers_the_real_model(engine, prompts):
    # A +100 bias outweighs every logit: greedy decoding then emits that token at every step.
    plain = engine.generate(prompts[:1], dataclasses.replace(GREEDY, max_tokens=4))[0].token_ids
    forced = engine.generate(prompts[:1], dataclasses.replace(GREEDY, max_tokens=4, logit_bias={1234: 100.0}))
    assert forced[0].token_ids == [1234] * 4
    banned = engine.generate(prompts[:1], dataclasses.replace(GREEDY, max_tokens=4, logit_bias={plain[0]: -100.0}))
    assert banned[0].token_ids[0] != plain[0]


def test_its_context_is_what_its_kv_cache_holds_and_a_request_may_fill_it(engine):
    # The worker's edge refuses what is longer (tests/gpu_worker_svc/server/test_request_params.py).
    n = engine.max_model_len  # its 64 MiB KV cache holds 1456 tokens, fewer than the model's 8192
    assert n == 1456
    [full] = engine.generate([[5] * (n - 6)], dataclasses.replace(GREEDY, max_tokens=6))
    assert full.finish_reason == "length" and len(full.token_ids) == 6


def test_requests_sharing_params_get_their_own_seeds(engine, prompts):
    shared = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    first, second = engine.generate([prompts[0], prompts[0]], [shared, shared])
    assert shared.seed is None  # the caller's params are not written into
    assert first.token_ids != second.token_ids
    with pytest.raises(ValueError, match="params"):
        engine.generate(prompts[:2], [shared])  # one SamplingParams short: refused, not a hang


def test_a_models_other_eos_ids_stop_like_stop_tokens(engine, monkeypatch):
    # Llama 3 ends turns with <|eot_id|> besides its EOS: offline requests stop on both.
    monkeypatch.setattr(engine.model_config, "eos_token_ids", [2, 7])
    engine.add_request("two-eos", [5, 6], SamplingParams(max_tokens=4, stop_token_ids=[9]))
    engine.add_request("eos-ignored", [5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    waiting = {seq.request_id: seq for seq in engine.scheduler._waiting}
    assert (waiting["two-eos"].eos_token_id, waiting["two-eos"].params.stop_token_ids) == (2, [9, 7])
    assert waiting["eos-ignored"].params.stop_token_ids == []
    for request_id in waiting:
        engine.abort_request(request_id, report=False)


def test_the_model_runs_without_torch_function_checks(engine, prompts):
    """fbgemm's packed weights make each op's __torch_function__ check throw a C++ exception (~15 us a
    GEMM); the runner's step turns the checks off."""
    seen: list[bool] = []
    model = engine.runner._shard.model
    hooks = [
        module.register_forward_pre_hook(lambda m, a: seen.append(torch._C._is_torch_function_enabled()))
        for module in (model.model.layers[0].self_attn.qkv_proj, model.model.layers[-1].mlp)
    ]
    fused, model.model.fused_decode = model.model.fused_decode, None  # every step through the modules
    try:
        engine.generate([prompts[0]], dataclasses.replace(GREEDY, max_tokens=3))
    finally:
        model.model.fused_decode = fused
        for hook in hooks:
            hook.remove()
    assert len(seen) == 6 and not any(seen)
    assert torch._C._is_torch_function_enabled()  # and only inside the step
