"""CheckStructuredOutput's checker: one compile per distinct constraint, off the threads Tokenize uses."""

from __future__ import annotations

import asyncio
import threading
import time

from shardline.proto import sampling_pb2
from tokenizer_svc import structured_output_check
from tokenizer_svc.structured_output_check import StructuredOutputChecker


def test_concurrent_and_repeated_checks_compile_once(monkeypatch):
    calls: list[str] = []
    real = structured_output_check._error

    def counted(constraint):
        calls.append(constraint.regex)
        time.sleep(0.05)  # long enough for every caller to arrive while it runs
        return real(constraint)

    monkeypatch.setattr(structured_output_check, "_error", counted)
    good, bad = sampling_pb2.StructuredOutput(regex="[a-z]+"), sampling_pb2.StructuredOutput(regex="(ab")

    async def run() -> list[str]:
        checker = StructuredOutputChecker()
        first = await asyncio.gather(*(checker.error(c) for c in [good, bad] * 8))
        again = await asyncio.gather(checker.error(good), checker.error(bad))
        return first + again

    verdicts = asyncio.run(run())
    assert sorted(calls) == ["(ab", "[a-z]+"]
    assert verdicts[0::2] == [""] * 9
    assert all(v.startswith("the regex does not compile") for v in verdicts[1::2])


def test_a_caller_that_leaves_does_not_cancel_the_others(monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(structured_output_check, "_error", lambda constraint: (release.wait(5) and "", True))

    async def run() -> str:
        checker = StructuredOutputChecker()
        constraint = sampling_pb2.StructuredOutput(regex="x")
        leaver = asyncio.create_task(checker.error(constraint))
        stayer = asyncio.create_task(checker.error(constraint))
        await asyncio.sleep(0.05)
        leaver.cancel()
        release.set()
        return await stayer

    assert asyncio.run(run()) == ""


def test_checks_do_not_take_the_default_executors_threads(monkeypatch):
    """Tokenize and Detokenize run in asyncio.to_thread: a slow check must not queue them."""
    release = threading.Event()
    monkeypatch.setattr(structured_output_check, "_error", lambda constraint: (release.wait(5) and "", True))

    async def run() -> float:
        checker = StructuredOutputChecker()
        slow = [asyncio.create_task(checker.error(sampling_pb2.StructuredOutput(regex=f"x{i}"))) for i in range(32)]
        await asyncio.sleep(0.05)
        start = time.perf_counter()
        await asyncio.to_thread(lambda: None)  # what a Tokenize call waits for
        took = time.perf_counter() - start
        release.set()
        await asyncio.gather(*slow)
        return took

    assert asyncio.run(run()) < 1.0


def test_a_failure_of_the_grammar_engine_itself_is_not_kept(monkeypatch):
    calls: list[int] = []

    def flaky(constraint):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("for a moment")
        return "", True

    monkeypatch.setattr(structured_output_check.StructuredOutputSpec, "grammar", lambda self: flaky(None))

    async def run() -> list[str]:
        checker = StructuredOutputChecker()
        constraint = sampling_pb2.StructuredOutput(regex="x+")
        return [await checker.error(constraint) for _ in range(3)]

    first, second, third = asyncio.run(run())
    assert first.startswith("the grammar engine failed on it") and second == third == ""
    assert len(calls) == 2  # the failure was tried again; the good verdict was kept
