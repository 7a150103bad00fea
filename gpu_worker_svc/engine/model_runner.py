"""Runs the tensor-parallel model for one engine step.

Rank 0 lives in the engine's process and decides every step. Ranks 1..N-1 are
child processes that wait on a torch.distributed broadcast of the step's packed
inputs (StepBatch), run their shard, and join the collectives. Step inputs never
travel over gRPC. A rank that dies is reported as EngineDeadError, never a hang.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
from dataclasses import dataclass

import torch

from gpu_worker_svc.engine.cuda_graphs import DecodeGraphs
from gpu_worker_svc.engine.device_staging import DeviceStaging, TokenFetch
from gpu_worker_svc.engine.kv_cache import allocate_kv_cache, calibration_prefill, num_blocks_for, profile_forward
from gpu_worker_svc.engine.outputs import TokenLogprobs
from gpu_worker_svc.engine.rank_spans import RankSpans
from gpu_worker_svc.engine.sampler import token_logprobs
from gpu_worker_svc.model.attention_metadata import AttentionMetadata, StepBatch, build_step
from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.gguf_weights import load_gguf_blocks
from gpu_worker_svc.model.layers.invariant_attention import check_invariant_attention
from gpu_worker_svc.model.layers.onednn import onednn_available
from gpu_worker_svc.model.layers.quantize import pack_fp32_for_onednn, quantize_model
from gpu_worker_svc.model.loader import load_config, load_model, parse_dtype
from gpu_worker_svc.model.lora_adapter import LoraAdapter
from gpu_worker_svc.model.lora_slots import LoraModelSlots
from gpu_worker_svc.model.parallel import TPGroup, destroy_tp_group, init_tp_group
from gpu_worker_svc.model.weight_format import resolve_weight_format
from shardline.core.host_memory import keep_freed_host_memory
from shardline.core.ports import free_port

log = logging.getLogger(__name__)

_STOP = -1
# Prompt rows whose logits are made at once: [rows, vocab] float32 is 50 MB for this model's
# vocabulary, 128 MB for Llama 3's, however long the prompt chunk is.
PROMPT_LOGITS_ROWS = 256


@dataclass(slots=True)
class PromptLogits:
    """Rank 0's side of a step's prompt logprobs (StepBatch.prompt_logits says which rows)."""

    targets: list[int]  # per row: the prompt token that follows it, whose logprob is wanted
    num_top: list[int]  # per row: how many of the most likely tokens to return
    result: list[TokenLogprobs] | None = None  # per row, filled in by the step


@dataclass(slots=True)
class StepInputs:
    """A step's inputs on the rank's device, built from its StepBatch (ShardWorker.prepare)."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # flat-batch rows whose logits are sampled
    prompt_rows: torch.Tensor | None  # rows whose logits give prompt logprobs


class EngineDeadError(RuntimeError):
    """A tensor-parallel rank died or a collective failed; the engine cannot continue."""


@dataclass(slots=True)
class RunnerConfig:
    model: str | None = None  # HF folder or .gguf file; None: the default model
    tp_size: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    cpu_kv_bytes: int = 512 << 20  # KV budget per rank on CPU
    gpu_memory_utilization: float = 0.85
    num_blocks: int | None = None  # fixed block count (tests use tiny caches); None: derived from memory
    max_model_len: int | None = None
    cuda_graphs: bool = True  # capture decode steps on CUDA
    # CPU only: "gguf" (a .gguf file's own Q4_0/Q4_1/Q8_0 blocks, model/gguf_weights.py), "int8" (W8A8),
    # "fp16" or "int4" (layers/quantize.py); "none" or None: the model's dtype; "auto": gguf for a .gguf
    # model on CPU, otherwise none (model/weight_format.py).
    quantization: str | None = "auto"
    onednn_weights: bool = True  # CPU float32 without quantization: oneDNN-packed weights (layers/onednn.py)
    # CPU: attention whose rounding no batch-mate, padding or chunking changes (layers/invariant_attention.py).
    # With int8, whose GEMMs are exact, a request's tokens are then bitwise the same alone, batched,
    # from the prefix cache, after preemption and when resumed.
    batch_invariant: bool = False
    # CPU: tune glibc's malloc for the whole process so that a step's freed buffers are kept for the
    # next one (shardline/core/host_memory.py; the heap then never shrinks). Off: malloc's defaults.
    tune_host_memory: bool = True
    trace_instance: str | None = None  # when set, ranks 1..N-1 export a span per step under this instance id
    profile_tokens: int = 2048  # the largest step's token count, profiled on GPU before sizing the KV cache


