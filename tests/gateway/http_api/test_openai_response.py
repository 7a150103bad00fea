"""Response bodies built from chunks, without a stack: logprobs as OpenAI and vLLM shape them."""

from __future__ import annotations

from gateway.http_api.openai_echo import EchoedPrompt
from gateway.http_api.openai_response import ResponseFormatter
from gateway.output.collected_output import CollectedOutput
from gateway.output.request_stream import StreamChunk
from shardline.proto import sampling_pb2

TEXTS = {10: "Hel", 11: "lo", 12: " world", 20: "X"}


def _logprob(token_id: int, logprob: float, top: list[tuple[int, float]], rank: int = 0) -> sampling_pb2.TokenLogprob:
    alternatives = [sampling_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top]
    return sampling_pb2.TokenLogprob(token_id=token_id, logprob=logprob, top=alternatives, rank=rank)


def test_completion_top_logprobs_always_hold_the_sampled_token() -> None:
    # Token 11 was sampled although 20 was likelier; with logprobs=0 there are no alternatives at all.
    logprobs = [_logprob(10, -0.25, [(10, -0.25)]), _logprob(11, -3.0, [(20, -0.5)]), _logprob(12, -0.125, [])]
    completion = CollectedOutput(
        text="Hello world", token_ids=[10, 11, 12], logprobs=logprobs, token_texts=TEXTS, finish_reason="length"
    )
    body = ResponseFormatter("cmpl-1", "m", chat=False).whole(completion)["choices"][0]["logprobs"]
    assert body["top_logprobs"] == [{"Hel": -0.25}, {"X": -0.5, "lo": -3.0}, {" world": -0.125}]
    assert body["tokens"] == ["Hel", "lo", " world"] and body["text_offset"] == [0, 3, 5]


def test_streamed_offsets_count_text_held_back_in_an_earlier_chunk() -> None:
    # The first chunk's text was held back (it might begin a stop string); the next one carries it.
    formatter = ResponseFormatter("cmpl-1", "m", chat=False)
    first = StreamChunk("", [10], 0, [_logprob(10, -0.1, [])], TEXTS)
    second = StreamChunk("Hello", [11], 1, [_logprob(11, -0.2, [])], TEXTS)
    third = StreamChunk(" world", [12], 2, [_logprob(12, -0.3, [])], TEXTS, finish_reason="length")
    offsets = [
        e["choices"][0]["logprobs"]["text_offset"]
        for c in (first, second, third)
        for e in formatter.events(c)
        if e["choices"]
    ]
    assert offsets == [[0], [3], [5]]


ECHO = EchoedPrompt(text="Hello world", first_token_text="Hel")
PROMPT_LOGPROBS = [_logprob(11, -2.0, [(20, -0.5)], rank=2), _logprob(12, -1.0, [(12, -1.0)], rank=1)]  # 10 11 12


def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion() -> None:
    completion = CollectedOutput(
        text="X",
        token_ids=[20],
        logprobs=[_logprob(20, -0.5, [(20, -0.5)])],
        token_texts=TEXTS,
        finish_reason="length",
        prompt_logprobs=PROMPT_LOGPROBS,
    )
    choice = ResponseFormatter("cmpl-1", "m", chat=False, echo=ECHO).whole(completion)["choices"][0]
    assert choice["text"] == "Hello worldX" and "prompt_logprobs" not in choice
    assert choice["logprobs"] == {
        "tokens": ["Hel", "lo", " world", "X"],
        "token_logprobs": [None, -2.0, -1.0, -0.5],
        "top_logprobs": [None, {"X": -0.5, "lo": -2.0}, {" world": -1.0}, {"X": -0.5}],
        "text_offset": [0, 3, 5, 11],
    }
    # Without logprobs, only the text.
    plain = CollectedOutput(text="X", token_ids=[20], token_texts=TEXTS, finish_reason="length")
    choice = ResponseFormatter("cmpl-1", "m", chat=False, echo=ECHO).whole(plain)["choices"][0]
    assert choice["text"] == "Hello worldX" and choice["logprobs"] is None
    # prompt_logprobs without logprobs (vLLM's own field) puts nothing in the legacy object.
    asked = CollectedOutput(
        text="X", token_ids=[20], token_texts=TEXTS, finish_reason="length", prompt_logprobs=PROMPT_LOGPROBS
    )
    choice = ResponseFormatter("cmpl-1", "m", chat=False, echo=ECHO, prompt_logprobs=True).whole(asked)["choices"][0]
    assert choice["text"] == "Hello worldX" and choice["logprobs"] is None and len(choice["prompt_logprobs"]) == 3
    # A one-token prompt has no prompt logprobs, but its token is still listed (with a null logprob).
    one = CollectedOutput(
        text="X", token_ids=[20], logprobs=[_logprob(20, -0.5, [])], token_texts=TEXTS, finish_reason="length"
    )
    choice = ResponseFormatter("cmpl-1", "m", chat=False, echo=EchoedPrompt("Hel", "Hel")).whole(one)["choices"][0]
    assert choice["logprobs"]["tokens"] == ["Hel", "X"] and choice["logprobs"]["token_logprobs"] == [None, -0.5]


