"""One `engine_step` span per step on a non-driver rank, so traces show every rank's thread track."""

from __future__ import annotations

import contextlib

from gpu_worker_svc.model.attention_metadata import StepBatch


class RankSpans:
    """A non-driver rank's step spans; nothing when the worker does not trace."""

    def __init__(self, instance: str | None, rank: int) -> None:
        self.handle = None
        if instance:
            from tracing import attributes  # only ranks that trace pay for the SDK
            from tracing.otel_setup import setup_tracing

            self.handle = setup_tracing("gpu_worker", instance, rank=rank)
            self.attr = attributes
        self.rank = rank

    def step(self, batch: StepBatch) -> contextlib.AbstractContextManager:
        if self.handle is None:
            return contextlib.nullcontext()
        attr = self.attr
        return self.handle.tracer.start_as_current_span(
            "engine_step",
            attributes={
                attr.STEP: batch.step,
                attr.RANK: self.rank,
                attr.BATCH_SIZE: int(batch.num_new.numel()),
                attr.NUM_TOKENS: int(batch.token_ids.numel()),
            },
        )

    def shutdown(self) -> None:
        if self.handle is not None:
            self.handle.shutdown()
