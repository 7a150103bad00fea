"""A Qwen3 model served through the whole stack (tokenizer, scheduler, worker, gateway as processes), the
official openai client streaming from it: its greedy tokens are HF's, each with HF's logprob.

The model is random (transformers builds it from a small config) with the default model's vocabulary,
whose tokenizer transformers reads from the GGUF file and saves into the model's folder.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config

from shardline.core.model_path import default_model_path
from shardline.stack.local_stack import StackConfig
from tests.e2e.conftest import log_dir, running_stack
from tests.gpu_worker_svc.model.random_checkpoints import random_hf_model

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

MAX_TOKENS = 16
LOGPROB_TOL = 1e-3  # the worker runs the model in float32, as HF does here; measured below 1e-5


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The served model's folder and its HF reference model."""
    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    model = random_hf_model(config, seed=3)
    folder = tmp_path_factory.mktemp("models") / "tiny-qwen3"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


@pytest.fixture(scope="module")
def client(qwen3, tmp_path_factory):
    folder = qwen3[0]
    config = StackConfig.on_free_ports(
        model=str(folder),
        data_dir=tmp_path_factory.mktemp("qwen3-stack-data"),
        log_dir=log_dir(tmp_path_factory, "qwen3-stack"),
        env={"HEARTBEAT_INTERVAL_S": "0.5", "KV_CACHE_BYTES": str(32 << 20)},
    )
    with running_stack(config) as stack:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.http_port}/v1", api_key="unused", max_retries=0)


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    for _ in range(steps):
        row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        ids.append(int(row.argmax()))
        logprobs.append(row[ids[-1]].item())
    return ids[len(prompt) :], logprobs


def test_the_stack_serves_qwen3_with_hfs_greedy_tokens_streamed(qwen3, client):
    folder, model, tokenizer = qwen3
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
