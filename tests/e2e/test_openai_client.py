"""The official `openai` Python client works unchanged against the gateway."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(http_url):
    return openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0)


def test_models(client):
    assert "SmolLM2-135M-Instruct" in [m.id for m in client.models.list()]


def test_chat_and_stream(client):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=16,
                                           temperature=0)
    assert whole.choices[0].message.content and whole.usage.completion_tokens > 0
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=16,
                                            temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content


def test_completion_with_logprobs(client):
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Paris is the capital of", max_tokens=4,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens and all(x <= 0 for x in lp.token_logprobs)


def test_bad_request_raises_400(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", temperature=9)