def _check_batch_invariance(config: RunnerConfig, quantization: str | None, dtype: torch.dtype) -> None:
    """Refuses batch_invariant where a part of the step would still round a row with its batch."""
    if config.device != "cpu":
        raise ValueError("batch_invariant attention is built from torch's CPU kernels: give device cpu")
    # int8's integer GEMMs are exact; oneDNN's packed fp32 GEMM rounds a row alike at any row count
    # (measured). fp16, int4 and torch's F.linear do not (fp16 and F.linear: ~1e-6 alone vs batched).
    # gguf's kernel is bitwise batch-invariant too (kernels/gguf_linear.cpp); layers of other types use oneDNN's.
    if not (
        quantization == "int8"
        or (quantization in (None, "gguf") and dtype == torch.float32 and config.onednn_weights and onednn_available())
    ):
        mode = quantization or f"{config.dtype} without oneDNN-packed weights"
        raise ValueError(
            f"batch_invariant needs int8 or float32 oneDNN-packed weights: the GEMMs of {mode} "
            f"round a row differently with the number of rows beside it"
        )


class ShardWorker:
    """One rank: its model shard and its slice of the KV cache."""

    def __init__(self, config: RunnerConfig, rank: int, init_method: str) -> None:
        if config.device == "cpu":
            # Ranks share the machine's cores; oversubscribing them makes every collective wait.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tp_size))
            if config.tune_host_memory:  # a step's buffers, freed, are reused rather than faulted in again
                keep_freed_host_memory()
        elif config.device.startswith("cuda"):
            torch.cuda.set_device(rank)
        self.device = config.device if config.device == "cpu" else f"cuda:{rank}"
        self.tp = init_tp_group(rank, config.tp_size, init_method, self.device, ordered=config.batch_invariant)
        self.dtype = parse_dtype(config.dtype, "cpu" if config.device == "cpu" else "cuda")
        self.block_size = config.block_size
        self.batch_invariant = config.batch_invariant
        quantization = resolve_weight_format(config.quantization, config.model, config.device, self.dtype)
        self.weight_format = quantization or "none"  # the weights' form, which the KV it computes depends on
        if self.batch_invariant:
            _check_batch_invariance(config, quantization, self.dtype)
        self.model = load_model(config.model, self.tp, self.dtype, self.device, config.max_model_len)
        if self.batch_invariant and self.model.config.num_experts:
            raise ValueError(
                f"batch_invariant is not supported for {self.model.config.architecture}: its experts' GEMMs "
                f"round a token's row differently with the number of tokens routed beside it"
            )
        # Where the decode kernel takes every query (CPU, float32), each query's result is already
        # its own, bit for bit: batch-invariant attention is the kernel, with the step's usual layout.
        attn = self.model.attention()
        self.invariant_layout = self.batch_invariant and not attn.kernel_takes_every_query(self.device, self.dtype)
        if self.invariant_layout:  # with this rank's own attention shapes
            check_invariant_attention((attn.num_heads, attn.num_kv_heads, attn.head_dim))
        if self.batch_invariant:  # the model's hidden size
            self.model.model.norm.check_paths_agree()
        if quantization is not None and self.device != "cpu":
            raise ValueError(f"quantization {quantization} uses CPU kernels: give device cpu")
        if quantization == "gguf":
            n = load_gguf_blocks(self.model, config.model)
            log.info("rank %d: %d linear layers keep the GGUF file's blocks", rank, n)
        if quantization not in (None, "gguf"):
            n = quantize_model(
                self.model,
                quantization,
                lambda: calibration_prefill(self.model, config.block_size, self.dtype, self.device),
            )
            log.info("rank %d: %d linear layers quantized to %s", rank, n, quantization)
        elif self.device == "cpu" and self.dtype == torch.float32 and config.onednn_weights and onednn_available():
            n = pack_fp32_for_onednn(self.model)  # with gguf: the layers the file has in other types
            log.info("rank %d: %d linear layers packed for oneDNN", rank, n)
        if self.device == "cpu" and self.model.model.fuse_decode():
            log.info("rank %d: plain decode steps run the decoder layers in one C++ call", rank)
        if self.device.startswith("cuda") and config.num_blocks is None:
            profile_forward(self.model, config.profile_tokens, config.block_size, self.dtype, self.device)
        n = config.num_blocks or num_blocks_for(
            self.model, config.block_size, self.dtype, config.device, config.cpu_kv_bytes, config.gpu_memory_utilization
        )
        # Every rank must agree on the block count, so take the smallest any rank can hold.
        agreed = self.tp.all_reduce_min(torch.tensor([n], device=self.device))
        self.num_blocks = int(agreed.item())
        # One extra block past the last is scratch space for padded rows of captured graphs.
        self.kv_caches = allocate_kv_cache(self.model, self.num_blocks + 1, self.block_size, self.dtype, self.device)
        self.graphs = None
        if self.device.startswith("cuda") and config.cuda_graphs and not self.model.captures_decode:
            log.warning("rank %d: %s runs its decode steps without CUDA graphs", rank, self.model.config.architecture)
        elif self.device.startswith("cuda") and config.cuda_graphs:
            max_context = config.max_model_len or min(self.model.config.max_position_embeddings, 8192)
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.num_blocks * self.block_size, max_context)
        self.staging = DeviceStaging(self.device) if self.device.startswith("cuda") else None
        self.lora: LoraModelSlots | None = None  # made when the first adapter is put in a slot
        self._lora_resident: dict[int, LoraAdapter] = {}  # slot -> the adapter in it
        if rank == 0:
            log.info("KV cache: %d blocks of %d tokens per rank", self.num_blocks, self.block_size)

    def prepare(self, batch: StepBatch) -> StepInputs:
        """The step's inputs on this rank's device; a CUDA decode step's in one copy that waits for nothing."""
        # Staged only when all decodes (which never ask for prompt logits): a prefill chunk's mask can
        # be megabytes, best made on the device.
        if self.staging is None or batch.token_ids.numel() != batch.num_new.numel() or batch.prompt_logits is not None:
            positions, meta = build_step(batch, self.block_size, self.device, self.invariant_layout)
            prompt_rows = batch.prompt_logit_rows().to(self.device) if batch.prompt_logits is not None else None
            dev = self.device
            return StepInputs(batch.token_ids.to(dev), positions, meta, batch.logit_rows().to(dev), prompt_rows)
        # Built on the host (a CUDA graph takes the decodes as one group), then moved at once.
        positions, meta = build_step(batch, self.block_size, "cpu", self.invariant_layout, group_decodes=False)
        fields = meta.tensors()
        moved = self.staging.to_device([batch.token_ids, positions, batch.logit_rows(), *(t for _, t in fields)])
        meta.replace_tensors([(key, t) for (key, _), t in zip(fields, moved[3:])])
        token_ids, positions, last = moved[:3]
        return StepInputs(token_ids, positions, meta, last, None)

    def write_lora_slot(self, slot: int, adapter: LoraAdapter, num_slots: int) -> None:
        """Puts `adapter` in LoRA slot `slot` (1..num_slots) of the model, in place of the one there."""
        if self.lora is None or adapter.rank > self.lora.rank:
            # Slots hold the highest rank seen: a higher one gets new slots, the residents written again.
            rank = max(adapter.rank, self.lora.rank if self.lora is not None else 0)
            if self.lora is not None:
                self.lora.detach()
            self.lora = LoraModelSlots(self.model, self.model.config, num_slots, rank, self.dtype, self.device)
            for resident_slot, resident in self._lora_resident.items():
                if resident_slot != slot:
                    self.lora.write(resident_slot, resident)
        self.lora.write(slot, adapter)
        self._lora_resident[slot] = adapter

    @contextlib.contextmanager
    def _adapters_selected(self, batch: StepBatch):
        """Each token's LoRA adapter, for the layers, while the step's forward runs."""
        select = batch.lora_select(self.dtype, self.device) if self.lora is not None else None
        if select is None or self.lora is None:
            yield
            return
        self.lora.step.select = select
        try:
            yield
        finally:
            self.lora.step.select = None

    def fetch(self, tokens: torch.Tensor) -> TokenFetch:
        """Starts bringing sampled token ids to the host, ahead of work queued after them."""
        return self.staging.start_fetch(tokens) if self.staging is not None else TokenFetch.ready(tokens)

    @torch.inference_mode()
    def step(
        self,
        batch: StepBatch,
        prompt: PromptLogits | None = None,
        inputs: StepInputs | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Logits of each sequence's last new token, [B, vocab] on rank 0; None elsewhere.

        Rank 0 also fills `prompt.result` when the batch asks for prompt logits. `inputs`: the
        batch's prepare(), made earlier; `input_ids`: its token ids, already on the device.
        """
        # Every op that takes a packed (torchbind) weight (fbgemm's int8 and fp16 GEMMs) asks that
        # weight for __torch_function__, and the lookup fails by throwing and catching a C++
        # exception: ~15 us a call, 121 calls a step. No tensor subclass runs here, so the step
        # skips those checks: 1.14x per decode step at batch 1, 1.07x at 16 (int8).
        with torch._C.DisableTorchFunctionSubclass(), self._adapters_selected(batch):
            return self._step(prompt, inputs or self.prepare(batch), input_ids)

    def _step(
        self, prompt: PromptLogits | None, inputs: StepInputs, input_ids: torch.Tensor | None
    ) -> torch.Tensor | None:
        input_ids = inputs.token_ids if input_ids is None else input_ids
        # A captured graph knows no LoRA: a step with adapters runs eagerly.
        graphs = self.graphs if self.lora is None or not self.lora.step.active else None
        hidden = graphs.run(input_ids, inputs.positions, inputs.meta) if graphs is not None else None
        if hidden is None:
            hidden = self.model(input_ids, inputs.positions, inputs.meta, self.kv_caches)
        # The sampled rows go through the LM head alone, as they would without prompt rows: a GEMM's
        # rounding may depend on its row count, and sampling must not depend on a batch-mate's options.
        logits = self.model.compute_logits(hidden[inputs.logit_rows])
        if inputs.prompt_rows is not None:
            self._prompt_logprobs(hidden, inputs.prompt_rows, prompt)
        return None if logits is None else logits.float()

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: torch.Tensor, prompt: PromptLogits | None) -> None:
        """Every rank runs the LM head's collective over the same slices; rank 0 keeps the logprobs."""
        result: list[TokenLogprobs] = []
        for start in range(0, rows.numel(), PROMPT_LOGITS_ROWS):
            logits = self.model.compute_logits(hidden[rows[start : start + PROMPT_LOGITS_ROWS]])
            if logits is not None and prompt is not None:
                end = start + logits.shape[0]
                result += token_logprobs(
                    torch.log_softmax(logits.float(), dim=-1), prompt.targets[start:end], prompt.num_top[start:end]
                )
        if prompt is not None:
            prompt.result = result


def _rank_main(config: RunnerConfig, rank: int, init_method: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    worker = ShardWorker(config, rank, init_method)
    spans = RankSpans(config.trace_instance, rank)
    header = torch.zeros(4, dtype=torch.long, device=worker.device)
    try:
        while True:
            worker.tp.broadcast(header)
            if int(header[0]) == _STOP:
                break
            packed = torch.empty(StepBatch.packed_size(header.cpu()), dtype=torch.long, device=worker.device)
            worker.tp.broadcast(packed)
            batch = StepBatch.unpack(packed.cpu())
            with spans.step(batch):
                worker.step(batch)
    except RuntimeError as exc:  # rank 0 went away: nothing left to serve
        log.error("rank %d stopping: %s", rank, exc)
    finally:
        destroy_tp_group(worker.tp)
        spans.shutdown()


class ModelRunner:
    """Rank 0's handle on the tensor-parallel group."""

    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        self.model_config: ModelConfig = load_config(config.model)
        self.model_config.check_tp(config.tp_size)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self._children = [
            ctx.Process(target=_rank_main, args=(config, r, init_method), daemon=True, name=f"shardline-rank{r}")
            for r in range(1, config.tp_size)
        ]
        for p in self._children:
            p.start()
        self._dead = threading.Event()
        if self._children:
            threading.Thread(target=self._watch_children, daemon=True, name="rank-watch").start()
        try:
            self._shard = ShardWorker(config, 0, init_method)
        except BaseException:
            # A failed load (a bad checkpoint) must not leave this process in the process group,
            # or the next runner here cannot start one, nor leave ranks waiting on a collective.
            self._closing = True
            destroy_tp_group(TPGroup(0, config.tp_size))
            for p in self._children:
                p.kill()
                p.join(timeout=10)
            raise
        self.num_blocks = self._shard.num_blocks
        self.block_size = config.block_size

    def local_kv_caches(self) -> list[torch.Tensor]:
        """Rank 0's KV cache, one [2, blocks, block_size, kv heads, head_dim] tensor per layer.

        Only with TP 1: the other ranks' shards live in their own processes, and moving them
        would need a collective that no step expects yet.
        """
        if self._children:
            raise ValueError(
                f"tp_size: KV transfer needs tp_size 1 (each rank holds a shard), got {self.config.tp_size}"
            )
        return self._shard.kv_caches

    def write_lora_slot(self, slot: int, adapter: LoraAdapter, num_slots: int) -> None:
        """Puts `adapter` in LoRA slot `slot` of the model (ValueError at tp_size above 1)."""
        if self._children:
            raise ValueError(f"tp_size: LoRA adapters are served at tp_size 1, got {self.config.tp_size}")
        self._shard.write_lora_slot(slot, adapter, num_slots)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's element type."""
        return self._shard.dtype

    @property
    def weight_format(self) -> str:
        """The weights as loaded: "gguf", "int8", "fp16", "int4" or "none" (the model's dtype)."""
        return self._shard.weight_format

    @property
    def kv_heads(self) -> tuple[int, int]:
        """(KV heads on this rank, head_dim)."""
        attn = self._shard.model.attention()
        return attn.num_kv_heads, attn.head_dim

    def _watch_children(self) -> None:
        sentinels = {p.sentinel: p for p in self._children}
        ready = mp.connection.wait(list(sentinels))
        if not getattr(self, "_closing", False):
            p = next(p for sentinel, p in sentinels.items() if sentinel in ready)
            p.join(timeout=1.0)  # reaps it: its exit code (or -signal) is known only once it is reaped
            log.error("tensor-parallel rank %s died with exit code %s", p.name, p.exitcode)
            self._dead.set()

    @property
    def is_dead(self) -> bool:
        """A rank has died: the next step would fail."""
        return self._dead.is_set()

    @property
    def rows_independent(self) -> bool:
        """A row's logits do not depend on the rest of its batch, bit for bit: on CUDA, where results
        are not batch-invariant anyway, or under batch-invariant attention on CPU."""
        return self._shard.staging is not None or self.config.batch_invariant

    def prepare(self, batch: StepBatch) -> StepInputs:
        """Rank 0's inputs for `batch`, built ahead of its execute()."""
        return self._shard.prepare(batch)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A small CPU tensor on rank 0's device, copied without waiting for the device."""
        staging = self._shard.staging
        return staging.to_device([t])[0] if staging is not None else t.to(self._shard.device)

    def fetch(self, tokens: torch.Tensor) -> TokenFetch:
        """Starts bringing sampled token ids to the host (see ShardWorker.fetch)."""
        return self._shard.fetch(tokens)

    def execute(
        self,
        batch: StepBatch,
        prompt: PromptLogits | None = None,
        inputs: StepInputs | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one step on every rank; returns [B, vocab] float32 logits (and fills `prompt.result`).

        `inputs`: prepare(batch), made earlier. `input_ids`: the token ids on rank 0's device, in
        place of batch.token_ids (the tokens a step sampled, not yet on the host: lookahead.py).
        """
        if self._dead.is_set():
            raise EngineDeadError("a tensor-parallel rank died")
        try:
            if self._children:
                packed = batch.pack().to(self._shard.device)
                if input_ids is not None:
                    packed[4 : 4 + input_ids.numel()].copy_(input_ids)
                self._shard.tp.broadcast(packed[:4].clone())
                self._shard.tp.broadcast(packed)
            logits = self._shard.step(batch, prompt, inputs, input_ids)
        except RuntimeError as exc:
            if self._children:
                raise EngineDeadError(f"tensor-parallel step failed: {exc}") from exc
            raise
        assert logits is not None
        return logits

    def shutdown(self) -> None:
        self._closing = True
        if self._children and not self._dead.is_set():
            try:
                stop = torch.tensor([_STOP, 0, 0, 0], dtype=torch.long, device=self._shard.device)
                self._shard.tp.broadcast(stop)
            except RuntimeError:
                pass
        for p in self._children:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        destroy_tp_group(self._shard.tp)
