"""Response bodies built from chunks, without a stack: logprobs as OpenAI and vLLM shape them."""

from __future__ import annotations

from gateway.openai_response import ResponseFormatter
from gateway.request_runner import Completion
from gateway.request_stream import StreamChunk
from shardline.proto import sampling_pb2

TEXTS = {10: "Hel", 11: "lo", 12: " world", 20: "X"}


def _logprob(token_id: int, logprob: float, top: list[tuple[int, float]]) -> sampling_pb2.TokenLogprob:
    alternatives = [sampling_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top]
    return sampling_pb2.TokenLogprob(token_id=token_id, logprob=logprob, top=alternatives)


def test_completion_top_logprobs_always_hold_the_sampled_token() -> None:
    # Token 11 was sampled although 20 was likelier; with logprobs=0 there are no alternatives at all.
    logprobs = [_logprob(10, -0.25, [(10, -0.25)]), _logprob(11, -3.0, [(20, -0.5)]), _logprob(12, -0.125, [])]
    completion = Completion(text="Hello world", token_ids=[10, 11, 12], logprobs=logprobs, token_texts=TEXTS,
                            finish_reason="length")
    body = ResponseFormatter("cmpl-1", "m", chat=False).whole(completion)["choices"][0]["logprobs"]
    assert body["top_logprobs"] == [{"Hel": -0.25}, {"X": -0.5, "lo": -3.0}, {" world": -0.125}]
    assert body["tokens"] == ["Hel", "lo", " world"] and body["text_offset"] == [0, 3, 5]


def test_streamed_offsets_count_text_held_back_in_an_earlier_chunk() -> None:
    # The first chunk's text was held back (it might begin a stop string); the next one carries it.
    formatter = ResponseFormatter("cmpl-1", "m", chat=False)
    first = StreamChunk("", [10], 0, [_logprob(10, -0.1, [])], TEXTS)
    second = StreamChunk("Hello", [11], 1, [_logprob(11, -0.2, [])], TEXTS)
    third = StreamChunk(" world", [12], 2, [_logprob(12, -0.3, [])], TEXTS, finish_reason="length")
    offsets = [e["choices"][0]["logprobs"]["text_offset"] for c in (first, second, third)
               for e in formatter.events(c) if e["choices"]]
    assert offsets == [[0], [3], [5]]