def test_a_streamed_echo_is_the_first_event() -> None:
    formatter = ResponseFormatter("cmpl-1", "m", chat=False, echo=ECHO)
    first = StreamChunk("X", [20], 0, [_logprob(20, -0.5, [])], TEXTS, prompt_logprobs=PROMPT_LOGPROBS)
    last = StreamChunk("lo", [11], 1, [_logprob(11, -0.25, [])], TEXTS, finish_reason="length")
    events = [e["choices"][0] for c in (first, last) for e in formatter.events(c)]
    assert [e["text"] for e in events] == ["Hello world", "X", "lo"]
    assert events[0]["logprobs"]["token_logprobs"] == [None, -2.0, -1.0] and events[0]["finish_reason"] is None
    assert [e["logprobs"]["text_offset"] for e in events[1:]] == [[11], [12]]


def test_echo_with_max_tokens_0_is_the_prompt_alone() -> None:
    # The one token the engine sampled is left out: no text, no logprob; the limit ended the choice.
    only = EchoedPrompt(text="Hello world", first_token_text="Hel", only=True)
    completion = CollectedOutput(
        text="X",
        token_ids=[20],
        logprobs=[_logprob(20, -0.5, [(20, -0.5)])],
        token_texts=TEXTS,
        finish_reason="stop",
        prompt_logprobs=PROMPT_LOGPROBS,
    )
    choice = ResponseFormatter("cmpl-1", "m", chat=False, echo=only).whole(completion)["choices"][0]
    assert choice["text"] == "Hello world" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["Hel", "lo", " world"]
    assert choice["logprobs"]["token_logprobs"] == [None, -2.0, -1.0]
    # Streamed: the echo, then the end, and nothing of the token between.
    formatter = ResponseFormatter("cmpl-1", "m", chat=False, echo=only)
    chunk = StreamChunk(
        "X", [20], 0, [_logprob(20, -0.5, [])], TEXTS, finish_reason="stop", prompt_logprobs=PROMPT_LOGPROBS
    )
    events = [e["choices"][0] for e in formatter.events(chunk)]
    assert [(e["text"], e["finish_reason"]) for e in events] == [("Hello world", None), ("", "length")]
    assert events[0]["logprobs"]["token_logprobs"] == [None, -2.0, -1.0] and events[1]["logprobs"] is None


def test_prompt_logprobs_take_vllms_shape() -> None:
    completion = CollectedOutput(
        text="X", token_ids=[20], token_texts=TEXTS, finish_reason="length", prompt_logprobs=PROMPT_LOGPROBS
    )
    want = [
        None,
        {
            "20": {"logprob": -0.5, "rank": 1, "decoded_token": "X"},
            "11": {"logprob": -2.0, "rank": 2, "decoded_token": "lo"},
        },
        {"12": {"logprob": -1.0, "rank": 1, "decoded_token": " world"}},
    ]
    choice = ResponseFormatter("cmpl-1", "m", chat=False, prompt_logprobs=True).whole(completion)["choices"][0]
    assert choice["prompt_logprobs"] == want and choice["text"] == "X"
    chat = ResponseFormatter("chatcmpl-1", "m", chat=True, prompt_logprobs=True).whole(completion)
    assert chat["prompt_logprobs"] == want and "prompt_logprobs" not in chat["choices"][0]
