"""Holds structured output requests while the grammar engine loads, so that no step waits for it.

The first constrained request a worker sees needs the grammar engine imported and the vocabulary
indexed: about 2.5 s on a CPU, longer than many steps. Loading on the engine thread would stall
every running request for that long; instead the gate holds the constrained requests, loads in a
thread of its own, and hands them back to the engine thread (through `wake`) once it is done. A
load that fails is remembered by the engine, and the held requests are then refused with its
reason, as every later one is.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpu_worker_svc.engine.llm_engine import LLMEngine
from shardline.proto import worker_pb2

log = logging.getLogger(__name__)


class GrammarGate:
    """Used from the engine thread only, except for the loader thread's single call to `wake`."""

    def __init__(self, engine: LLMEngine, wake: Callable[[], None]) -> None:
        self._engine = engine
        self._wake = wake
        self._held: dict[str, worker_pb2.NewRequest] = {}
        self._loader: threading.Thread | None = None

    def holds(self, new: worker_pb2.NewRequest) -> bool:
        """Keep `new` back if it needs the grammar engine and that is not loaded yet."""
        if not new.params.HasField("structured_output") or self._engine.grammar_loaded:
            return False
        self._held[new.request_id] = new
        if self._loader is None:
            self._loader = threading.Thread(target=self._load, name="grammar-load", daemon=True)
            self._loader.start()
        return True

    def release(self) -> list[worker_pb2.NewRequest]:
        """The held requests, once the load has finished (in arrival order); none before."""
        if not self._engine.grammar_loaded:
            return []
        held, self._held = list(self._held.values()), {}
        return held

    def remove(self, request_id: str) -> worker_pb2.NewRequest | None:
        """Stop holding a request (it was aborted); None if it is not held."""
        return self._held.pop(request_id, None)

    def clear(self) -> None:
        self._held.clear()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def _load(self) -> None:
        try:
            self._engine.grammar_backend()
        except ValueError as exc:  # the engine keeps the reason, and refuses the held requests with it
            log.warning("structured output is unavailable: %s", exc)
        self._wake()
