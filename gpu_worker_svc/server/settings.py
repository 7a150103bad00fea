"""The one place where the worker service reads its environment."""

from __future__ import annotations

import importlib.util
import re
import socket
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpu_worker_svc.model.cpu_weight_formats import CPU_WEIGHT_FORMATS
from shardline.core.worker_role import WorkerRole


class WorkerSettings(BaseSettings):
    """Worker knobs, from ``SHARDLINE_<FIELD>`` environment variables or `main`'s flags."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_", env_ignore_empty=True)

    # Unique id the scheduler knows this worker by; None: worker-<host>-<port>.
    worker_id: str | None = None
    # Port of the Worker gRPC service; 0 picks a free one (then give worker_id too).
    port: int = Field(50060, ge=0, le=65535)
    # Interface the gRPC server binds.
    host: str = "0.0.0.0"
    # host:port the scheduler dials for the Session; None: 127.0.0.1:<bound port>.
    advertise_address: str | None = None
    # The scheduler's gRPC address, for RegisterWorker and Heartbeat.
    scheduler_address: str = "localhost:50053"
    # What this worker does (docs/kv_transfer.md#worker-roles): prefill (computes long prompts' KV for
    # decode workers, runs no request), decode (runs requests, long prompts prefilled elsewhere when a
    # prefill worker is up) or both (runs requests and prefills them itself).
    role: WorkerRole = "both"
    # HF folder or .gguf file; None: the default model.
    model: str | None = None
    # Ranks in the tensor-parallel group (processes on this machine).
    tp_size: int = Field(1, ge=1)
    # float32, bfloat16 or float16; None: float32 on CPU, bfloat16 on CUDA.
    dtype: str | None = None
    # "auto" (cuda when available), "cpu" or "cuda".
    device: str = "auto"
    # Tokens per KV-cache block.
    block_size: int = Field(16, ge=1)
    # KV-cache budget per rank on CPU, in bytes.
    kv_cache_bytes: int = Field(512 << 20, gt=0)
    # Share of GPU memory the model and KV cache may use.
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    # Most requests running at once.
    max_num_seqs: int = Field(64, ge=1)
    # Token budget of one engine step.
    max_num_batched_tokens: int = Field(2048, ge=1)
    # Requests of this priority or more are background work (batch jobs run at 100): while any other
    # request runs or waits, at most background_max_seqs of them run. None: no request is background.
    background_priority: int | None = 100
    background_max_seqs: int = Field(4, ge=0)
    # ...and for this long after the last other request left, the next one a client sends being on its way.
    background_grace_s: float = Field(2.0, ge=0)
    # Reuse KV blocks across requests that share a prompt prefix.
    enable_prefix_caching: bool = True
    # When idle, wait until no request has arrived for this long (at most 10 such gaps, and never once
    # the step is full) before the first step; None: 20 ms on CPU, 0 on CUDA. A CPU prefill step takes
    # seconds, so a request that misses it waits seconds; and a closed-loop client's next burst reaches
    # the worker spread over tens of ms (the previous burst's last tokens are relayed first): at 5 ms,
    # `shardline bench` saw 2 of 3 such bursts split, one request alone and 15 a whole step later.
    admission_gap_ms: float | None = Field(None, ge=0)
    # CPU weight format (gpu_worker_svc/model/layers/quantize.py): "auto" (gguf for a .gguf model on CPU,
    # otherwise none; model/weight_format.py), "gguf" (a .gguf model's own Q4_0/Q4_1/Q8_0 blocks,
    # model/gguf_weights.py), "none" (the model's dtype: a .gguf file dequantized to fp32, the parity
    # reference), "int8" (W8A8 with smoothing), "fp16" (fp16 weights, fp32 math, near-lossless) or
    # "int4" (weight-only).
    quantization: str = "auto"
    # float32 on CPU without quantization: reorder the weights once for oneDNN's GEMM (~1.3x faster decode
    # steps, same arithmetic; gpu_worker_svc/model/layers/onednn.py). Off: torch's F.linear.
    onednn_weights: bool = True
    # CPU, int8 or fp32 oneDNN weights: batch-invariant attention (model/layers/invariant_attention.py)
    # and rank-ordered TP sums. A request's tokens and logprobs are then bitwise the same alone or
    # batched, from the prefix cache or not, and resumed on another worker of the same CPU type;
    # ~10% fewer tokens/s with short prompts, ~35% with 2048-token ones (docs/benchmarks.md).
    batch_invariant: bool = False
    # N-gram speculation (engine/ngram_proposer.py): up to this many draft tokens per decode, looked up
    # in the request's own prompt and output, checked in the same step; 0: off. The tokens are those
    # of decoding one by one (bitwise so with batch_invariant; otherwise a near-tie may round the other
    # way, as batching may). Text that repeats its context (code edits, quotes) runs several tokens a
    # step; at high batch on CPU the drafts' compute eats the gain (docs/benchmarks.md).
    num_speculative_tokens: int = Field(0, ge=0, le=16)
    # LoRA adapters served from the start, as NAME=PATH items separated by commas (the flag: --lora
    # NAME=PATH, once per adapter); a request names one as its model (docs/lora.md). PATH is a folder in
    # PEFT's format. An adapter that fails its checks is logged and left out; the worker serves on.
    lora_adapters: str = ""
    # Most LoRA adapters among the requests running at once (each takes a slot of the model's); a
    # request of another adapter waits for one to leave.
    max_loras_per_batch: int = Field(4, ge=1)
    # Highest rank a LoRA adapter may have.
    max_lora_rank: int = Field(64, ge=1)
    # Async scheduling (engine/lookahead.py): each decode step is launched on the device before the last
    # one's tokens reach the host, so the host's work hides behind the GPU's (H200, Llama-3.2-1B shape,
    # batch 64: 2.66 ms a step against 3.59). The same tokens. None: on CUDA only (on CPU the model and
    # the host share the cores, and a dropped launch is a step run twice).
    async_scheduling: bool | None = None
    # On SIGTERM, how long the scheduler may take to move this worker's requests with their KV blocks
    # (Scheduler.DrainWorker) before the worker aborts them and exits; the requests not handed off by
    # then re-prefill elsewhere. Under docker's default 10 s stop timeout, with room for the exit. 0: no
    # hand-off, the requests re-prefill as after a crash.
    stop_handoff_s: float = Field(5.0, ge=0)
    # Torch intra-op threads of rank 0; 0 leaves the engine's choice (cores / tp_size).
    torch_threads: int = Field(0, ge=0)
    # Port of the Prometheus /metrics endpoint; 0: not served.
    metrics_port: int = Field(0, ge=0, le=65535)
    # Record and export spans (SHARDLINE_TRACING=0 turns them off).
    tracing: bool = True
    # Peak dense FLOP/s and memory bandwidth of one device, for MFU/MBU;
    # None: H200 figures on CUDA, the CPU figures below on CPU.
    peak_tflops: float | None = Field(None, gt=0)
    peak_bandwidth_gbs: float | None = Field(None, gt=0)
    # A few AVX2/AVX-512 cores: rough figures, override them for your machine.
    cpu_peak_tflops: float = Field(0.5, gt=0)
    cpu_peak_bandwidth_gbs: float = Field(20.0, gt=0)

    @field_validator("quantization")
    @classmethod
    def _known_quantization(cls, quantization: str) -> str:
        if quantization not in CPU_WEIGHT_FORMATS:
            raise ValueError(f"must be one of {', '.join(CPU_WEIGHT_FORMATS)}")
        return quantization

    @field_validator("lora_adapters")
    @classmethod
    def _adapter_items(cls, adapters: str) -> str:
        _adapter_paths(adapters)
        return adapters

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError('must be "auto", "cpu" or "cuda"')
        if device == "cuda" and not _torch_sees_cuda():
            raise ValueError("is cuda, but torch sees no CUDA device here")
        return device

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if _torch_sees_cuda() else "cpu"
        return self.device

    @property
    def resolved_dtype(self) -> str:
        if self.dtype:
            return self.dtype
        return "float32" if self.resolved_device == "cpu" else "bfloat16"

    @property
    def resolved_lora_adapters(self) -> dict[str, str]:
        """lora_adapters as name -> folder, in the order given."""
        return _adapter_paths(self.lora_adapters)

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"worker-{socket.gethostname()}-{self.port}"

    @property
    def resolved_admission_gap_s(self) -> float:
        if self.admission_gap_ms is not None:
            return self.admission_gap_ms / 1000
        return 0.020 if self.resolved_device == "cpu" else 0.0

    def address(self, bound_port: int) -> str:
        """Where the scheduler reaches this worker; `bound_port` matters when port is 0."""
        if self.advertise_address:
            return self.advertise_address
        # The container's or pod's own IP: 127.0.0.1 is unreachable from a scheduler in another
        # container, and a pod's hostname does not resolve in DNS for a Deployment.
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
        return f"{host}:{bound_port}"


def _torch_sees_cuda() -> bool:
    import torch  # here, not at the top: main.py reads the settings before it may restart

    return torch.cuda.is_available()


def cuda_installed() -> bool:
    """Whether "auto" may find a GPU, told without importing torch (seconds): a CUDA or ROCm build
    of torch, and a loaded NVIDIA or AMD GPU driver. Where it is wrong, a worker on CPU only
    misses its malloc settings (main.py), and resolved_device still asks torch itself."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    build = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    gpu_build = re.search(r"^(cuda|hip)\b[^=]*=\s*['\"]", build, re.MULTILINE) is not None
    return gpu_build and (Path("/proc/driver/nvidia/version").exists() or Path("/dev/kfd").exists())


def _adapter_paths(adapters: str) -> dict[str, str]:
    """NAME=PATH items separated by commas, as a dict; ValueError naming a malformed or repeated one."""
    paths: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in adapters.split(","))):
        name, sep, path = (x.strip() for x in item.partition("="))
        if not sep or not name or not path:
            raise ValueError(f"{item!r}: each adapter is NAME=PATH")
        if name in paths:
            raise ValueError(f"{name!r} is named twice")
        paths[name] = path
    return paths
