"""A whole generation gathered from its chunks: what a non-streamed answer is made of."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.output.request_stream import StreamChunk, failure_of
from shardline.core.errors import ShardlineError
from shardline.proto import sampling_pb2


@dataclass(slots=True)
class CollectedOutput:
    """A whole generation, gathered from its chunks."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[sampling_pb2.TokenLogprob] = field(default_factory=list)
    token_texts: dict[int, str] = field(default_factory=dict)
    token_bytes: dict[int, bytes] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: sampling_pb2.Usage | None = None
    error: str = ""
    prompt_logprobs: list[sampling_pb2.TokenLogprob] = field(default_factory=list)  # when asked for

    def add(self, chunk: StreamChunk) -> None:
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.prompt_logprobs += chunk.prompt_logprobs
        self.token_texts.update(chunk.token_texts)
        self.token_bytes.update(chunk.token_bytes)
        self.finish_reason, self.usage, self.error = chunk.finish_reason, chunk.usage, chunk.error

    def failure(self) -> ShardlineError | None:
        """The client's error when the generation failed or timed out."""
        return failure_of(self.finish_reason, self.error)
