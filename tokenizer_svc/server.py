"""Wiring of the tokenizer service: load the model's tokenizer, serve it over gRPC, stop on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

from opentelemetry import trace

from shardline.core.grpc_server import GrpcService, RunningServer, start_grpc_server
from shardline.core.model_path import model_name, resolve_model_path
from shardline.core.service_main import started
from shardline.core.text.tokenizer import Tokenizer, TokenizerError
from shardline.proto import tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.service import TokenizerService
from tokenizer_svc.settings import TokenizerSettings
from tracing.grpc_context import TracingServerInterceptor
from tracing.otel_setup import setup_tracing

logger = logging.getLogger(__name__)

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name


def max_context_length(tokenizer: Tokenizer) -> int:
    """Longest prompt plus output the model was trained for, as its GGUF or config.json metadata states."""
    length = tokenizer.context_length
    if not isinstance(length, int) or length <= 0:
        raise TokenizerError(f"{tokenizer.model_name}: the model metadata gives no context length")
    return length


def read_chat_template(value: str) -> str:
    """A template given as a file's path, or as its text (anything with Jinja markup in it)."""
    if "{{" in value or "{%" in value:
        return value
    try:
        return Path(value).read_text()
    except OSError as exc:
        raise TokenizerError(f"chat template {value}: {exc.strerror}") from None


def build_service(model: str | None, chat_template: str | None = None) -> TokenizerService:
    """The servicer for `model` (None: the default model); loading takes about a second. `chat_template`
    (a file, or the template's text) replaces the model's own."""
    path = resolve_model_path(model)
    tokenizer = Tokenizer.from_model_path(path)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return TokenizerService(tokenizer, model_name(path), max_context_length(tokenizer))


async def start_tokenizer_server(
    service: TokenizerService, port: int, tracer: trace.Tracer | None = None, host: str = "0.0.0.0"
) -> RunningServer:
    """Serve `service` (with health and reflection) on `host:port`; port 0 picks a free port."""
    interceptors = [TracingServerInterceptor(tracer)] if tracer is not None else []
    registered = GrpcService(service, tokenizer_pb2_grpc.add_TokenizerServicer_to_server, SERVICE_NAME)
    return await start_grpc_server([registered], port, host=host, interceptors=interceptors)


async def serve(settings: TokenizerSettings) -> None:
    """Run until SIGTERM/SIGINT."""
    service = await asyncio.to_thread(build_service, settings.model, settings.chat_template)
    instance_id = settings.instance_id or f"tokenizer-{socket.gethostname()}:{settings.port}"
    tracing = setup_tracing("tokenizer", instance_id, enabled=settings.tracing)
    server = await start_tokenizer_server(service, settings.port, tracing.tracer, settings.host)
    logger.info("tokenizer service listening on port %d", server.port)
    started()
    try:
        await server.wait_for_signal()
    finally:
        await asyncio.to_thread(tracing.shutdown)
