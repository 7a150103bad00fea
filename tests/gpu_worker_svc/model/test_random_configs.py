"""Small random Llama-family models, saved by transformers and loaded from disk, against HF's forward.

The cases cover the layouts that tensor parallelism splits differently: GQA with fewer
KV heads than ranks (replicated KV heads), MHA, q/k/v biases (Qwen2) and a bias on
o_proj too (Llama attention_bias), tied and untied embeddings, a head_dim that is not
hidden/heads, llama3 rope scaling with prompts past original_max_position_embeddings,
and vocab sizes that do not split evenly across ranks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

from gpu_worker_svc.engine.model_runner import ModelRunner, RunnerConfig
from gpu_worker_svc.model.loader import load_config
from tests.gpu_worker_svc.model.paged_driver import PagedDriver
from tests.gpu_worker_svc.model.random_checkpoints import hf_logits, random_hf_model, random_prompts

TOL = 1e-4
# Longer than the llama3 case's original_max_position_embeddings (32), so the prompts use
# positions where the scaled low frequencies matter.
PROMPT_LENGTHS = [1, 9, 40, 80]
DECODE_STEPS = 4
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES: dict[str, PretrainedConfig] = {
    "llama-gqa4x2-llama3rope-vocab251": LlamaConfig(
        vocab_size=251,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters=LLAMA3_ROPE,
        tie_word_embeddings=False,
        **_SHAPE,
    ),
    "llama-mha8-tied-bias": LlamaConfig(
        vocab_size=256,
        num_attention_heads=8,
        num_key_value_heads=8,
        attention_bias=True,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        **_SHAPE,
    ),
    "qwen2-gqa4x2-qkvbias-vocab250": Qwen2Config(
        vocab_size=250, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **_SHAPE
    ),
    "mistral-gqa8x2-headdim32-tied": MistralConfig(
        vocab_size=257,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=None,
        tie_word_embeddings=True,
        **_SHAPE,
    ),
}


@dataclass(slots=True)
class SavedModel:
    folder: Path
    prompts: list[list[int]]
    logits: list[torch.Tensor]  # HF's logits at every position of each prompt, [len, vocab]


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SavedModel]:
    """Every case built and saved once: runners for all TP sizes share them."""
    saved = {}
    for seed, (name, config) in enumerate(CASES.items()):
        model = random_hf_model(config, seed=seed)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        prompts = random_prompts(config.vocab_size, PROMPT_LENGTHS, seed=seed)
        saved[name] = SavedModel(folder, prompts, [hf_logits(model, p) for p in prompts])
    return saved


# Every case runs at TP 1 and 2 (each rank its own heads and an uneven vocab slice). A TP 4
# runner spawns 3 processes that import torch (~8 s here), so TP 4 runs only the cases it
# splits in a new way: fewer KV heads than ranks, so ranks share (replicate) KV heads and,
# for Qwen2, their biases.
TP_CASES = {
    1: list(CASES),
    2: list(CASES),
    4: ["llama-gqa4x2-llama3rope-vocab251", "qwen2-gqa4x2-qkvbias-vocab250"],
}


def _tp_param(tp: int, case: str) -> object:
    marks = [pytest.mark.slow] if tp > 1 else []
    return pytest.param((case, tp), id=f"{case}-tp{tp}", marks=marks)


@pytest.fixture(scope="module", params=[_tp_param(tp, case) for tp, cases in TP_CASES.items() for case in cases])
def loaded(request, saved_models) -> Iterator[tuple[ModelRunner, SavedModel]]:
    case, tp = request.param
    threads = torch.get_num_threads()
    runner = ModelRunner(RunnerConfig(model=str(saved_models[case].folder), tp_size=tp, num_blocks=64))
    # Rank 0 runs in this process and, at TP 1, sets torch to use every core; on a shared
    # 2-core machine the second thread is often descheduled and each tiny matmul waits for it
    # (~50x slower). One thread changes nothing but speed.
    torch.set_num_threads(1)
    yield runner, saved_models[case]
    runner.shutdown()
    torch.set_num_threads(threads)


def test_saved_config_has_what_the_case_exercises(saved_models):
    """Guards the test itself: transformers must write the fields the cases rely on."""
    gqa = load_config(saved_models["llama-gqa4x2-llama3rope-vocab251"].folder)
    assert gqa.rope_scaling is not None and gqa.rope_scaling["rope_type"] == "llama3"
    assert (gqa.num_heads, gqa.num_kv_heads, gqa.tie_word_embeddings) == (4, 2, False)
    mha = load_config(saved_models["llama-mha8-tied-bias"].folder)
    assert (mha.num_heads, mha.num_kv_heads, mha.tie_word_embeddings, mha.attention_bias) == (8, 8, True, True)
    assert mha.rope_theta == 500000.0
    assert load_config(saved_models["qwen2-gqa4x2-qkvbias-vocab250"].folder).attention_bias
    mistral = load_config(saved_models["mistral-gqa8x2-headdim32-tied"].folder)
    assert mistral.head_dim * mistral.num_heads != mistral.hidden_size


def test_prefill_logits_match_hf(loaded):
    runner, saved = loaded
    driver = PagedDriver(runner)
    seqs = [driver.add(p) for p in saved.prompts]
    ours = driver.step({s: len(p) for s, p in zip(seqs, saved.prompts)})
    for row, ref in zip(ours, saved.logits, strict=True):
        assert (row - ref[-1]).abs().max().item() <= TOL


def test_decode_logits_match_hf(loaded):
    """Prefill all but the last tokens, then feed those one per step to every sequence at once."""
    runner, saved = loaded
    prompts = [p for p in saved.prompts if len(p) > DECODE_STEPS]
    refs = [ref for p, ref in zip(saved.prompts, saved.logits) if len(p) > DECODE_STEPS]
    driver = PagedDriver(runner)
    seqs = [driver.add(p) for p in prompts]
    ours = driver.step({s: len(p) - DECODE_STEPS for s, p in zip(seqs, prompts)})
    for k in range(DECODE_STEPS, 0, -1):
        for row, ref in zip(ours, refs):
            assert (row - ref[-k - 1]).abs().max().item() <= TOL
        ours = driver.step({s: 1 for s in seqs})
    for row, ref in zip(ours, refs):
        assert (row - ref[-1]).abs().max().item() <= TOL


def test_transformers4_rope_scaling_layout_loads_the_same(saved_models, tmp_path):
    """Configs written before transformers 5 keep rope_theta flat and the scaling in rope_scaling."""
    saved = saved_models["llama-gqa4x2-llama3rope-vocab251"]
    folder = tmp_path / "old-layout"
    folder.mkdir()
    for f in saved.folder.iterdir():
        (folder / f.name).symlink_to(f)
    cfg = json.loads((saved.folder / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(cfg))

    runner = ModelRunner(RunnerConfig(model=str(folder), num_blocks=16))
    try:
        driver = PagedDriver(runner)
        ours = driver.step({driver.add(saved.prompts[-1]): len(saved.prompts[-1])})
    finally:
        runner.shutdown()
    assert (ours[0] - saved.logits[-1][-1]).abs().max().item() <= TOL
