"""The options of the SDK's gRPC channels.

grpc's own default caps a received message at 4 MB, and a unary Generate of a long
completion with top_logprobs, or one with prompt_logprobs, can outgrow it: the call
would fail with RESOURCE_EXHAUSTED after the work was done. The gateway accepts and
sends messages up to 64 MB (shardline/core/grpc_server.py), so the SDK takes as much.
"""

from __future__ import annotations

from shardline.proto import MAX_MESSAGE_BYTES

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
