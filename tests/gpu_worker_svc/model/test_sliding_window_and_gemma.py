"""Sliding-window attention and Gemma's attention, through every attention path, against HF.

tests/gpu_worker_svc/model/test_model_families.py runs the Mistral (window 12), Gemma 2 and Gemma 3 cases
of family_cases.py through the CPU kernel at TP 1 and TP 2; here the same cases run with the kernel
off, so that torch's paths (SDPA with a window's mask, the spelled-out soft-capped attention, and the
batch-invariant attention) give HF's greedy tokens and logits too, decoded and chunked.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpu_worker_svc.engine.model_runner import ModelRunner, RunnerConfig
from gpu_worker_svc.model.families import MODEL_CLASSES
from gpu_worker_svc.model.families.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from gpu_worker_svc.model.layers.kernels import cpu_kernels
from gpu_worker_svc.model.loader import load_config, load_model
from gpu_worker_svc.model.parallel import TPGroup
from tests.gpu_worker_svc.model.family_cases import GREEDY_STEPS, TOL, SavedModel, save_cases
from tests.gpu_worker_svc.model.paged_driver import PagedDriver

WINDOWED = ["mistral-gqa4x2-window12", "gemma2-gqa4x2-window16-softcaps", "gemma3-gqa4x2-window10-qknorm"]
CHUNK = 8  # shorter than every window: a chunk's queries see keys of earlier chunks, cut by the window


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SavedModel]:
    return save_cases(tmp_path_factory, WINDOWED)


def test_gemma_configs_read_as_hf_builds_them(saved_models):
    gemma2 = load_config(saved_models["gemma2-gqa4x2-window16-softcaps"].folder)
    assert (gemma2.architecture, gemma2.hidden_act, gemma2.tie_word_embeddings) == (
        "Gemma2ForCausalLM",
        "gelu_pytorch_tanh",
        True,
    )
    assert (gemma2.sliding_window, gemma2.sliding_layers) == (16, [True, False, True])
    assert (gemma2.attn_scale, gemma2.attn_softcap, gemma2.final_softcap) == (24**-0.5, 2.0, 4.0)
    assert gemma2.embed_scale == 64**0.5 and not gemma2.qk_norm and gemma2.rope_local_theta is None
    gemma3 = load_config(saved_models["gemma3-gqa4x2-window10-qknorm"].folder)
    assert (gemma3.architecture, gemma3.qk_norm, gemma3.head_dim) == ("Gemma3ForCausalLM", True, 32)
    assert (gemma3.sliding_window, gemma3.sliding_layers) == (10, [True, True, False])
    assert (gemma3.rope_theta, gemma3.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert gemma3.rope_scaling is not None and gemma3.rope_scaling["factor"] == 2.0
    assert (gemma3.attn_softcap, gemma3.final_softcap) == (None, None)
    assert MODEL_CLASSES["Gemma2ForCausalLM"] is Gemma2ForCausalLM
    model = load_model(saved_models["gemma3-gqa4x2-window10-qknorm"].folder, TPGroup())
    assert type(model) is Gemma3ForCausalLM
    layers = list(model.model.layers)
    assert [layer.self_attn.attn.window for layer in layers] == [10, 10, None]
    assert [layer.local_rope for layer in layers] == [True, True, False]
    assert not model.model.fuse_decode()  # the fused op computes none of Gemma's norms
    mistral = load_model(saved_models["mistral-gqa4x2-window12"].folder, TPGroup())
    assert [layer.self_attn.attn.window for layer in mistral.model.layers] == [12, 12]


def test_the_load_says_what_a_sliding_window_keeps(saved_models, caplog):
    with caplog.at_level("WARNING"):
        load_model(saved_models["gemma2-gqa4x2-window16-softcaps"].folder, TPGroup())
    assert "sliding-window attention (16 tokens) on 2 of 3 layers" in caplog.text
    assert "prefix caching works" in caplog.text


@pytest.fixture(params=[(case, inv) for case in WINDOWED for inv in (False, True)], ids=lambda p: f"{p[0]}-inv{p[1]}")
def torch_attention(request, saved_models, monkeypatch) -> Iterator[tuple[ModelRunner, SavedModel]]:
    """A TP 1 runner whose attention never takes the CPU kernel: torch's SDPA paths, or with
    batch_invariant the batch-invariant attention."""
    case, invariant = request.param
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda: None)
    try:
        runner = ModelRunner(
            RunnerConfig(model=str(saved_models[case].folder), num_blocks=64, batch_invariant=invariant)
        )
    except ValueError as exc:  # batch_invariant needs oneDNN's packed weights, which some builds lack
        pytest.skip(str(exc))
    yield runner, saved_models[case]
    runner.shutdown()


def test_torch_attention_paths_give_hfs_greedy_tokens_and_logits(torch_attention):
    runner, saved = torch_attention
    driver = PagedDriver(runner)
    seqs = [driver.add(p) for p in saved.prompts]
    logits = driver.step({s: len(p) for s, p in zip(seqs, saved.prompts)})
    for step in range(GREEDY_STEPS):
        for s, row in zip(seqs, logits):
            ref = saved.logits[s][len(saved.prompts[s]) - 1 + step]
            err = (row - ref).abs().max().item()
            assert err <= TOL, f"sequence {s} step {step}: max |logit error| {err}"
            assert int(row.argmax()) == saved.greedy[s][step], f"sequence {s} step {step}"
            driver.tokens[s].append(saved.greedy[s][step])
        if step + 1 < GREEDY_STEPS:
            logits = driver.step({s: 1 for s in seqs})


def test_torch_attention_paths_chunked_prefill_matches_hf(torch_attention):
    """The longest prompt in chunks of CHUNK, each chunk's queries over the keys of the chunks before it."""
    runner, saved = torch_attention
    driver = PagedDriver(runner)
    target, prompt = driver.add(saved.prompts[-1]), saved.prompts[-1]
    done = 0
    while done < len(prompt):
        n = min(CHUNK, len(prompt) - done)
        logits = driver.step({target: n})
        done += n
        err = (logits[0] - saved.logits[-1][done - 1]).abs().max().item()
        assert err <= TOL, f"chunk ending at {done}: max |logit error| {err}"
