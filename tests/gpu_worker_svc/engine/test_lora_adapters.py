"""The engine's adapters on a tiny random Llama: peft's merged-weight output in mixed batches, the
least recently used adapter giving its slot up, and a higher rank growing every slot."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from tests.gpu_worker_svc.model.random_checkpoints import random_hf_model, random_prompts
from tests.gpu_worker_svc.peft_adapters import ATTENTION, MLP, AdapterSpec, greedy, make_adapter

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SPECS = {
    "a": AdapterSpec(4, tuple(ATTENTION), alpha=64.0, seed=1),
    "b": AdapterSpec(8, tuple(MLP), alpha=128.0, seed=2),
    "c": AdapterSpec(16, tuple(ATTENTION + MLP), alpha=64.0, use_rslora=True, seed=3),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model's folder, its adapters' folders and peft's greedy output per adapter and prompt."""
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = random_hf_model(config, seed=11)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    prompts = random_prompts(96, [3, 17, 30], seed=4)
    folders, expected = {}, {None: [greedy(model, p, 10) for p in prompts]}
    for name, spec in SPECS.items():
        folders[name] = tmp_path_factory.mktemp(f"adapter-{name}")
        merged = make_adapter(model, folders[name], spec)
        expected[name] = [greedy(merged, p, 10) for p in prompts]
    return folder, folders, prompts, expected


def _engine(folder, max_loras_per_batch: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            runner=RunnerConfig(model=str(folder), num_blocks=64, quantization="none"),
            scheduler=SchedulerConfig(
                max_num_seqs=16, max_num_batched_tokens=256, max_loras_per_batch=max_loras_per_batch
            ),
        )
    )


@pytest.fixture(scope="module")
def engine(tiny):
    folder, folders, _, _ = tiny
    e = _engine(folder, max_loras_per_batch=3)
    for name, path in folders.items():
        e.add_lora(name, path)
    yield e
    e.shutdown()


def test_the_adapters_change_the_output(tiny):
    expected = tiny[3]
    assert all(expected[name] != expected[None] for name in SPECS)


def test_a_mixed_batch_equals_peft_merged_models(engine, tiny):
    _, _, prompts, expected = tiny
    names = [None, *SPECS]
    batch = [(name, i) for i in range(len(prompts)) for name in names]
    results = engine.generate([prompts[i] for _, i in batch], GREEDY, adapters=[name for name, _ in batch])
    assert [r.token_ids for r in results] == [expected[name][i] for name, i in batch]


def test_the_least_recently_used_adapter_gives_its_slot_up(tiny):
    folder, folders, prompts, expected = tiny
    engine = _engine(folder, max_loras_per_batch=2)
    try:
        for name in ("a", "b", "c"):  # "c" has the highest rank: its arrival grows every slot
            engine.add_lora(name, folders[name])
        assert engine.generate([prompts[0]], GREEDY, adapters=["a"])[0].token_ids == expected["a"][0]
        assert engine.generate([prompts[0]], GREEDY, adapters=["b"])[0].token_ids == expected["b"][0]
        assert engine.loras.resident == ["a", "b"]
        assert engine.generate([prompts[1]], GREEDY, adapters=["c"])[0].token_ids == expected["c"][1]
        assert engine.loras.resident == ["b", "c"]
        # Three adapters for two slots: "a" waits for a slot, and every output is still peft's.
        names = ["a", "b", "c", None] * 2
        results = engine.generate([prompts[2]] * len(names), GREEDY, adapters=names)
        assert [r.token_ids for r in results] == [expected[name][2] for name in names]
    finally:
        engine.shutdown()
