"""The generated gRPC modules of the shardline.v1 API, and the message size every endpoint takes.

    from shardline.proto import generation_pb2, generation_pb2_grpc

An installed Shardline (the wheel, or the image) carries the stubs, generated when it was built.
In a checkout, where protos/ sits beside this package, importing this module first regenerates
them when they are missing or older than a .proto file, so an edited contract needs no build step.
"""

from pathlib import Path

# The largest message either way, on every Shardline endpoint and in the SDK's channels: a unary
# Generate of a long completion with logprobs outgrows grpc's default of 4 MB.
MAX_MESSAGE_BYTES = 64 << 20

if (Path(__file__).resolve().parent.parent / "protos" / "shardline" / "v1").is_dir():
    from shardline.protogen import ensure_stubs

    ensure_stubs()

# Imported after ensure_stubs() on purpose: in a fresh checkout the modules may not exist before it.
from shardline.v1 import (  # noqa: E402
    batches_pb2,
    batches_pb2_grpc,
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    sampling_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "batches_pb2",
    "batches_pb2_grpc",
    "common_pb2",
    "generation_pb2",
    "generation_pb2_grpc",
    "sampling_pb2",
    "scheduler_pb2",
    "scheduler_pb2_grpc",
    "tokenizer_pb2",
    "tokenizer_pb2_grpc",
    "worker_pb2",
    "worker_pb2_grpc",
]
