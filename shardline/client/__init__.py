"""Shardline's client SDK: sync and asyncio clients for the gateway's gRPC API."""

from shardline.client.async_client import AsyncShardlineClient
from shardline.client.batch_client import BatchClient
from shardline.client.batch_types import BatchInfo, BatchLineError, FileInfo
from shardline.client.sync_client import ShardlineClient
from shardline.client.types import (
    Chunk,
    Completion,
    ModelInfo,
    RequestDetails,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)

__all__ = [
    "AsyncShardlineClient",
    "BatchClient",
    "BatchInfo",
    "BatchLineError",
    "Chunk",
    "Completion",
    "FileInfo",
    "ModelInfo",
    "RequestDetails",
    "ShardlineClient",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
]
