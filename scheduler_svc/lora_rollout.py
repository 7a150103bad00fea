"""LoRA adapters loaded and unloaded at run time on every live worker of a model, and the registry
told, so that requests naming an adapter go only to the workers that serve it."""

import asyncio
import logging

import grpc

from scheduler_svc.worker_registry import RegisteredWorker, WorkerRegistry
from shardline.core.errors import FailedPrecondition, InvalidArgument, NotFound, ShardlineError, Unavailable
from shardline.proto import common_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# Reading and checking an adapter's files takes a worker well under a second for ranks up to 64.
LORA_CALL_TIMEOUT_S = 60.0


def _workers(registry: WorkerRegistry, model: str) -> list[RegisteredWorker]:
    return [w for w in registry if (not model or w.info.model == model) and not w.draining]


async def load_adapter(registry: WorkerRegistry, request: common_pb2.LoadLoraAdapterRequest) -> list[str]:
    """Loads the adapter on every live worker of request.model; the adapters they all serve after."""
    workers = _workers(registry, request.model)
    if not workers:
        raise Unavailable(f"model: no live worker of {request.model!r} to load LoRA adapter {request.lora_name!r} on")
    await asyncio.gather(*(_call(w, "LoadLoraAdapter", request) for w in workers))
    log.info("LoRA adapter %s loaded from %s on %d worker(s)", request.lora_name, request.lora_path, len(workers))
    return _common(workers)


async def unload_adapter(registry: WorkerRegistry, request: common_pb2.UnloadLoraAdapterRequest) -> list[str]:
    """Unloads the adapter from every worker of request.model that serves it; the adapters they all serve after."""
    workers = [w for w in _workers(registry, request.model) if request.lora_name in w.info.adapters]
    if not workers:
        raise NotFound(f"lora_name: no worker of {request.model!r} serves LoRA adapter {request.lora_name!r}")
    await asyncio.gather(*(_call(w, "UnloadLoraAdapter", request) for w in workers))
    log.info("LoRA adapter %s unloaded from %d worker(s)", request.lora_name, len(workers))
    return _common(_workers(registry, request.model))


def _common(workers: list[RegisteredWorker]) -> list[str]:
    served = [set(w.info.adapters) for w in workers]
    return sorted(set.intersection(*served)) if served else []


async def _call(worker: RegisteredWorker, method: str, request: object) -> None:
    """One worker's load or unload; its answer becomes the adapters the registry routes to it."""
    async with grpc.aio.insecure_channel(worker.info.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            response = await getattr(stub, method)(request, timeout=LORA_CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise _worker_error(worker.worker_id, exc) from exc
    del worker.info.adapters[:]
    worker.info.adapters.extend(response.adapters)


def _worker_error(worker_id: str, exc: grpc.aio.AioRpcError) -> ShardlineError:
    """A worker's refusal with its status and field kept, the worker named after it."""
    code, details = exc.code(), exc.details() or ""
    field, _, problem = details.partition(": ")
    where = f" (worker {worker_id})"
    if code == grpc.StatusCode.INVALID_ARGUMENT and problem:
        return InvalidArgument(field, problem + where)
    if code == grpc.StatusCode.FAILED_PRECONDITION and problem:
        return FailedPrecondition(field, problem + where)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(details + where)
    return Unavailable(f"worker {worker_id}: {code.name}: {details}")
