"""The worker's grammar gate, without a model: held requests come out with their compiled grammar
even when the backend's cache has let it go, aborted ones are not compiled for, and a backend that
does not build releases everything (for the engine to refuse)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from gpu_worker_svc.server.grammar_gate import COMPILE_THREADS, GrammarGate
from shardline.proto import worker_pb2
from shardline.structured_output import StructuredOutputSpec


class FakeBackend:
    """Compiles to a string tag, with a cache of one entry; `gate` blocks compiles until set."""

    def __init__(self) -> None:
        self.cache: OrderedDict[StructuredOutputSpec, str] = OrderedDict()
        self.compiled: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def is_compiled(self, spec: StructuredOutputSpec) -> bool:
        return spec in self.cache

    def compile(self, spec: StructuredOutputSpec) -> object:
        self.gate.wait(5)
        self.compiled.append(spec.value)
        result = ("grammar", spec.value) if spec.value != "(bad" else "structured_output: the regex does not compile"
        self.cache[spec] = result
        while len(self.cache) > 1:
            self.cache.popitem(last=False)
        return result


class FakeEngine:
    def __init__(self, error: str | None = None) -> None:
        self.backend, self.grammar_error, self.grammar_loaded = FakeBackend(), error, True

    def grammar_backend(self) -> FakeBackend:
        if not self.grammar_loaded:  # the first call builds the backend: slow
            self.backend.gate.wait(5)
        if self.grammar_error is not None:
            raise ValueError(self.grammar_error)
        return self.backend


def _request(request_id: str, regex: str | None) -> worker_pb2.NewRequest:
    params = {"structured_output": {"regex": regex}} if regex is not None else {}
    return worker_pb2.NewRequest(request_id=request_id, prompt_token_ids=[1], params=params)


def _released(gate: GrammarGate, wakes: threading.Semaphore, count: int) -> list[tuple[str, object]]:
    for _ in range(count):
        assert wakes.acquire(timeout=5)
    return [(new.request_id, compiled) for new, compiled in gate.release()]


def test_held_requests_come_out_with_their_grammar_though_the_cache_let_it_go():
    engine, wakes = FakeEngine(), threading.Semaphore(0)
    engine.backend.gate.clear()  # compiles wait until every request is held
    gate = GrammarGate(engine, wakes.release)
    assert not gate.holds(_request("free", None))
    for i, regex in enumerate(["a+", "b+", "c+", "(bad"]):
        assert gate.holds(_request(f"r{i}", regex))
    assert gate.holds(_request("r4", "a+"))  # the same spec, not compiled twice
    assert len(gate) == 5
    engine.backend.gate.set()
    released = _released(gate, wakes, 4)
    assert len(engine.backend.cache) == 1  # a, b and c have left the backend's cache
    assert released == [
        ("r0", ("grammar", "a+")),
        ("r1", ("grammar", "b+")),
        ("r2", ("grammar", "c+")),
        ("r3", "structured_output: the regex does not compile"),
        ("r4", ("grammar", "a+")),
    ]
    assert sorted(engine.backend.compiled) == ["(bad", "a+", "b+", "c+"] and len(gate) == 0
    [cached] = engine.backend.cache  # whichever compile finished last
    assert not gate.holds(_request("r5", cached.value))  # cached: straight to the engine


def test_an_aborted_request_is_not_compiled_for_and_nothing_leaks():
    engine, wakes = FakeEngine(), threading.Semaphore(0)
    engine.backend.gate.clear()  # compiles wait
    gate = GrammarGate(engine, wakes.release)
    busy = [f"s{i}+" for i in range(COMPILE_THREADS)]  # every compile thread taken
    for i, regex in enumerate(busy):
        assert gate.holds(_request(f"busy{i}", regex))
    assert gate.holds(_request("gone", "y+"))  # queued behind them
    assert gate.remove("gone").request_id == "gone" and gate.remove("gone") is None
    engine.backend.gate.set()
    released = _released(gate, wakes, COMPILE_THREADS + 1)
    assert [rid for rid, _ in released] == [f"busy{i}" for i in range(COMPILE_THREADS)]
    assert sorted(engine.backend.compiled) == sorted(busy)  # y+ was never compiled
    assert gate._results == {} and len(gate) == 0


def test_a_backend_that_does_not_build_releases_everything_for_the_engine_to_refuse():
    engine, wakes = FakeEngine(), threading.Semaphore(0)
    engine.grammar_loaded = False
    engine.backend.gate.clear()
    gate = GrammarGate(engine, wakes.release)
    assert gate.holds(_request("a", "a+")) and gate.holds(_request("b", "b+"))
    engine.grammar_error, engine.grammar_loaded = "structured_output: the grammar engine is not installed", True
    engine.backend.gate.set()
    assert _released(gate, wakes, 2) == [("a", None), ("b", None)]
    assert not gate.holds(_request("c", "c+"))  # the engine refuses it at once, with the reason


def test_a_request_held_as_a_skipping_compile_ends_is_compiled_for_again():
    """A compile thread finds no request for its spec and skips it; a request for that spec is held
    just before the thread's end. The wake that follows must not leave it waiting for nothing."""
    engine, wakes = FakeEngine(), threading.Semaphore(0)
    gate = GrammarGate(engine, wakes.release)
    spec = StructuredOutputSpec("regex", "z+")
    gate._compiling.add(spec)  # that thread, past its check
    assert gate.holds(_request("late", "z+"))
    gate._compiling.discard(spec)  # ...and its end: nothing compiled, one wake
    assert gate.release() == []
    assert _released(gate, wakes, 1) == [("late", ("grammar", "z+"))]
