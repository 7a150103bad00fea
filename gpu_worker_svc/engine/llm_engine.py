"""The in-process engine: continuous batching over the paged KV cache.

Each `step()` is schedule → run the tensor-parallel model → sample → update.
A worker service wraps it; `generate()` makes it usable offline, like vLLM's LLM.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpu_worker_svc.engine.batch_scheduler import BatchScheduler, SchedulerConfig, SchedulerOutput
from gpu_worker_svc.engine.block_pool import BlockPool
from gpu_worker_svc.engine.grammar import GrammarBackend
from gpu_worker_svc.engine.kv_transfer import ImportResult, KvBlocks, KvLayout, KvTransfer, config_fingerprint
from gpu_worker_svc.engine.lookahead import Lookahead
from gpu_worker_svc.engine.lora_adapters import LoraAdapters
from gpu_worker_svc.engine.model_runner import ModelRunner, PromptLogits, RunnerConfig
from gpu_worker_svc.engine.ngram_proposer import NgramIndex, SpeculativeConfig
from gpu_worker_svc.engine.outputs import GenerationResult, RequestOutput, StepResult, TokenLogprobs
from gpu_worker_svc.engine.sampler import Sampler, select_rows
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.engine.sequence import Sequence
from gpu_worker_svc.engine.step_stats import step_stats
from gpu_worker_svc.model.attention_metadata import StepBatch
from gpu_worker_svc.model.dummy import is_dummy
from gpu_worker_svc.model.loader import rotary_positions
from gpu_worker_svc.model.lora_adapter import DEFAULT_MAX_LORA_RANK, LoraAdapter, LoraAdapterInUse
from shardline.core.model_path import model_name, resolve_model_path

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineConfig:
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # n-gram speculation; off by default
    # Launch each decode step before the last one's tokens reach the host (lookahead.py). None: on
    # CUDA only; on CPU the host and the model share the cores, and the step would only run twice.
    async_scheduling: bool | None = None
    # The highest LoRA rank an adapter may have (scheduler.max_loras_per_batch: how many run at once).
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.config.speculative.validate()
        self.runner = ModelRunner(self.config.runner)
        self.model_config = self.runner.model_config
        self.block_pool = BlockPool(self.runner.num_blocks, self.runner.block_size, self.config.enable_prefix_caching)
        self.scheduler = BatchScheduler(self.config.scheduler, self.block_pool)
        self.sampler = Sampler()
        on_gpu = self.config.runner.device.startswith("cuda")
        use_lookahead = on_gpu if self.config.async_scheduling is None else self.config.async_scheduling
        self.lookahead = Lookahead(self.runner, self.block_pool, use_lookahead)
        self.eos_token_id = self.model_config.eos_token_ids[0] if self.model_config.eos_token_ids else None
        # The longest sequence it can hold: the rotary table, and what the batch scheduler can run.
        self.max_model_len = min(
            rotary_positions(self.model_config, self.config.runner.max_model_len), self.scheduler.longest_sequence
        )
        self._aborted: list[RequestOutput] = []
        self._step = 0
        self._grammar: GrammarBackend | None = None  # built by the first structured output request
        self._grammar_error: str | None = None  # why it could not be built: said once, then repeated
        self._grammar_lock = threading.Lock()  # a worker's compile threads may ask for it all at once
        self._transfer: KvTransfer | None = None  # built by the first export or import
        self.loras = LoraAdapters(
            self.runner,
            self.model_config,
            self.config.scheduler.max_loras_per_batch,
            self.config.max_lora_rank,
            self.config.runner.tp_size,
        )

    @property
    def grammar_error(self) -> str | None:
        """Why structured output cannot work here, once a build of its backend failed."""
        return self._grammar_error

    @property
    def grammar_loaded(self) -> bool:
        """grammar_backend() answers at once: the backend is built, or known not to build."""
        return self._grammar is not None or self._grammar_error is not None

    def grammar_backend(self) -> GrammarBackend:
        """Structured output's grammar compiler for this model; built on first use (about 2.5 s here:
        the grammar engine's import and an index of the vocabulary), ValueError when it cannot be.
        Safe to call from any thread: one builds it, the others wait for that build."""
        if self._grammar is not None:
            return self._grammar
        with self._grammar_lock:
            return self._build_grammar_backend()

    def _build_grammar_backend(self) -> GrammarBackend:
        if self._grammar_error is not None:
            raise ValueError(self._grammar_error)
        if self._grammar is None:
            try:
                if is_dummy(self.config.runner.model):
                    raise ValueError("structured_output: a dummy model has no tokenizer to constrain")
                self._grammar = GrammarBackend.for_model(
                    self.config.runner.model, self.model_config.vocab_size, list(self.model_config.eos_token_ids)
                )
            except ValueError as exc:
                self._grammar_error = str(exc)
                raise
            except Exception as exc:  # the grammar engine's own failure: refuse constraints, serve the rest
                log.exception("structured output failed to load")
                self._grammar_error = f"structured_output: the grammar engine failed to load ({exc})"
                raise ValueError(self._grammar_error) from None
        return self._grammar

    # -- requests -----------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        output_token_ids: list[int] | None = None,
        eos_token_id: int | None = None,
        compiled_grammar: Any = None,
        adapter: str | None = None,
    ) -> None:
        """Queue a request. `output_token_ids` resumes it after tokens it already generated.
        `compiled_grammar`: grammar_backend().compile(params.structured_output), done beforehand
        (a worker compiles off its step thread); None compiles here, or takes it from the cache.

        The caller checked the request (`gpu_worker_svc/server/request_params.py: check_request`):
        its values, its token ids and its length. Only its structured output raises ValueError
        here, when it does not compile or does not accept `output_token_ids`; nothing else in the
        batch is hurt. With `eos_token_id` None the model's EOS ends it, and its other EOS ids
        (Llama 3's <|eot_id|>) stop it like stop tokens, unless params.ignore_eos. `adapter`: the
        name of the LoRA adapter it runs with (UnknownAdapterError when none is loaded by that
        name); None: the base model.
        """
        root = self.loras.root_of(adapter) if adapter is not None else None
        # The seed (fixed at admission, so a resume samples the same tokens) is the BatchScheduler's,
        # on a copy: the caller's params may serve other requests.
        params = dataclasses.replace(params or SamplingParams())
        output_token_ids = list(output_token_ids or [])
        assert len(prompt_token_ids) + params.max_tokens <= self.max_model_len, "unchecked request"
        if eos_token_id is None and not params.ignore_eos:
            params.stop_token_ids = [
                *params.stop_token_ids,
                *(t for t in self.model_config.eos_token_ids[1:] if t not in params.stop_token_ids),
            ]
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            params,
            priority=priority,
            eos_token_id=self.eos_token_id if eos_token_id is None else eos_token_id,
            output_token_ids=output_token_ids,
            adapter=adapter,
            chain_root=root,
        )
        if params.structured_output is not None:
            seq.grammar = self.grammar_backend().matcher(
                params.structured_output, output_token_ids, compiled=compiled_grammar
            )
        self.scheduler.add(seq)

    def abort_request(self, request_id: str, report: bool = True) -> bool:
        """Stop a request at once and free its blocks; the next step reports it as aborted.

        `report=False` skips that final output, for a request whose owner is gone
        (the same id may be re-added at once, and must not receive the old abort).
        """
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        if report:
            self._aborted.append(
                RequestOutput(
                    request_id,
                    [],
                    seq.num_output_tokens,
                    None,
                    "abort",
                    seq.num_prompt_tokens,
                    seq.num_cached_prompt_tokens or 0,
                )
            )
        return True

    # -- LoRA adapters (lora_adapters.py): call between steps, on the engine's thread -------------
    def add_lora(self, name: str, path: str | Path) -> LoraAdapter:
        """Serves the PEFT adapter in folder `path` as `name` (LoraAdapterError: refused, nothing
        changed, the engine serves on). A name already served is replaced when no request uses it."""
        adapter = self.loras.read(name, path)
        self.serve_lora(adapter)
        return adapter

    def serve_lora(self, adapter: LoraAdapter) -> None:
        """Serves an adapter read beforehand (loras.read, off the engine's thread) by its name."""
        self._check_unused(adapter.name)
        self.loras.put(adapter)

    def remove_lora(self, name: str) -> bool:
        """Stops serving adapter `name`; False when it is not served (LoraAdapterInUse while in use)."""
        self._check_unused(name)
        return self.loras.remove(name)

    def _check_unused(self, name: str) -> None:
        users = sum(1 for seq in [*self.scheduler.running, *self.scheduler.waiting] if seq.adapter == name)
        if users:
            raise LoraAdapterInUse(
                name, "lora_name", f"in use by {users} request(s); replace or unload it once they end"
            )

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._aborted)

    @property
    def is_dead(self) -> bool:
        """A tensor-parallel rank died: the next step would raise EngineDeadError.

        Lets an idle worker notice a lost rank without waiting for a request to fail.
        """
        return self.runner.is_dead

    # -- the loop -----------------------------------------------------------
    def step(self) -> StepResult:
        t0 = time.perf_counter()
        if self.config.speculative.enabled:
            self._propose_drafts()
        sched = self.scheduler.schedule()
        out = StepResult(outputs=self._aborted)
        self._aborted = []
        if sched.scheduled:
            # Admission sets num_computed_tokens to the prefix-cache hit; a running
            # sequence has computed at least one token past it.
            out.admitted_ids = [
                s.seq.request_id for s in sched.scheduled if s.seq.num_computed_tokens == s.seq.num_cached_tokens
            ]
            starts = [s.seq.num_computed_tokens for s in sched.scheduled]
            logits = self.lookahead.take(sched)  # launched by the previous step, or None
            if logits is None:
                batch, prompt = self._step_batch(sched)
                logits = self.runner.execute(batch, prompt)
                if prompt is not None:
                    self._keep_prompt_logprobs(sched, batch, prompt)
            # Built while the device runs this step; launched on its tokens before the host waits for them.
            # (Not with n-gram speculation: its next step's drafts are unknown until this step's tokens are.)
            next_step = None if self.config.speculative.enabled else self.lookahead.prepare(sched, self._step + 1)
            if next_step is None:
                outputs = self._postprocess(sched, logits)
            else:
                tokens = self.sampler.token_ids(logits, [s.seq for s in sched.scheduled])
                outputs = self._outputs(sched, self.lookahead.launch(next_step, tokens), {})
            out.outputs += outputs
            out.stats = step_stats(sched, starts, outputs, time.perf_counter() - t0, self._step, self.scheduler)
        else:
            self.lookahead.drop()
        self._step += 1
        return out

    def _propose_drafts(self) -> None:
        """Each running decode's draft tokens for this step (n-gram lookup), where it may have any.
        Every other running sequence has none: schedule() uses up or drops a step's drafts."""
        spec = self.config.speculative
        for seq in self.scheduler.running:
            params = seq.params
            # The token sampled after the drafts counts toward max_tokens too.
            if seq.num_tokens - seq.num_computed_tokens != 1 or not seq.output_token_ids or seq.error is not None:
                continue
            k = min(spec.num_speculative_tokens, params.max_tokens - seq.num_output_tokens - 1)
            if k <= 0:
                continue
            if seq.ngram_index is None:
                seq.ngram_index = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
            drafts = seq.ngram_index.propose(seq.all_token_ids, k)
            if drafts and seq.grammar is not None:  # a draft the grammar refuses could never be kept
                drafts = drafts[: seq.grammar.valid_prefix(drafts)]
            seq.draft_token_ids = drafts

    def _step_batch(self, sched: SchedulerOutput) -> tuple[StepBatch, PromptLogits | None]:
        ids: list[int] = []
        tables = []
        prompt_rows: list[int] = []  # per sequence: leading new tokens whose logits give prompt logprobs
        prompt = PromptLogits([], [])
        for s in sched.scheduled:
            c = s.seq.num_computed_tokens
            ids += s.seq.all_token_ids[c : c + s.num_new_tokens - len(s.draft_token_ids)] + s.draft_token_ids
            tables.append(s.seq.block_ids)
            # Row c + j predicts prompt token c + j + 1; the prompt's last row predicts the first output.
            k = min(s.num_new_tokens, s.seq.num_prompt_tokens - 1 - c) if s.seq.wants_prompt_logprobs else 0
            prompt_rows.append(max(k, 0))
            if k > 0:
                prompt.targets += s.seq.prompt_token_ids[c + 1 : c + 1 + k]
                prompt.num_top += [s.seq.params.prompt_logprobs or 0] * k
        width = max(len(t) for t in tables)
        batch = StepBatch(
            token_ids=torch.tensor(ids, dtype=torch.long),
            num_computed=torch.tensor([s.seq.num_computed_tokens for s in sched.scheduled], dtype=torch.long),
            num_new=torch.tensor([s.num_new_tokens for s in sched.scheduled], dtype=torch.long),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long),
            step=self._step,
            prompt_logits=torch.tensor(prompt_rows, dtype=torch.long) if prompt.targets else None,
            num_logits=(
                torch.tensor([1 + len(s.draft_token_ids) for s in sched.scheduled], dtype=torch.long)
                if any(s.draft_token_ids for s in sched.scheduled)
                else None
            ),
            lora_slots=self._lora_slots(sched),
        )
        return batch, (prompt if prompt.targets else None)

    def _lora_slots(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """Each scheduled sequence's adapter slot (StepBatch.lora_slots), its adapter made resident."""
        adapters = [s.seq.adapter for s in sched.scheduled]
        if not any(adapters):
            return None
        return torch.tensor(self.loras.slots_for(adapters), dtype=torch.long)

    @staticmethod
    def _keep_prompt_logprobs(sched: SchedulerOutput, batch: StepBatch, prompt: PromptLogits) -> None:
        """Files each sequence's share of the step's prompt logprobs at its place in the prompt."""
        results = iter(prompt.result or [])
        assert batch.prompt_logits is not None  # a step with prompt logprobs to keep asked for them
        for s, k in zip(sched.scheduled, batch.prompt_logits.tolist()):
            if k:
                # A recompute after preemption redoes positions it had: the later values replace them.
                del s.seq.prompt_logprobs[s.seq.num_computed_tokens :]
                s.seq.prompt_logprobs += [next(results) for _ in range(k)]

    def _postprocess(self, sched: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        # Logits rows: one per scheduled sequence, and one more per draft token (after each draft).
        rows: list[int] = []
        follows: list[list[int]] = []  # per row: the drafts it follows
        owners: list[int] = []
        row = 0
        for i, s in enumerate(sched.scheduled):
            n = 1 + len(s.draft_token_ids)
            if s.needs_sample:
                rows += range(row, row + n)
                follows += [s.draft_token_ids[:k] for k in range(n)]
                owners += [i] * n
            row += n
        sampled: list[int | list[int] | None] = [None] * len(sched.scheduled)
        sample_logprobs: dict[str, list[TokenLogprobs | None]] = {}
        if rows:
            seqs = [sched.scheduled[i].seq for i in owners]
            result = self.sampler(select_rows(logits, rows), seqs, follows if any(follows) else None)
            for i, seq, before, tok, lp in zip(owners, seqs, follows, result.token_ids, result.logprobs):
                k = len(before)
                if k == 0:
                    sampled[i], sample_logprobs[seq.request_id] = [tok], [lp]
                    continue
                kept = sampled[i]
                assert isinstance(kept, list)
                # The token sampled after draft k counts only if drafts 1..k were each the token
                # sampled in their place: then they are what decoding one by one would have given.
                if len(kept) == k and kept[-1] == sched.scheduled[i].draft_token_ids[k - 1]:
                    kept.append(tok)
                    sample_logprobs[seq.request_id].append(lp)
        return self._outputs(sched, sampled, sample_logprobs)

    def _outputs(
        self,
        sched: SchedulerOutput,
        sampled: abc.Sequence[int | list[int] | None],
        sample_logprobs: dict[str, list[TokenLogprobs | None]],
    ) -> list[RequestOutput]:
        """Applies the step's tokens (per scheduled sequence, as scheduler.update takes them)."""
        update = self.scheduler.update(sched, sampled)
        outputs = []
        for seq, toks in update.new_tokens:
            lps = sample_logprobs.get(seq.request_id, [])[: len(toks)]
            output = RequestOutput(
                seq.request_id,
                toks,
                seq.num_output_tokens - len(toks),
                lps if lps and lps[0] is not None else None,  # type: ignore[arg-type]
                seq.finish_reason if seq.is_finished else None,
                seq.num_prompt_tokens,
                seq.num_cached_prompt_tokens or 0,
            )
            if seq.error is not None:  # its token was refused: it is no output
                output.new_token_ids, output.logprobs, output.error = [], None, seq.error
            if seq.params.prompt_logprobs is not None and seq.num_output_tokens == len(toks):
                # The first token of a fresh run carries its prompt's logprobs (a resumed run has none).
                output.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, []
            outputs.append(output)
        return outputs

    # -- KV transfer (kv_transfer.py): call between steps, on the engine's thread ------------
    @property
    def kv_layout(self) -> KvLayout:
        """What another engine's blocks must match to be imported here."""
        model = self.config.runner.model
        kv_heads, head_dim = self.runner.kv_heads
        return KvLayout(
            model=model if model is not None and is_dummy(model) else model_name(resolve_model_path(model)),
            config_fingerprint=config_fingerprint(self.model_config),
            weight_format=self.runner.weight_format,
            dtype=str(self.runner.kv_dtype).removeprefix("torch."),
            block_size=self.block_pool.block_size,
            num_layers=self.model_config.num_layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            tp_size=self.config.runner.tp_size,
        )

    def _kv_transfer(self) -> KvTransfer:
        if self._transfer is None:
            self._transfer = KvTransfer(self.block_pool, self.runner.local_kv_caches(), self.kv_layout)
        return self._transfer

    def export_prefix(self, token_ids: list[int], adapter: str | None = None) -> KvBlocks:
        """The KV of the full blocks of `token_ids` that the prefix cache holds, from the first, as
        computed with LoRA adapter `adapter` (None: the base model)."""
        root = self.loras.root_of(adapter) if adapter is not None else None
        return self._kv_transfer().export_prefix(token_ids, root)

    def export_request(self, request_id: str) -> KvBlocks:
        """The KV of a request's full, computed blocks; KeyError when it is not here."""
        seq = self.scheduler.get(request_id)
        if seq is None:
            raise KeyError(request_id)
        return self._kv_transfer().export_sequence(
            seq.all_token_ids, seq.block_ids, seq.num_computed_tokens, seq.chain_root
        )

    def import_blocks(self, layout: KvLayout, blocks: KvBlocks) -> ImportResult:
        """Puts another engine's blocks in the prefix cache (KvTransferError: refused, nothing imported)."""
        return self._kv_transfer().import_blocks(layout, blocks)

    # -- offline use ----------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        adapters: list[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion with continuous batching; results in prompt order.
        `adapters`: per prompt, the LoRA adapter it runs with (None: the base model)."""
        per_prompt = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"params: {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        per_adapter = adapters if adapters is not None else [None] * len(prompts)
        if len(per_adapter) != len(prompts):
            raise ValueError(f"adapters: {len(per_adapter)} adapters for {len(prompts)} prompts")
        ids = [f"gen-{uuid.uuid4().hex[:12]}" for _ in prompts]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        logprobs: dict[str, list[TokenLogprobs]] = {i: [] for i in ids}
        prompt_logprobs: dict[str, list[TokenLogprobs] | None] = {i: None for i in ids}
        finish: dict[str, str] = {}
        errors: dict[str, str | None] = {}
        for rid, prompt, p, adapter in zip(ids, prompts, per_prompt, per_adapter):
            self.add_request(rid, prompt, p, adapter=adapter)
        while len(finish) < len(ids):
            for o in self.step().outputs:
                tokens[o.request_id] += o.new_token_ids
                if o.logprobs:
                    logprobs[o.request_id] += o.logprobs
                if o.prompt_logprobs is not None:
                    prompt_logprobs[o.request_id] = o.prompt_logprobs
                if o.finish_reason:
                    finish[o.request_id], errors[o.request_id] = o.finish_reason, o.error
        return [
            GenerationResult(
                rid, prompt, tokens[rid], finish[rid], logprobs[rid] or None, prompt_logprobs[rid], errors[rid]
            )
            for rid, prompt in zip(ids, prompts)
        ]

    def shutdown(self) -> None:
        self.lookahead.drop()
        self.runner.shutdown()
