"""Holds structured output requests while their grammar compiles, so that no step waits for it.

Compiling is slow next to a step: the first constrained request needs the grammar engine imported
and the vocabulary indexed (about 2.5 s on a CPU), and a large JSON Schema can take seconds of its
own. Done on the engine thread, that would stall every running request. Instead the gate holds a
constrained request whose grammar is not compiled yet, compiles it in a thread of its own (the
compiler releases the GIL), and hands it back to the engine thread through `wake` once the
compiled grammar, or its error, is in the backend's cache. A request whose constraint does not
compile is then refused by the engine with the compiler's reason.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from gpu_worker_svc.engine.grammar import GrammarBackend
from gpu_worker_svc.engine.llm_engine import LLMEngine
from shardline.proto import worker_pb2
from shardline.structured_output import StructuredOutputSpec

log = logging.getLogger(__name__)


class GrammarGate:
    """Used from the engine thread only; the compile thread only compiles and calls `wake`."""

    def __init__(self, engine: LLMEngine, wake: Callable[[], None]) -> None:
        self._engine = engine
        self._wake = wake
        self._held: dict[str, tuple[worker_pb2.NewRequest, StructuredOutputSpec]] = {}
        self._jobs: queue.SimpleQueue[StructuredOutputSpec] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def holds(self, new: worker_pb2.NewRequest) -> bool:
        """Keep `new` back if its grammar is still to compile (then compile it meanwhile)."""
        if not new.params.HasField("structured_output"):
            return False
        try:
            spec = StructuredOutputSpec.from_proto(new.params.structured_output)
        except ValueError:
            return False  # the engine refuses it, naming the field
        backend = self._backend()
        if backend is None or backend.is_compiled(spec):
            return False
        self._held[new.request_id] = (new, spec)
        self._jobs.put(spec)
        if self._thread is None:
            self._thread = threading.Thread(target=self._compile_forever, name="grammar-compile", daemon=True)
            self._thread.start()
        return True

    def release(self) -> list[worker_pb2.NewRequest]:
        """The held requests whose grammar is now compiled (or refused), in arrival order."""
        backend = self._backend()
        ready = [rid for rid, (_, spec) in self._held.items() if backend is None or backend.is_compiled(spec)]
        return [self._held.pop(rid)[0] for rid in ready]

    def remove(self, request_id: str) -> worker_pb2.NewRequest | None:
        """Stop holding a request (it was aborted); None if it is not held."""
        held = self._held.pop(request_id, None)
        return None if held is None else held[0]

    def clear(self) -> None:
        self._held.clear()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def _backend(self) -> GrammarBackend | _NotLoaded | None:
        """The engine's backend; None once it is known not to build (the engine then refuses)."""
        if not self._engine.grammar_loaded:
            return _NOT_LOADED
        try:
            return self._engine.grammar_backend()
        except ValueError:
            return None

    def _compile_forever(self) -> None:
        while True:
            spec = self._jobs.get()
            try:
                self._engine.grammar_backend().compile(spec)  # raises only ValueError
            except ValueError as exc:  # kept by the backend; the engine thread refuses the request with it
                log.info("structured output refused: %s", exc)
            self._wake()


class _NotLoaded:
    """Stands for the backend before its first build: nothing is compiled yet."""

    @staticmethod
    def is_compiled(spec: StructuredOutputSpec) -> bool:
        return False


_NOT_LOADED = _NotLoaded()
