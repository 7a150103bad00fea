"""model/fused_decode.py: a plain decode step's layers in one C++ call give the Python layers' bits,
logits and KV cache alike, and the model keeps the Python layers wherever the op cannot run them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn
from transformers import LlamaConfig

from gpu_worker_svc.engine.model_runner import ModelRunner, RunnerConfig
from gpu_worker_svc.model.fused_decode import FusedDecode
from gpu_worker_svc.model.gguf_weights import load_gguf_blocks
from gpu_worker_svc.model.layers.kernels import cpu_kernels
from gpu_worker_svc.model.loader import load_model
from gpu_worker_svc.model.parallel import TPGroup
from tests.gpu_worker_svc.model.paged_driver import PagedDriver
from tests.gpu_worker_svc.model.random_checkpoints import random_hf_model, random_prompts, write_gguf
from tests.gpu_worker_svc.model.test_checkpoint_forms import CONFIG

pytestmark = pytest.mark.skipif(
    cpu_kernels.llama_decode_layers() is None, reason="the CPU kernels cannot be built here"
)


@pytest.fixture(scope="module", params=[(GGMLQuantizationType.Q4_1, False), (GGMLQuantizationType.Q8_0, True)])
def gguf_path(request, tmp_path_factory) -> Path:
    qtype, tied = request.param
    path = tmp_path_factory.mktemp("fused") / f"tiny.{qtype.name}.gguf"
    write_gguf(random_hf_model(LlamaConfig(tie_word_embeddings=tied, **CONFIG), seed=21), path, qtype)
    return path


def test_decode_steps_give_the_python_layers_logits_and_cache_bit_for_bit(gguf_path, monkeypatch):
    """Three sequences of different lengths decode side by side on two runners, one with the fused
    layers and one without; every step's logits and, at the end, every layer's KV cache are equal."""
    calls = []
    fused_call = FusedDecode.__call__
    monkeypatch.setattr(FusedDecode, "__call__", lambda self, *a: calls.append(1) or fused_call(self, *a))
    runners = [ModelRunner(RunnerConfig(model=str(gguf_path), quantization="gguf", num_blocks=32)) for _ in range(2)]
    try:
        assert all(r._shard.model.model.fused_decode is not None for r in runners)
        runners[1]._shard.model.model.fused_decode = None  # the Python layers
        drivers = [PagedDriver(r) for r in runners]
        prompts = random_prompts(CONFIG["vocab_size"], [3, 17, 40], seed=22)
        for driver in drivers:
            for p in prompts:
                driver.add(p)
        work = {s: len(p) for s, p in enumerate(prompts)}
        for step in range(6):
            logits = [d.step(work) for d in drivers]
            assert torch.equal(logits[0], logits[1]), f"step {step}"
            for driver in drivers:  # both go on with the fused run's tokens
                for s, row in enumerate(logits[0]):
                    driver.tokens[s].append(int(row.argmax()))
            work = {s: 1 for s in range(len(prompts))}
        assert len(calls) == 5  # the decode steps, not the prefill
        for a, b in zip(runners[0]._shard.kv_caches, runners[1]._shard.kv_caches):
            assert torch.equal(a, b)
    finally:
        for r in runners:
            r.shutdown()


def test_the_python_layers_stay_where_the_op_cannot_run_them(gguf_path):
    fp32 = load_model(str(gguf_path), TPGroup())
    assert FusedDecode.of(fp32.model) is None  # no GGUF blocks: dequantized weights
    model = load_model(str(gguf_path), TPGroup())
    load_gguf_blocks(model, str(gguf_path))
    assert model.model.fuse_decode()
    model.model.layers[1].mlp.down_proj.quant.isa = "avx2"  # a test's chosen kernel build
    assert not model.model.fuse_decode()
    model.model.layers[1].mlp.down_proj.quant.isa = ""
    qkv = model.model.layers[0].self_attn.qkv_proj
    qkv.bias = nn.Parameter(torch.zeros(qkv.quant.out_features), requires_grad=False)  # Qwen2's q/k/v bias
    assert not model.model.fuse_decode() and model.model.fused_decode is None
    rank0_of_two = load_model(str(gguf_path), TPGroup(0, 2))
    load_gguf_blocks(rank0_of_two, str(gguf_path))
    assert FusedDecode.of(rank0_of_two.model) is None  # a row-parallel layer's all-reduce sits between ops
