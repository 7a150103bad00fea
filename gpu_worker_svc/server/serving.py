"""Serves one worker's engine, from the model load to the exit (main.py starts it).

Load the engine (spawning the tensor-parallel ranks), start the gRPC server (healthy from then
on), register with the scheduler, heartbeat. SIGTERM asks the scheduler to move the running
requests, their KV blocks sent ahead to the workers they move to (Scheduler.DrainWorker, within
SHARDLINE_STOP_HANDOFF_S), then aborts what is left, shuts the ranks down and exits 0 (during the
model load, at once); a dead engine marks the worker NOT_SERVING and exits 1, so the scheduler
re-dispatches.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable

import torch

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.ngram_proposer import SpeculativeConfig
from gpu_worker_svc.engine.torch_thread import TorchThread
from gpu_worker_svc.model.dummy import is_dummy
from gpu_worker_svc.model.loader import parse_dtype
from gpu_worker_svc.model.lora_adapter import LoraAdapterError
from gpu_worker_svc.server.engine_loop import EngineLoop
from gpu_worker_svc.server.kv_transfer_servicer import SERVICE_NAME as KV_SERVICE_NAME
from gpu_worker_svc.server.kv_transfer_servicer import KvTransferServicer
from gpu_worker_svc.server.process_age import process_age_s
from gpu_worker_svc.server.registration import SchedulerRegistration
from gpu_worker_svc.server.servicer import WorkerServicer
from gpu_worker_svc.server.settings import WorkerSettings
from gpu_worker_svc.server.telemetry import StepTelemetry
from gpu_worker_svc.server.utilization import StepCostModel, device_peak
from shardline.core.grpc_server import GrpcService, RunningServer, start_grpc_server
from shardline.core.model_path import model_name, resolve_model_path
from shardline.core.service_main import started
from shardline.proto import worker_pb2, worker_pb2_grpc
from tracing.grpc_context import TracingServerInterceptor
from tracing.metrics import start_metrics_server
from tracing.otel_setup import TracingHandle, setup_tracing

log = logging.getLogger("gpu_worker_svc")

SERVICE_NAME = "shardline.v1.Worker"
_STOP_GRACE_S = 5.0


def engine_config(s: WorkerSettings) -> EngineConfig:
    """The engine as this worker runs it (`shardline bench --engine` runs the same one in-process)."""
    runner = RunnerConfig(
        model=s.model,
        tp_size=s.tp_size,
        dtype=s.resolved_dtype,
        device=s.resolved_device,
        block_size=s.block_size,
        cpu_kv_bytes=s.kv_cache_bytes,
        gpu_memory_utilization=s.gpu_memory_utilization,
        trace_instance=s.resolved_worker_id if s.tracing else None,
        quantization=s.quantization,
        onednn_weights=s.onednn_weights,
        batch_invariant=s.batch_invariant,
    )
    return EngineConfig(
        runner,
        SchedulerConfig(
            s.max_num_seqs,
            s.max_num_batched_tokens,
            background_priority=s.background_priority,
            background_max_seqs=s.background_max_seqs,
            background_grace_s=s.background_grace_s,
            max_loras_per_batch=s.max_loras_per_batch,
        ),
        s.enable_prefix_caching,
        SpeculativeConfig(s.num_speculative_tokens),
        s.async_scheduling,
        s.max_lora_rank,
    )


def build_engine(s: WorkerSettings) -> LLMEngine:
    engine = LLMEngine(engine_config(s))
    if s.torch_threads > 0:  # after the runner, which sets its own default on CPU
        torch.set_num_threads(s.torch_threads)
    for name, path in s.resolved_lora_adapters.items():
        try:
            engine.add_lora(name, path)
        except LoraAdapterError as exc:  # one bad adapter costs its own requests only
            log.error("%s; serving without it", exc)
    return engine


def worker_info(s: WorkerSettings, engine: LLMEngine, address: str) -> worker_pb2.WorkerInfo:
    name = s.model if is_dummy(s.model) else model_name(resolve_model_path(s.model))
    return worker_pb2.WorkerInfo(
        worker_id=s.resolved_worker_id,
        address=address,
        model=name,
        tp_size=s.tp_size,
        kv_blocks_total=engine.block_pool.num_blocks,
        block_size=s.block_size,
        max_num_seqs=s.max_num_seqs,
        max_model_len=engine.max_model_len,
        role=s.role,
        adapters=engine.loras.names,
    )


def engine_loop_for(
    s: WorkerSettings,
    engine: LLMEngine,
    tracing: TracingHandle,
    model: str,
    on_fatal: Callable[[BaseException], None],
    thread: TorchThread | None = None,
) -> EngineLoop:
    cfg = engine.model_config
    peak = device_peak(
        s.resolved_device, s.peak_tflops, s.peak_bandwidth_gbs, s.cpu_peak_tflops, s.cpu_peak_bandwidth_gbs
    )
    dtype_bytes = parse_dtype(s.resolved_dtype, "cpu" if s.resolved_device == "cpu" else "cuda").itemsize
    cost = StepCostModel.for_model(cfg, dtype_bytes, peak, s.tp_size)
    return EngineLoop(
        engine,
        StepTelemetry(tracing.tracer, cost, model, tracing.enabled),
        on_fatal,
        s.resolved_admission_gap_s,
        thread,
        model,
    )


async def serve(s: WorkerSettings) -> int:
    """Run the worker until SIGTERM (returns 0) or until its engine dies (returns 1)."""
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()  # a signal from the end of the model load on
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _abandon_load)
    tracing = setup_tracing("gpu_worker", s.resolved_worker_id, rank=0, enabled=s.tracing)
    log.info(
        "loading %s: tp=%d, %s on %s", s.model or "the default model", s.tp_size, s.resolved_dtype, s.resolved_device
    )
    torch_thread = TorchThread("engine-loop")  # builds, steps and shuts the engine down (engine/torch_thread.py)
    engine = await torch_thread.run(build_engine, s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    log.info("engine ready: %d KV blocks of %d tokens", engine.block_pool.num_blocks, s.block_size)
    try:
        if stop_requested.is_set():
            return 0
        return await _serve_engine(s, engine, torch_thread, tracing, stop_requested)
    finally:
        await _shutdown(engine, torch_thread)
        await asyncio.to_thread(tracing.shutdown)
        log.info("worker stopped")


async def _shutdown(engine: LLMEngine, torch_thread: TorchThread) -> None:
    """The engine's shutdown on its own thread, after the engine loop; beside it if the loop is stuck."""
    try:
        await asyncio.wait_for(torch_thread.run(engine.shutdown), 60)
    except TimeoutError:
        log.warning("the engine thread is still busy after 60 s: shutting the engine down beside it")
        await asyncio.to_thread(engine.shutdown)


