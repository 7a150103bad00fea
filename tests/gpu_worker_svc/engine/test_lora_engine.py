"""LoRA adapters on the real default model: each adapter's greedy output equals peft's merged-weight
model, alone and inside one mixed batch with other adapters and the base model; bad adapters are
refused and the engine serves on; adapters never share prefix-cache blocks."""

from __future__ import annotations

import json

import pytest
import torch

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.lora_adapters import UnknownAdapterError
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.model.lora_adapter import LoraAdapterError, LoraAdapterInUse
from shardline.core.prefix_hash import chain_root
from tests.gpu_worker_svc.peft_adapters import ATTENTION, MLP, AdapterSpec, greedy, make_adapter

pytestmark = pytest.mark.slow

NEW_TOKENS = 10
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
SPECS = {
    "attn-r8": AdapterSpec(8, tuple(ATTENTION), seed=1),
    "mlp-r16": AdapterSpec(16, tuple(MLP), seed=2),
    "all-r16-rslora": AdapterSpec(16, tuple(ATTENTION + MLP), alpha=8.0, use_rslora=True, seed=3),
    "all-r8": AdapterSpec(8, tuple(ATTENTION + MLP), alpha=32.0, seed=4),
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(40)
    return [torch.randint(100, 49152, (n,), generator=g).tolist() for n in (5, 23)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_default_model, prompts):
    """name -> (folder, peft's merged model's greedy output per prompt), and the base model's under None."""
    made: dict[str | None, tuple[object, list[list[int]]]] = {
        None: (None, [greedy(hf_default_model, p, NEW_TOKENS) for p in prompts])
    }
    for name, spec in SPECS.items():
        folder = tmp_path_factory.mktemp(name)
        merged = make_adapter(hf_default_model, folder, spec)
        made[name] = (folder, [greedy(merged, p, NEW_TOKENS) for p in prompts])
        del merged
    return made


def _engine(quantization: str, max_loras_per_batch: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            runner=RunnerConfig(cpu_kv_bytes=64 << 20, quantization=quantization),
            scheduler=SchedulerConfig(
                max_num_seqs=32, max_num_batched_tokens=512, max_loras_per_batch=max_loras_per_batch
            ),
        )
    )


@pytest.fixture(scope="module")
def fp32_engine(adapters):
    """The HF parity mode (the GGUF file dequantized to float32), with a slot for every adapter."""
    engine = _engine("none", max_loras_per_batch=4)
    for name, (folder, _) in adapters.items():
        if name is not None:
            engine.add_lora(name, folder)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def gguf_engine(adapters):
    """The default serving mode (the file's Q4_1 blocks), with fewer slots than adapters."""
    engine = _engine("auto", max_loras_per_batch=2)
    for name, (folder, _) in adapters.items():
        if name is not None:
            engine.add_lora(name, folder)
    yield engine
    engine.shutdown()


def test_every_adapter_changes_the_output(adapters):
    base = adapters[None][1]
    for name in SPECS:
        assert adapters[name][1] != base, name


def test_each_adapter_alone_equals_peft_merged_model(fp32_engine, adapters, prompts):
    for name, (_, reference) in adapters.items():
        for prompt, expected in zip(prompts, reference):
            assert fp32_engine.generate([prompt], GREEDY, adapters=[name])[0].token_ids == expected, name


def test_a_mixed_batch_of_four_adapters_and_the_base_equals_peft(fp32_engine, adapters, prompts):
    names = list(adapters)
    batch = [(name, i) for i in range(len(prompts)) for name in names]
    # Every request is admitted in the first step, so steps run all five models together.
    results = fp32_engine.generate([prompts[i] for _, i in batch], GREEDY, adapters=[name for name, _ in batch])
    for (name, i), result in zip(batch, results):
        assert result.token_ids == adapters[name][1][i], (name, i)


def test_with_gguf_weights_and_fewer_slots_than_adapters_every_request_runs_with_its_adapter(
    gguf_engine, adapters, prompts
):
    # Not bitwise: the adapters' fp32 GEMMs round with the batch and the slots' padding, and GGUF's
    # int8 rounding of activations amplifies that (docs/lora.md), so each adapter's effect is checked.
    names = list(adapters)
    scoring = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    text = prompts[1] + adapters["all-r8"][1][1]
    results = gguf_engine.generate([text] * 2 * len(names), scoring, adapters=names * 2)
    got = {name: torch.tensor([lp.logprob for lp in r.prompt_logprobs]) for name, r in zip(names, results)}
    for name in SPECS:
        assert (got[name] - got[None]).abs().max() > 0.1, name
    assert len(gguf_engine.loras.resident) == 2
    mixed = gguf_engine.generate([prompts[0]] * len(names), GREEDY, adapters=names)
    assert all(len(r.token_ids) == NEW_TOKENS for r in mixed)


def test_adapters_never_share_prefix_blocks(gguf_engine, adapters):
    prompt = list(range(1000, 1040))  # two full blocks and a part
    pool = gguf_engine.block_pool
    gguf_engine.generate([prompt], GREEDY, adapters=["attn-r8"])
    root = gguf_engine.loras.root_of("attn-r8")
    assert len(pool.get_cached_prefix(prompt, root)) == 2
    assert pool.get_cached_prefix(prompt) == []
    assert pool.get_cached_prefix(prompt, gguf_engine.loras.root_of("mlp-r16")) == []
    # The root is the adapter's content, not its name: the same files on any worker chain alike.
    assert root == chain_root(gguf_engine.loras.get("attn-r8").identity)


def test_an_unknown_adapter_is_refused_naming_it(gguf_engine, prompts):
    with pytest.raises(UnknownAdapterError, match="'nope'"):
        gguf_engine.add_request("unknown-1", prompts[0], GREEDY, adapter="nope")


def test_a_refused_adapter_leaves_the_engine_serving(gguf_engine, adapters, prompts, tmp_path):
    source = adapters["attn-r8"][0]
    config = json.loads((source / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "r": 128}))
    (tmp_path / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
    with pytest.raises(LoraAdapterError, match="'too-big'.*r: rank 128 is above max_lora_rank 64"):
        gguf_engine.add_lora("too-big", tmp_path)
    assert gguf_engine.loras.get("too-big") is None
    before = gguf_engine.generate([prompts[0]], GREEDY, adapters=["mlp-r16"])[0].token_ids
    assert gguf_engine.generate([prompts[0]], GREEDY, adapters=["mlp-r16"])[0].token_ids == before


def test_an_adapter_in_use_cannot_be_unloaded_until_its_requests_end(gguf_engine, adapters, prompts):
    folder = adapters["all-r8"][0]
    gguf_engine.add_lora("extra", folder)
    gguf_engine.add_request("uses-extra", prompts[0], GREEDY, adapter="extra")
    with pytest.raises(LoraAdapterInUse, match="in use by 1 request"):
        gguf_engine.remove_lora("extra")
    while gguf_engine.has_unfinished:
        gguf_engine.step()
    assert gguf_engine.remove_lora("extra")
    assert "extra" not in gguf_engine.loras.names
