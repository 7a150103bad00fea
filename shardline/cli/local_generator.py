"""In-process generation for `shardline generate` / `chat` when no stack URL is given."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.server.request_params import EngineLimits, check_request
from gpu_worker_svc.server.serving import build_engine
from gpu_worker_svc.server.settings import WorkerSettings
from shardline.core.model_path import resolve_model_path
from shardline.core.text.chat_template import ChatTemplate
from shardline.core.text.detokenizer import IncrementalDetokenizer
from shardline.core.text.tokenizer import Tokenizer


class LocalGenerator:
    """The engine and tokenizer in this process: no services, no network."""

    def __init__(self, model: str | None, tp: int = 1) -> None:
        path = resolve_model_path(model)
        self.tokenizer = Tokenizer.from_model_path(path)
        self.template = (
            ChatTemplate(self.tokenizer.chat_template or "", self.tokenizer.bos_token, self.tokenizer.eos_token)
            if self.tokenizer.chat_template
            else None
        )
        # The engine a worker would run: its SHARDLINE_* settings (quantization, speculation, KV
        # budget, device...) apply here too, so `generate` without --url matches the stack.
        self.engine = build_engine(WorkerSettings(model=str(path), tp_size=tp, tracing=False))

    def stream(
        self,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        *,
        max_tokens: int,
        temperature: float,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> Iterator[str]:
        """Yield text as it is generated, from a raw prompt or chat messages."""
        if messages is not None:
            if self.template is None:
                raise ValueError("this model has no chat template; give a plain prompt")
            prompt = self.template.render(messages, add_generation_prompt=True)
            ids = self.tokenizer.encode_batch([prompt], add_special_tokens=False)[0]
        else:
            ids = self.tokenizer.encode_batch([prompt or ""])[0]
        eos = self.tokenizer.eos_token_ids
        sp = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=1.0 if top_p is None else top_p, seed=seed
        )
        sp.stop_token_ids = sorted(set(sp.stop_token_ids) | set(eos[1:]))
        rid = f"local-{uuid.uuid4().hex[:8]}"
        check_request(ids, sp, EngineLimits.of(self.engine))  # the worker's edge: the engine trusts it
        self.engine.add_request(rid, ids, sp, eos_token_id=eos[0] if eos else None)
        detok = IncrementalDetokenizer(self.tokenizer)
        while self.engine.has_unfinished:
            for out in self.engine.step().outputs:
                text = detok.add(out.new_token_ids)
                if text:
                    yield text
        tail = detok.finish()
        if tail:
            yield tail

    def close(self) -> None:
        self.engine.shutdown()