def _abandon_load() -> None:
    """A stop signal while the model loads: exit now, as nothing is served yet.

    The load runs in a thread that cannot be interrupted, and a large model takes minutes; waiting
    for it would outlast an orchestrator's grace period (docker's 10 s) and end in SIGKILL. The
    tensor-parallel ranks started so far are killed first, so none outlives the worker.
    """
    log.info("stop signal during the model load: exiting")
    for child in multiprocessing.active_children():
        child.kill()
    logging.shutdown()
    os._exit(0)


async def _serve_engine(
    s: WorkerSettings,
    engine: LLMEngine,
    torch_thread: TorchThread,
    tracing: TracingHandle,
    stop_requested: asyncio.Event,
) -> int:
    loop = asyncio.get_running_loop()
    engine_died = asyncio.Event()
    info = worker_info(s, engine, address="")
    engine_loop = engine_loop_for(
        s, engine, tracing, info.model, lambda _exc: loop.call_soon_threadsafe(engine_died.set), torch_thread
    )
    engine_loop.start()
    kv_transfer = KvTransferServicer(engine_loop, engine.kv_layout, engine.block_pool.num_blocks)
    server = await start_grpc_server(
        [
            GrpcService(WorkerServicer(engine_loop, info), worker_pb2_grpc.add_WorkerServicer_to_server, SERVICE_NAME),
            GrpcService(kv_transfer, worker_pb2_grpc.add_KvTransferServicer_to_server, KV_SERVICE_NAME),
        ],
        s.port,
        s.host,
        interceptors=[TracingServerInterceptor(tracing.tracer)],
    )
    info.address = s.address(server.port)  # known only now when the port was 0
    info.startup_s = process_age_s()  # the cold start, which the scheduler's autoscaler plans with
    log.info(
        "worker %s serving %s on port %d, %.1fs after its start",
        info.worker_id,
        info.model,
        server.port,
        info.startup_s,
    )
    started()
    metrics_server = start_metrics_server(s.metrics_port) if s.metrics_port > 0 else None
    registrar = SchedulerRegistration(
        s.scheduler_address,
        info,
        lambda: engine_loop.load,
        # The process itself stays healthy (a liveness probe must not restart it): only the
        # Worker service stops, until the driver that scales the pool stops the worker.
        on_retired=lambda: server.set_serving(False, [SERVICE_NAME]),
    )
    registration = asyncio.create_task(registrar.run())
    watchdog = asyncio.create_task(_stop_when_dead(engine_died, server))

    async def on_stop() -> None:
        # No heartbeat may register the worker again once it has left the pool. The engine runs on
        # while the scheduler moves its requests: the KvTransfer service exports their blocks between
        # steps, and the tokens of those steps still reach Redis and go with them.
        registration.cancel()
        await registrar.leave(s.stop_handoff_s)
        await asyncio.to_thread(engine_loop.stop)

    try:
        await server.wait_for_signal(on_stop=on_stop, grace_s=_STOP_GRACE_S, stop=stop_requested)
    finally:
        registration.cancel()
        watchdog.cancel()
        await asyncio.to_thread(engine_loop.stop)
        if metrics_server is not None:
            metrics_server.shutdown()
    return 1 if engine_died.is_set() else 0


async def _stop_when_dead(engine_died: asyncio.Event, server: RunningServer) -> None:
    await engine_died.wait()
    log.error("the engine died: marking the worker NOT_SERVING and exiting")
    await server.set_serving(False, ["", SERVICE_NAME])
    await server.stop(0)
