"""The generated gRPC modules of the shardline.v1 API.

Importing this module first regenerates the stubs when they are missing or
older than a .proto file, so a fresh checkout works without a build step:

    from shardline.proto import generation_pb2, generation_pb2_grpc
"""

from shardline.protogen import ensure_stubs

ensure_stubs()

# Imported after ensure_stubs() on purpose: the modules may not exist before it.
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
    "batches_pb2",
    "batches_pb2_grpc",
    "common_pb2",
    "ensure_stubs",
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
