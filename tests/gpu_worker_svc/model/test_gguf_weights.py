"""model/gguf_weights.py: `quantization="gguf"` gives each layer the file's own blocks, where the fp32
load puts the same weights, at any tensor-parallel rank; and the engine runs on them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import LlamaConfig

from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import ModelRunner, RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.model.attention_metadata import StepBatch
from gpu_worker_svc.model.gguf_weights import load_gguf_blocks
from gpu_worker_svc.model.layers.gguf import GGUFWeight
from gpu_worker_svc.model.layers.kernels import cpu_kernels
from gpu_worker_svc.model.loader import load_model
from gpu_worker_svc.model.parallel import TPGroup
from shardline.core.gguf_quants import dequantize
from tests.gpu_worker_svc.model.paged_driver import PagedDriver
from tests.gpu_worker_svc.model.random_checkpoints import random_hf_model, random_prompts, write_gguf
from tests.gpu_worker_svc.model.test_checkpoint_forms import CONFIG

pytestmark = pytest.mark.skipif(cpu_kernels.gguf_linear() is None, reason="the CPU kernels cannot be built here")


@pytest.fixture(scope="module", params=[(GGMLQuantizationType.Q4_1, False), (GGMLQuantizationType.Q8_0, True)])
def gguf_path(request, tmp_path_factory) -> Path:
    """A tiny Llama as a llama.cpp GGUF: Q4_1 with its own head, or Q8_0 with the head tied to the embedding."""
    qtype, tied = request.param
    path = tmp_path_factory.mktemp("gguf") / f"tiny.{qtype.name}.gguf"
    write_gguf(random_hf_model(LlamaConfig(tie_word_embeddings=tied, **CONFIG), seed=9), path, qtype)
    return path


@pytest.mark.parametrize("rank, world_size", [(0, 1), (1, 2)])
def test_each_layer_holds_the_blocks_of_exactly_its_fp32_weights(gguf_path, rank, world_size):
    """The layers' own loaders place the rows: fused q/k/v and gate/up, Q/K unpermuted, row-parallel
    columns cut on blocks, and the vocabulary's padded rows of a rank's head left zero."""
    model = load_model(str(gguf_path), TPGroup(rank, world_size))
    fp32 = {name: m.weight.clone() for name, m in model.named_modules() if hasattr(m, "quant")}
    assert load_gguf_blocks(model, str(gguf_path)) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the head
    for name, module in model.named_modules():
        if not hasattr(module, "quant") or name == "model.embed_tokens":
            continue
        quant = module.quant
        assert isinstance(quant, GGUFWeight) and quant.qtype == GGMLQuantizationType[gguf_path.suffixes[0][1:]]
        rows = dequantize(quant.file_blocks().numpy(), quant.qtype, tuple(fp32[name].shape))
        assert torch.equal(torch.from_numpy(rows), fp32[name]), name
    tied = model.config.tie_word_embeddings
    assert model.model.layers[1].mlp.down_proj.weight is None
    assert (model.lm_head.weight is model.model.embed_tokens.weight) if tied else model.lm_head.weight is None


def test_the_runner_on_the_blocks_tracks_fp32_and_a_row_is_the_same_alone_or_batched(gguf_path):
    prompts = random_prompts(CONFIG["vocab_size"], [1, 9, 40], seed=9)
    logits = {}
    for quantization in (None, "gguf"):
        config = RunnerConfig(model=str(gguf_path), quantization=quantization, num_blocks=32, batch_invariant=True)
        runner = ModelRunner(config)
        try:
            driver = PagedDriver(runner)
            seqs = [driver.add(p) for p in prompts]
            logits[quantization] = driver.step({s: len(p) for s, p in zip(seqs, prompts)})
            if quantization == "gguf":
                alone = PagedDriver(runner)
                for i, p in enumerate(prompts):
                    assert torch.equal(alone.step({alone.add(p): len(p)})[0], logits["gguf"][i])
        finally:
            runner.shutdown()
    # Only the activations' int8 rounding separates the two: up to half a step, 1/254 of a block's
    # absmax, at each of the 9 matmuls' inputs (0.3-0.5% each on these random weights, ~2% at the end).
    error = (logits["gguf"] - logits[None]).norm(dim=-1) / logits[None].norm(dim=-1)
    assert (error < 0.05).all()
    assert torch.equal(logits["gguf"].argmax(-1), logits[None].argmax(-1))


def test_two_ranks_on_the_blocks_give_the_logits_of_one(gguf_path):
    """Row-parallel layers cut on blocks, and a vocabulary (251) that pads rank 1's part of the head.
    Each rank quantizes its own slice of an input row to the same blocks one rank would; only the
    all-reduce's summation order differs, and a rounding flipped by it moves an activation code."""
    prompts = random_prompts(CONFIG["vocab_size"], [9, 40], seed=10)
    logits = {}
    for tp in (1, 2):
        runner = ModelRunner(RunnerConfig(model=str(gguf_path), quantization="gguf", tp_size=tp, num_blocks=32))
        try:
            driver = PagedDriver(runner)
            seqs = [driver.add(p) for p in prompts]
            logits[tp] = driver.step({s: len(p) for s, p in zip(seqs, prompts)})
        finally:
            runner.shutdown()
    assert logits[2].shape == (2, CONFIG["vocab_size"])
    assert ((logits[2] - logits[1]).norm(dim=-1) / logits[1].norm(dim=-1) < 0.01).all()
    assert torch.equal(logits[2].argmax(-1), logits[1].argmax(-1))


def test_gguf_is_refused_for_a_model_that_is_not_a_gguf_file(tmp_path):
    random_hf_model(LlamaConfig(**CONFIG), seed=1).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), TPGroup())
    with pytest.raises(ValueError, match="quantization gguf needs a .gguf model"):
        load_gguf_blocks(model, str(tmp_path))


@pytest.mark.slow
def test_the_default_model_runs_on_its_q4_1_blocks_close_to_fp32_and_batch_invariant():
    prompts = [torch.randint(100, 49152, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 61)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engines = {q: LLMEngine(EngineConfig(runner=RunnerConfig(quantization=q, num_blocks=64))) for q in (None, "gguf")}
    try:
        model = engines["gguf"].runner._shard.model
        assert sum(isinstance(m.quant, GGUFWeight) for m in model.modules() if hasattr(m, "quant")) == 30 * 4 + 1
        logits = {}
        for q, e in engines.items():
            batch = StepBatch(
                torch.tensor(prompts[1]), torch.tensor([0]), torch.tensor([61]), torch.tensor([[0, 1, 2, 3]])
            )
            logits[q] = e.runner.execute(batch)[0]
        assert torch.nn.functional.cosine_similarity(logits[None], logits["gguf"], dim=0) > 0.999
        assert logits[None].argmax() == logits["gguf"].argmax()
        alone = [engines["gguf"].generate([p], greedy)[0].token_ids for p in prompts]
        assert [r.token_ids for r in engines["gguf"].generate(prompts, greedy)] == alone
    finally:
        for e in engines.values():
            e.shutdown()
