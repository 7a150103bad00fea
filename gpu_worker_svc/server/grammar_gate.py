"""Holds structured output requests while their grammar compiles, so that no step waits for it.

Compiling is slow next to a step: the first constrained request needs the grammar engine imported
and the vocabulary indexed (about 2.5 s on a CPU), and a large JSON Schema can take seconds of its
own. Done on the engine thread, that would stall every running request. Instead the gate holds a
constrained request whose grammar is not compiled yet, compiles it in a small pool of threads of
its own (the compiler releases the GIL; a few threads, so that one slow schema does not hold up
every other), and hands it back to the engine thread through `wake`, with the compiled grammar or
the compiler's error in hand: the backend's cache may have let it go by then.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from gpu_worker_svc.engine.llm_engine import LLMEngine
from shardline.proto import worker_pb2
from shardline.structured_output import StructuredOutputSpec

log = logging.getLogger(__name__)

COMPILE_THREADS = 4


class GrammarGate:
    """Used from the engine thread; the compile threads run `_compile_forever`. One lock guards
    the three containers the two sides share."""

    def __init__(self, engine: LLMEngine, wake: Callable[[], None]) -> None:
        self._engine = engine
        self._wake = wake
        self._lock = threading.Lock()
        self._held: dict[str, tuple[worker_pb2.NewRequest, StructuredOutputSpec]] = {}
        self._results: dict[StructuredOutputSpec, Any] = {}  # compile(spec)'s: a grammar, or an error message
        self._compiling: set[StructuredOutputSpec] = set()
        self._jobs: queue.SimpleQueue[StructuredOutputSpec] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def holds(self, new: worker_pb2.NewRequest) -> bool:
        """Keep `new` back if its grammar is still to compile (then compile it meanwhile)."""
        if not new.params.HasField("structured_output"):
            return False
        try:
            spec = StructuredOutputSpec.from_proto(new.params.structured_output)
        except ValueError:
            return False  # the engine refuses it, naming the field
        if self._engine.grammar_loaded:
            try:
                if self._engine.grammar_backend().is_compiled(spec):
                    return False
            except ValueError:
                return False  # the backend does not build: the engine refuses it with the reason
        with self._lock:
            self._held[new.request_id] = (new, spec)
            self._submit(spec)
        return True

    def release(self) -> list[tuple[worker_pb2.NewRequest, Any]]:
        """Each held request whose grammar is compiled (or refused), with compile()'s result, in
        arrival order; an unusable backend releases them all, with None (the engine then refuses)."""
        broken = self._engine.grammar_loaded and self._engine.grammar_error is not None
        with self._lock:
            ready = [rid for rid, (_, spec) in self._held.items() if broken or spec in self._results]
            released = [(new, self._results.get(spec)) for new, spec in (self._held.pop(rid) for rid in ready)]
            self._forget_unneeded()
            if not broken:
                # A compile thread skips a spec that no request wanted when it started; one held just
                # after that check would wait for nothing. Its thread has woken us since: compile again.
                for _, spec in self._held.values():
                    self._submit(spec)
        return released

    def remove(self, request_id: str) -> worker_pb2.NewRequest | None:
        """Stop holding a request (it was aborted); None if it is not held."""
        with self._lock:
            held = self._held.pop(request_id, None)
            if held is None:
                return None
            self._forget_unneeded()
        return held[0]

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self._forget_unneeded()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def _submit(self, spec: StructuredOutputSpec) -> None:
        """Compile `spec` in a compile thread, unless that is under way or done. Holding the lock."""
        if spec in self._compiling or spec in self._results:
            return
        self._compiling.add(spec)
        self._jobs.put(spec)
        if len(self._threads) < COMPILE_THREADS:
            # Daemons: a process that exits does not wait for a schema's compile (it can take minutes).
            thread = threading.Thread(target=self._compile_forever, name="grammar-compile", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _forget_unneeded(self) -> None:
        """Drop results no held request needs. Holding the lock."""
        needed = {spec for _, spec in self._held.values()}
        for spec in [s for s in self._results if s not in needed]:
            del self._results[spec]

    def _compile_forever(self) -> None:
        while True:
            self._compile(self._jobs.get())

    def _compile(self, spec: StructuredOutputSpec) -> None:
        result: Any = None
        try:
            with self._lock:
                wanted = any(s == spec for _, s in self._held.values())  # else every request for it has gone
            if wanted:
                result = self._engine.grammar_backend().compile(spec)
        except ValueError as exc:  # the backend does not build; release() sees it in the engine
            log.warning("structured output is unavailable: %s", exc)
        except Exception:  # a bug: log it, and still wake the engine thread, so no request waits forever
            log.exception("structured output failed to compile")
            result = "structured_output: the grammar engine failed on this constraint"
        finally:
            with self._lock:
                if result is not None:
                    self._results[spec] = result
                self._compiling.discard(spec)
            self._wake()
