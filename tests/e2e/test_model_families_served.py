"""A Qwen3 and a Gemma 2 model served through the whole stack (tokenizer, scheduler, worker, gateway as
processes), the official openai client streaming from each: its greedy tokens are HF's, each with HF's
logprob.

The models are random (transformers builds them from small configs) with the default model's vocabulary,
whose tokenizer transformers reads from the GGUF file and saves into the model's folder. The Gemma 2
model's window (8 keys) is far shorter than the prompt and its continuation, and its soft-capping bites.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, Gemma2Config, PretrainedConfig, PreTrainedModel, Qwen3Config

from shardline.core.model_path import default_model_path
from shardline.stack.local_stack import StackConfig
from tests.e2e.conftest import log_dir, running_stack
from tests.gpu_worker_svc.model.random_checkpoints import random_hf_model

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

MAX_TOKENS = 16
LOGPROB_TOL = 1e-3  # the worker runs the model in float32, as HF does here; measured below 1e-5


SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def random_model_with_default_vocab(family: str, folder) -> tuple[PreTrainedModel, object]:
    """A random `family` model ("qwen3", "gemma2") with the default model's vocabulary and tokenizer, saved
    into `folder`; its HF model and the tokenizer."""
    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    config: PretrainedConfig
    if family == "gemma2":
        config = Gemma2Config(
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=8.0,
            attn_implementation="eager",
            **SHAPE,
            **ids,
        )
    else:
        config = Qwen3Config(head_dim=32, **SHAPE, **ids)
    model = random_hf_model(config, seed=3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


@pytest.fixture(scope="module", params=["qwen3", "gemma2"])
def served(request, tmp_path_factory):
    """(the served model's folder, its HF reference model, the tokenizer, an openai client of its stack)."""
    family = request.param
    folder = tmp_path_factory.mktemp("models") / f"tiny-{family}"
    model, tokenizer = random_model_with_default_vocab(family, folder)
    config = StackConfig.on_free_ports(
        model=str(folder),
        data_dir=tmp_path_factory.mktemp(f"{family}-stack-data"),
        log_dir=log_dir(tmp_path_factory, f"{family}-stack"),
        env={"HEARTBEAT_INTERVAL_S": "0.5", "KV_CACHE_BYTES": str(32 << 20)},
    )
    with running_stack(config) as stack:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{stack.config.http_port}/v1", api_key="unused", max_retries=0
        )
        yield folder, model, tokenizer, client


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    for _ in range(steps):
        row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        ids.append(int(row.argmax()))
        logprobs.append(row[ids[-1]].item())
    return ids[len(prompt) :], logprobs


def test_the_stack_serves_the_family_with_hfs_greedy_tokens_streamed(served):
    folder, model, tokenizer, client = served
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
