"""The families beyond Llama's (Qwen3, Phi-3, and the Mixture-of-Experts Mixtral, Qwen3-MoE and Qwen2-MoE):
small random models built by transformers, saved as safetensors and loaded through the real load path,
against HF's own forward pass.

Each case is checked at TP 1 and TP 2 (the GQA ones at TP 4 too; a MoE case's experts split between the
ranks at TP 2, tests/gpu_worker_svc/model/test_moe.py has the MoE layer's own): greedy decoding of a batch of
prompts for 32 steps gives HF's tokens, with every step's logits within TOL of HF's; a prefill split
into chunks gives the same logits. Then Phi-3's LongRoPE, a Qwen3 GGUF file, and a sharded Phi-3
checkpoint. tests/gpu_worker_svc/engine/test_model_families_engine.py runs the cases through the
engine (continuous batching, chunked prefill, the prefix cache).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, Phi3Config

from gpu_worker_svc.engine.model_runner import ModelRunner, RunnerConfig
from gpu_worker_svc.model.families import MODEL_CLASSES
from gpu_worker_svc.model.families.llama import LlamaForCausalLM
from gpu_worker_svc.model.families.phi3 import Phi3ForCausalLM
from gpu_worker_svc.model.families.qwen3 import Qwen3ForCausalLM
from gpu_worker_svc.model.fused_decode import FusedDecode
from gpu_worker_svc.model.layers.kernels import cpu_kernels
from gpu_worker_svc.model.loader import load_config, load_model
from gpu_worker_svc.model.parallel import TPGroup
from tests.gpu_worker_svc.model.family_cases import CASES, GREEDY_STEPS, TOL, SavedModel, save_cases
from tests.gpu_worker_svc.model.paged_driver import PagedDriver
from tests.gpu_worker_svc.model.random_checkpoints import random_hf_model, random_prompts, write_gguf

CHUNK = 16


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SavedModel]:
    return save_cases(tmp_path_factory, list(CASES))


def _param(case: str, tp: int) -> object:
    return pytest.param((case, tp), id=f"{case}-tp{tp}", marks=[pytest.mark.slow] if tp > 1 else [])


# TP 4 only where it splits in a new way: 2 KV heads over 4 ranks, so pairs of ranks share (replicate) a KV
# head, read from within Phi-3's fused qkv_proj, and normalized by Qwen3's k_norm.
TP_CASES = {1: list(CASES), 2: list(CASES), 4: ["qwen3-gqa4x2-headdim32-qknorm", "phi3-gqa4x2-fused-vocab250"]}


@pytest.fixture(scope="module", params=[_param(case, tp) for tp, cases in TP_CASES.items() for case in cases])
def loaded(request, saved_models) -> Iterator[tuple[ModelRunner, SavedModel]]:
    case, tp = request.param
    threads = torch.get_num_threads()
    runner = ModelRunner(RunnerConfig(model=str(saved_models[case].folder), tp_size=tp, num_blocks=64))
    torch.set_num_threads(1)  # as in test_random_configs.py: one thread on the shared 2-core machine
    yield runner, saved_models[case]
    runner.shutdown()
    torch.set_num_threads(threads)


def test_the_registry_builds_each_family_from_its_architecture(saved_models):
    assert MODEL_CLASSES["Qwen3ForCausalLM"] is Qwen3ForCausalLM
    assert MODEL_CLASSES["Phi3ForCausalLM"] is Phi3ForCausalLM
    qwen3 = load_config(saved_models["qwen3-gqa4x2-headdim32-qknorm"].folder)
    assert (qwen3.architecture, qwen3.qk_norm, qwen3.attention_bias, qwen3.o_proj_bias) == (
        "Qwen3ForCausalLM",
        True,
        False,
        False,
    )
    assert qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_heads
    biased = load_config(saved_models["qwen3-mha4-attnbias-tied"].folder)
    assert (biased.attention_bias, biased.o_proj_bias, biased.tie_word_embeddings) == (True, True, True)
    phi3 = load_config(saved_models["phi3-gqa4x2-fused-vocab250"].folder)
    assert (phi3.architecture, phi3.qk_norm, phi3.attention_bias) == ("Phi3ForCausalLM", False, False)
    assert type(load_model(saved_models["phi3-mha8-fused-tied"].folder, TPGroup())) is Phi3ForCausalLM


def test_greedy_tokens_and_every_steps_logits_match_hf(loaded):
    """All prompts prefilled in one step, then decoded together: each step's logits against HF's at that
    position, and each step's argmax against HF's greedy token."""
    runner, saved = loaded
    driver = PagedDriver(runner)
    seqs = [driver.add(p) for p in saved.prompts]
    logits = driver.step({s: len(p) for s, p in zip(seqs, saved.prompts)})
    for step in range(GREEDY_STEPS):
        for s, row in zip(seqs, logits):
            ref = saved.logits[s][len(saved.prompts[s]) - 1 + step]
            err = (row - ref).abs().max().item()
            assert err <= TOL, f"sequence {s} step {step}: max |logit error| {err}"
            token = int(row.argmax())
            assert token == saved.greedy[s][step], f"sequence {s} step {step}"
            driver.tokens[s].append(token)
        if step + 1 < GREEDY_STEPS:
            logits = driver.step({s: 1 for s in seqs})


def test_chunked_prefill_alongside_decodes_matches_hf(loaded):
    """The longest prompt prefilled CHUNK tokens a step while the others decode beside it."""
    runner, saved = loaded
    driver = PagedDriver(runner)
    long, short = saved.prompts[-1], saved.prompts[:-1]
    seqs = [driver.add(p) for p in short]
    driver.step({s: len(p) for s, p in zip(seqs, short)})
    for s in seqs:
        driver.tokens[s].append(saved.greedy[s][0])
    target = driver.add(long)
    done = 0
    while done < len(long):
        n = min(CHUNK, len(long) - done)
        logits = driver.step({target: n, **{s: 1 for s in seqs}})  # prefills come first in a step
        done += n
        ref = saved.logits[len(short)][done - 1]
        assert (logits[0] - ref).abs().max().item() <= TOL, f"chunk ending at {done}"
        for s in seqs:
            driver.tokens[s].append(int(logits[1 + s].argmax()))


def test_qwen3_keeps_the_python_layers_where_llama_would_take_the_fused_decode(saved_models, monkeypatch):
    """The fused C++ decode chains Llama's ops without q/k norms: Qwen3 must never take it, even where the
    op would accept its weights; Phi-3's maths is Llama's, so it may."""
    monkeypatch.setattr(FusedDecode, "of", classmethod(lambda cls, model: object()))  # accepts any model
    qwen3 = load_model(saved_models["qwen3-gqa4x2-headdim32-qknorm"].folder, TPGroup())
    assert not qwen3.model.fuse_decode() and qwen3.model.fused_decode is None
    phi3 = load_model(saved_models["phi3-gqa4x2-fused-vocab250"].folder, TPGroup())
    assert isinstance(phi3, LlamaForCausalLM) and phi3.model.fuse_decode()


LONGROPE_ORIGINAL = 32


@pytest.fixture(scope="module")
def longrope_phi3(tmp_path_factory: pytest.TempPathFactory):
    """A Phi-3 with LongRoPE (pretrained on 32 positions, extended to 256) saved to a folder, and its HF model."""
    g = torch.Generator().manual_seed(8)
    head_dim = 16
    config = Phi3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        original_max_position_embeddings=LONGROPE_ORIGINAL,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": LONGROPE_ORIGINAL,
            "short_factor": (1 + 0.5 * torch.rand(head_dim // 2, generator=g)).tolist(),
            "long_factor": (1 + torch.linspace(0, 7, head_dim // 2)).tolist(),
        },
    )
    model = random_hf_model(config, seed=9)
    folder = tmp_path_factory.mktemp("phi3-longrope")
    model.save_pretrained(folder)
    return folder, model


def _greedy_against_hf(runner: ModelRunner, model, prompts: list[list[int]], steps: int) -> None:
    """Prefill the prompts together, decode them together; each step's logits and argmax against HF's full
    forward pass over the sequence so far (which, with LongRoPE, picks its factors by that length)."""
    driver = PagedDriver(runner)
    seqs = [driver.add(p) for p in prompts]
    logits = driver.step({s: len(p) for s, p in zip(seqs, prompts)})
    for step in range(steps):
        for s, row in zip(seqs, logits):
            with torch.no_grad():
                ref = model(torch.tensor([driver.tokens[s]])).logits[0, -1].float()
            err = (row - ref).abs().max().item()
            assert err <= TOL, f"sequence {s} step {step}: max |logit error| {err}"
            assert int(row.argmax()) == int(ref.argmax()), f"sequence {s} step {step}"
            driver.tokens[s].append(int(row.argmax()))
        if step + 1 < steps:
            logits = driver.step({s: 1 for s in seqs})


def test_longrope_within_the_original_context_is_hfs_short_factors(longrope_phi3):
    """Served at most LONGROPE_ORIGINAL tokens, every sequence is one HF rotates with the short factors."""
    folder, model = longrope_phi3
    runner = ModelRunner(RunnerConfig(model=str(folder), num_blocks=32, max_model_len=LONGROPE_ORIGINAL))
    try:
        _greedy_against_hf(runner, model, random_prompts(256, [1, 9, 20], seed=10), LONGROPE_ORIGINAL - 20)
    finally:
        runner.shutdown()


def test_longrope_past_the_original_context_is_hfs_long_factors_and_says_so(longrope_phi3, caplog):
    """Served the whole extended context, sequences past LONGROPE_ORIGINAL are HF's (long factors and the
    attention scale); the load warns that shorter ones get the long factors too."""
    folder, model = longrope_phi3
    with caplog.at_level("WARNING"):
        runner = ModelRunner(RunnerConfig(model=str(folder), num_blocks=32))
    assert "LongRoPE's original 32" in caplog.text and "long factors" in caplog.text
    try:
        _greedy_against_hf(runner, model, random_prompts(256, [40, 70], seed=11), GREEDY_STEPS)
    finally:
        runner.shutdown()


def test_qwen3_from_gguf_matches_hf_and_never_takes_the_fused_decode(saved_models, tmp_path):
    """A Qwen3 written as llama.cpp's converter writes it (arch qwen3, attn_q_norm / attn_k_norm, Q/K rows
    unpermuted) loads as Qwen3; on the file's own blocks the fused decode op would accept its weights,
    but the family keeps the Python layers."""
    saved = saved_models["qwen3-gqa4x2-headdim32-qknorm"]
    hf = AutoModelForCausalLM.from_pretrained(saved.folder, dtype=torch.float32).eval()
    path = tmp_path / "tiny-qwen3.Q8_0.gguf"
    reference = copy.deepcopy(hf)
    reference.load_state_dict(write_gguf(hf, path, GGMLQuantizationType.Q8_0, arch="qwen3"))
    cfg = load_config(path)
    assert (cfg.architecture, cfg.qk_norm, cfg.head_dim) == ("Qwen3ForCausalLM", True, 32)
    runner = ModelRunner(RunnerConfig(model=str(path), num_blocks=64, quantization="none"))
    try:
        _greedy_against_hf(runner, reference, saved.prompts, 8)
    finally:
        runner.shutdown()
    blocks = ModelRunner(RunnerConfig(model=str(path), num_blocks=16))  # "auto": the file's own blocks
    try:
        model = blocks._shard.model
        assert isinstance(model, Qwen3ForCausalLM) and model.model.fused_decode is None
        if cpu_kernels.llama_decode_layers() is not None:
            assert FusedDecode.of(model.model) is not None  # the op would take these weights
    finally:
        blocks.shutdown()


def test_sharded_phi3_checkpoint_splits_its_fused_tensors_across_files(saved_models, tmp_path):
    """save_pretrained's shards with their index: each fused tensor is read from whichever file holds it."""
    saved = saved_models["phi3-gqa4x2-fused-vocab250"]
    AutoModelForCausalLM.from_pretrained(saved.folder, dtype=torch.float32).save_pretrained(
        tmp_path, max_shard_size="40KB"
    )
    assert len(list(tmp_path.glob("*.safetensors"))) >= 3 and (tmp_path / "model.safetensors.index.json").is_file()
    runner = ModelRunner(RunnerConfig(model=str(tmp_path), num_blocks=64))
    try:
        driver = PagedDriver(runner)
        seqs = [driver.add(p) for p in saved.prompts]
        logits = driver.step({s: len(p) for s, p in zip(seqs, saved.prompts)})
    finally:
        runner.shutdown()
    for s, row in zip(seqs, logits):
        assert (row - saved.logits[s][len(saved.prompts[s]) - 1]).abs().max().item() <= TOL
