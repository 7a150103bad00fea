"""The OpenAI-compatible HTTP API of a real stack."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.e2e.http_client import get, post, sse

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def test_completion(http_url):
    status, body = post(
        f"{http_url}/v1/completions",
        {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] and choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["prompt_tokens"] == 5 and 0 < body["usage"]["completion_tokens"] <= 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


def test_chat_completion(http_url):
    status, body = post(
        f"{http_url}/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16, "temperature": 0},
    )
    assert status == 200, body
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"].strip()
    assert body["usage"]["prompt_tokens"] > 10  # the chat template's system prompt is in there


def test_chat_without_max_tokens_runs_to_its_end(http_url):
    # No max_tokens: up to the rest of the context as the worker holds it (this stack's small KV
    # cache makes that shorter than the model's 8192), so it ends on the model's own end of turn.
    status, body = post(
        f"{http_url}/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "temperature": 0},
    )
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["message"]["content"].strip()


def test_streaming_sse_equals_non_streaming(http_url):
    req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    _, whole = post(f"{http_url}/v1/completions", req)
    events = list(sse(f"{http_url}/v1/completions", {**req, "stream_options": {"include_usage": True}}))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert len(chunks) > 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 20


def test_stop_string_truncates(http_url):
    req = {"model": MODEL, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 30, "temperature": 0}
    _, free = post(f"{http_url}/v1/completions", req)
    text = free["choices"][0]["text"]
    assert " 7" in text, text
    _, stopped = post(f"{http_url}/v1/completions", {**req, "stop": [" 7"]})
    assert stopped["choices"][0]["text"] == text[: text.index(" 7")]
    assert stopped["choices"][0]["finish_reason"] == "stop"


def test_logit_bias_forces_a_token(http_url):
    req = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "logprobs": 0}
    _, plain = post(f"{http_url}/v1/completions", req)
    status, forced = post(f"{http_url}/v1/completions", {**req, "logit_bias": {"1234": 100}})
    assert status == 200, forced
    tokens = forced["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 3 and len(set(tokens)) == 1 and tokens != plain["choices"][0]["logprobs"]["tokens"]
    assert forced["choices"][0]["text"] == tokens[0] * 3


def test_echo_with_logprobs_scores_the_prompt_as_harnesses_ask(http_url, grpc_target):
    # lm-evaluation-harness's local-completions loglikelihood request: token ids, echo, one logprob.
    from shardline.client import ShardlineClient

    prompt = [504, 3575, 282, 4649, 314, 7042]  # "The capital of France is Paris"
    req = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    status, body = post(f"{http_url}/v1/completions", req)
    assert status == 200, body
    choice = body["choices"][0]
    with ShardlineClient(grpc_target) as client:
        ref = client.generate(prompt, max_tokens=1, temperature=0.0, prompt_logprobs=1, top_logprobs=1)
    assert choice["text"] == "The capital of France is Paris" + ref.text
    lp = choice["logprobs"]
    assert lp["tokens"][:6] == ["The", " capital", " of", " France", " is", " Paris"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:6] == pytest.approx([x.logprob for x in ref.prompt_logprobs], abs=1e-6)
    assert lp["token_logprobs"][6] == pytest.approx(ref.logprobs[0].logprob, abs=1e-6)
    # is_greedy as the harness reads it: " Paris" is the model's top choice after "... France is".
    assert max(lp["top_logprobs"][5], key=lp["top_logprobs"][5].get) == " Paris"
    assert lp["text_offset"][:6] == [0, 3, 11, 14, 21, 24]
    # Streamed: the echoed prompt comes first, with the same logprobs.
    events = [e for e in sse(f"{http_url}/v1/completions", {**req, "stream": True}) if e != "[DONE]"]
    assert events[0]["choices"][0]["text"] == "The capital of France is Paris"
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:6]
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]


def test_echo_with_max_tokens_0_scores_the_prompt_alone(http_url):
    # OpenAI's own scoring request: the prompt back with its logprobs, and no completion.
    req = {"model": MODEL, "prompt": "The capital of France is Paris", "temperature": 0, "logprobs": 1, "echo": True}
    _, with_token = post(f"{http_url}/v1/completions", {**req, "max_tokens": 1})
    status, body = post(f"{http_url}/v1/completions", {**req, "max_tokens": 0})
    assert status == 200, body
    choice, scored = body["choices"][0], with_token["choices"][0]["logprobs"]
    assert choice["text"] == "The capital of France is Paris" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {key: values[:6] for key, values in scored.items()}
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 6
    assert body["usage"]["completion_tokens"] == 0
    events = [
        e
        for e in sse(
            f"{http_url}/v1/completions",
            {**req, "max_tokens": 0, "stream": True, "stream_options": {"include_usage": True}},
        )
        if e != "[DONE]"
    ]
    assert [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in events[:-1]] == [
        ("The capital of France is Paris", None),
        ("", "length"),
    ]
    assert events[0]["choices"][0]["logprobs"] == choice["logprobs"]
    assert events[-1]["usage"]["completion_tokens"] == 0


def test_prompt_logprobs_in_vllms_shape(http_url):
    status, body = post(
        f"{http_url}/v1/completions",
        {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2},
    )
    assert status == 200, body
    positions = body["choices"][0]["prompt_logprobs"]
    assert len(positions) == body["usage"]["prompt_tokens"] == 5 and positions[0] is None
    assert "3575" in positions[1] and positions[1]["3575"]["decoded_token"] == " capital"
    assert all(2 <= len(p) <= 3 for p in positions[1:])  # the prompt token, and the 2 most likely
    for position in positions[1:]:  # vLLM's ranks: the alternatives' places, and the prompt token's own
        ranked = sorted(position.values(), key=lambda entry: -entry["logprob"])
        assert [entry["rank"] for entry in ranked[:2]] == [1, 2]
        assert all(entry["rank"] >= 1 for entry in ranked) and (len(ranked) == 2 or ranked[2]["rank"] > 2)
    status, chat = post(
        f"{http_url}/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0},
    )
    assert status == 200, chat
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None


def test_seed_reproducible(http_url):
    req = {"model": MODEL, "prompt": "My favourite colour is", "max_tokens": 16, "temperature": 1.0, "seed": 42}
    texts = {post(f"{http_url}/v1/completions", req)[1]["choices"][0]["text"] for _ in range(2)}
    assert len(texts) == 1
    other = post(f"{http_url}/v1/completions", {**req, "seed": 43})[1]["choices"][0]["text"]
    assert other not in texts


def test_n_choices_are_the_seeded_requests_they_stand_for(http_url):
    # Choice k of a request with seed s samples with seed s + k: it equals a lone request with that seed.
    req = {"model": MODEL, "prompt": "My favourite animal is", "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    status, body = post(f"{http_url}/v1/completions", {**req, "n": 2, "seed": 41})
    assert status == 200, body
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    alone = [post(f"{http_url}/v1/completions", {**req, "seed": seed})[1] for seed in (41, 42)]
    assert texts == [a["choices"][0]["text"] for a in alone] and texts[0] != texts[1]
    # The prompt counts once, both outputs count.
    assert body["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 24


def test_32_concurrent_streams(http_url):
    def one(i: int) -> tuple[str, str | None]:
        events = list(
            sse(
                f"{http_url}/v1/completions",
                {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 12, "temperature": 0.7, "seed": i},
            )
        )
        chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
        return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert len(results) == 32
    assert all(text and reason in ("stop", "length") for text, reason in results)


@pytest.mark.parametrize(
    "body,field",
    [
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "temperature": 5}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 65}, "n"),
        # Longer than this stack's workers hold (their 64 MiB KV cache), though the model's context allows it.
        ({"prompt": "hello " * 1500, "max_tokens": 4}, "prompt_token_ids"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
def test_bad_parameters_are_400_naming_the_field(http_url, body, field):
    status, resp = post(f"{http_url}/v1/completions", {"model": MODEL, **body})
    assert status == 400
    assert field in resp["error"]["message"] or resp["error"].get("param") == field


def test_unknown_model_is_404(http_url):
    status, resp = post(f"{http_url}/v1/completions", {"model": "no-such-model", "prompt": "x"})
    assert status == 404 and "no-such-model" in resp["error"]["message"]


def test_models_health_metrics(http_url):
    status, body = get(f"{http_url}/v1/models")
    assert status == 200 and MODEL.encode() in body
    assert get(f"{http_url}/health")[0] == 200
    status, metrics = get(f"{http_url}/metrics")
    assert status == 200 and b"gen_ai_server_time_to_first_token_seconds" in metrics
