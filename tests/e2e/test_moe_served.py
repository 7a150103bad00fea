"""A Mixture-of-Experts model (Qwen3-MoE) served through the whole stack, with two workers: the official openai
client streams HF's greedy tokens with HF's logprobs, and a worker killed mid-stream leaves a sampled stream
identical to an unbroken run of it (the scheduler re-dispatches; the new worker prefills what was generated).

The model is random (transformers builds it from a small config: 8 experts, top-2, one dense layer) with
the default model's vocabulary, whose tokenizer transformers reads from the GGUF file and saves beside it.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoTokenizer, Qwen3MoeConfig

from shardline.client import ShardlineClient
from shardline.core.model_path import default_model_path
from shardline.stack.local_stack import StackConfig
from tests.e2e.conftest import log_dir, running_stack
from tests.gpu_worker_svc.model.random_checkpoints import random_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.extended]
openai = pytest.importorskip("openai")

MAX_TOKENS = 16
LOGPROB_TOL = 1e-3  # the worker runs the model in float32, as HF does here
# Long enough that the stream is still running when its worker is killed after 8 tokens.
FAILOVER_TOKENS = 384


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """The served model's folder and its HF reference model."""
    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    model = random_hf_model(config, seed=5)
    folder = tmp_path_factory.mktemp("models") / "tiny-qwen3-moe"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


@pytest.fixture(scope="module")
def stack(qwen3_moe, tmp_path_factory):
    config = StackConfig.on_free_ports(
        model=str(qwen3_moe[0]),
        workers=2,
        data_dir=tmp_path_factory.mktemp("moe-stack-data"),
        log_dir=log_dir(tmp_path_factory, "moe-stack"),
        env={"HEARTBEAT_INTERVAL_S": "0.5", "KV_CACHE_BYTES": str(32 << 20)},
    )
    with running_stack(config) as s:
        yield s


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    for _ in range(steps):
        row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        ids.append(int(row.argmax()))
        logprobs.append(row[ids[-1]].item())
    return ids[len(prompt) :], logprobs


def test_the_stack_serves_qwen3_moe_with_hfs_greedy_tokens_streamed(qwen3_moe, stack):
    folder, model, tokenizer = qwen3_moe
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.http_port}/v1", api_key="unused", max_retries=0)
    assert folder.name in [m.id for m in client.models.list()]
    prompt = [1, 504, 3458, 314, 260, 3575, 282, 8241, 30, 2000, 77]
    stream = client.completions.create(
        model=folder.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0, stream=True
    )
    text, logprobs, finish = "", [], None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            logprobs += choice.logprobs.token_logprobs if choice.logprobs else []
            finish = choice.finish_reason or finish
    tokens, ref = _hf_greedy(model, prompt, MAX_TOKENS)
    n = len(logprobs)
    assert n == MAX_TOKENS or (finish == "stop" and tokens[n] == model.config.eos_token_id), (n, finish)
    assert max(abs(a - b) for a, b in zip(logprobs, ref[:n])) <= LOGPROB_TOL
    assert text == tokenizer.decode(tokens[:n])
    whole = client.completions.create(model=folder.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].text == text and whole.usage.completion_tokens == n


def test_a_moe_worker_killed_mid_stream_leaves_the_stream_identical(stack):
    params = dict(max_tokens=FAILOVER_TOKENS, temperature=0.8, seed=23, ignore_eos=True)
    with ShardlineClient(f"127.0.0.1:{stack.config.grpc_port}", timeout=120) as client:
        reference = client.generate("Tell me about the experts.", **params)
        stream = client.stream("Tell me about the experts.", **params)
        tokens: list[int] = []
        for chunk in stream:
            tokens += chunk.token_ids
            if len(tokens) >= 8:
                break
        victim = client.get_request(chunk.request_id).worker_id
        stack.kill(victim)  # SIGKILL: the worker's Session stream just breaks
        t_kill = time.monotonic()
        for chunk in stream:
            tokens += chunk.token_ids
        info = client.get_request(chunk.request_id)
    assert chunk.finish_reason == "length"
    assert len(tokens) == FAILOVER_TOKENS and tokens == reference.token_ids
    assert info.attempt == 2 and info.worker_id not in ("", victim)
    assert time.monotonic() - t_kill < 60
