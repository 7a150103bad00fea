"""Runs one GPU worker: `python -m gpu_worker_svc.server.main [flags]` (or `shardline serve worker`).

Startup order: read the settings; on CPU, restart this process (same pid and arguments) under
malloc settings that keep a step's freed buffers (shardline/core/host_memory.py); then hand over
to serving.py, which loads the engine, serves it and stops it (on SIGTERM, with the running
requests' KV handed to other workers).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from gpu_worker_svc.model.cpu_weight_formats import CPU_WEIGHT_FORMATS
from gpu_worker_svc.server.settings import WorkerSettings, cuda_installed
from shardline.core.host_memory import keep_freed_host_memory, reexec_with_malloc_env
from shardline.core.service_main import run_service
from shardline.core.worker_role import ROLES

log = logging.getLogger("gpu_worker_svc")


def parse_args(argv: list[str] | None) -> WorkerSettings:
    """Flags override the SHARDLINE_* environment; unset flags leave it alone."""
    p = argparse.ArgumentParser(prog="shardline serve worker", description=__doc__, argument_default=argparse.SUPPRESS)
    p.add_argument("--worker-id", dest="worker_id")
    p.add_argument("--port", type=int)
    p.add_argument("--host")
    p.add_argument("--advertise-address", dest="advertise_address")
    p.add_argument("--scheduler", dest="scheduler_address", help="scheduler host:port")
    p.add_argument(
        "--role",
        choices=ROLES,
        help="prefill (computes prompts' KV for decode workers), decode, or both (the default)",
    )
    p.add_argument("--model", help="HF folder, .gguf file or dummy:<shape>; default: SmolLM2-135M-Instruct")
    p.add_argument("--tp", dest="tp_size", type=int, help="tensor-parallel size")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--block-size", dest="block_size", type=int)
    p.add_argument("--kv-cache-bytes", dest="kv_cache_bytes", type=int, help="KV budget per rank on CPU")
    p.add_argument("--gpu-memory-utilization", dest="gpu_memory_utilization", type=float)
    p.add_argument("--max-num-seqs", dest="max_num_seqs", type=int)
    p.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument(
        "--admission-gap-ms",
        dest="admission_gap_ms",
        type=float,
        help="when idle, wait this long for the rest of a burst of requests",
    )
    p.add_argument(
        "--quantization",
        choices=CPU_WEIGHT_FORMATS,
        help="CPU weight format: auto (the default: gguf for a .gguf model on CPU), gguf (a .gguf file's own "
        "blocks), none (the model's dtype, dequantized), int8, fp16 (near-lossless) or int4",
    )
    p.add_argument(
        "--no-onednn-weights",
        dest="onednn_weights",
        action="store_false",
        help="CPU float32: keep torch's F.linear instead of oneDNN-packed weights",
    )
    p.add_argument(
        "--batch-invariant",
        dest="batch_invariant",
        action="store_true",
        help="CPU, int8 or fp32: tokens bitwise independent of batching, prefix caching and resumes (slower)",
    )
    p.add_argument(
        "--async-scheduling",
        dest="async_scheduling",
        action=argparse.BooleanOptionalAction,
        help="launch each decode step before the last one's tokens reach the host (default: on CUDA only)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        dest="num_speculative_tokens",
        type=int,
        help="n-gram speculation: draft tokens per decode, looked up in the request's own text (0: off)",
    )
    p.add_argument(
        "--lora",
        action="append",
        metavar="NAME=PATH",
        help="serve the LoRA adapter in folder PATH (PEFT's format) as model NAME; once per adapter",
    )
    p.add_argument("--max-loras-per-batch", dest="max_loras_per_batch", type=int)
    p.add_argument("--max-lora-rank", dest="max_lora_rank", type=int)
    p.add_argument("--torch-threads", dest="torch_threads", type=int)
    p.add_argument("--metrics-port", dest="metrics_port", type=int)
    p.add_argument("--no-tracing", dest="tracing", action="store_false")
    p.add_argument("--peak-tflops", dest="peak_tflops", type=float, help="one device's peak, for MFU")
    p.add_argument("--peak-bandwidth-gbs", dest="peak_bandwidth_gbs", type=float, help="for MBU")
    args = vars(p.parse_args(argv))
    if "lora" in args:
        args["lora_adapters"] = ",".join(args.pop("lora"))
    return WorkerSettings(**args)


def _host_memory_tuned(s: WorkerSettings, own_process: bool) -> WorkerSettings:
    """On CPU, restart this process under malloc settings that keep a step's freed buffers for the
    next step (shardline/core/host_memory.py: a 16-prompt burst's first token 100-1,300 ms sooner here);
    nothing on a GPU, whose host memory would then keep every weight staged there while loading.
    Only a worker that is its own process restarts: a caller's process would be replaced.

    It runs before torch and the engine are imported (serving.py), which the restart would
    otherwise pay for twice: about 1.5 s of a CPU worker's cold start. So "auto" is told apart
    from the files of torch's build and the GPU driver, not by torch itself."""
    if s.device == "cpu" or (s.device == "auto" and not cuda_installed()):
        if own_process:
            reexec_with_malloc_env()
        keep_freed_host_memory()
    return s


def main(argv: list[str] | None = None, own_process: bool | None = None) -> int:
    """`own_process`: this worker is the program (`shardline serve worker`, `python -m`), so it may
    restart itself; None: so when `argv` is None (the process's own arguments)."""
    own_process = argv is None if own_process is None else own_process
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:  # bad settings, a missing model, a taken port: one line, no traceback
        return run_service("worker", lambda: _serve(argv, own_process))
    except Exception:
        log.exception("worker failed")
        return 1


def _serve(argv: list[str] | None, own_process: bool) -> int:
    settings = _host_memory_tuned(parse_args(argv), own_process)
    # Only now, after a restart that would have paid for it twice: torch and the engine.
    from gpu_worker_svc.server.serving import serve

    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
