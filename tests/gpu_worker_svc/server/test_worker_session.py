"""The worker process end to end, driven as the scheduler drives it."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from shardline.proto import sampling_pb2, worker_pb2, worker_pb2_grpc
from tests.gpu_worker_svc.server.conftest import KV_CACHE_BYTES
from tests.gpu_worker_svc.server.harness import SessionClient, final_deltas, new_request, tokens_by_request

pytestmark = pytest.mark.slow

GREEDY_PROMPTS = {"g0": [1, 2, 3, 4, 5], "g1": list(range(100, 140)), "g2": [7]}
MAX_TOKENS = 6
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=42)


@pytest.fixture(scope="module")
def session_run(worker):
    """One session: three greedy requests and a seeded sampled one, run to completion."""
    _, info = worker
    session = SessionClient(info.address)
    try:
        session.send(
            add=[new_request(rid, p, MAX_TOKENS) for rid, p in GREEDY_PROMPTS.items()]
            + [new_request("s0", [5, 4, 3, 2, 1], MAX_TOKENS, **SAMPLED)]
        )
        return session.until_finished({*GREEDY_PROMPTS, "s0"})
    finally:
        session.close()


@pytest.fixture(scope="module")
def reference_tokens() -> dict[str, list[int]]:
    engine = LLMEngine(EngineConfig(RunnerConfig(num_blocks=64)))
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        results = engine.generate(list(GREEDY_PROMPTS.values()), params)
    finally:
        engine.shutdown()
    return {rid: r.token_ids for rid, r in zip(GREEDY_PROMPTS, results)}


def test_registration_and_get_info_describe_the_worker(worker, scheduler):
    proc, info = worker
    assert info.worker_id == "worker-test"
    assert info.model == "SmolLM2-135M-Instruct"
    assert (info.tp_size, info.block_size, info.max_num_seqs) == (1, 16, 8)
    assert info.kv_blocks_total == KV_CACHE_BYTES // 737_280
    with grpc.insecure_channel(info.address) as channel:
        assert worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetWorkerInfoRequest()) == info
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="shardline.v1.Worker"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    scheduler.forget(info.worker_id)  # as a restarted scheduler would: the next heartbeat re-registers
    assert proc.wait_registered(scheduler, timeout_s=10) == info


def test_one_message_per_step_carrying_every_running_request(session_run):
    steps = [s.step for s in session_run]
    assert steps == sorted(set(steps)), "at most one StepOutput per engine step"
    for step in session_run:
        # Every prompt fits the step's token budget, so each scheduled request samples a token.
        assert sum(1 for d in step.deltas if d.token_ids) == step.stats.batch_size
    offsets: dict[str, list[int]] = {}
    for step in session_run:
        for d in step.deltas:
            assert len(d.token_ids) == 1
            offsets.setdefault(d.request_id, []).append(d.offset)
    assert offsets == {rid: list(range(MAX_TOKENS)) for rid in [*GREEDY_PROMPTS, "s0"]}
    finals = final_deltas(session_run)
    assert {d.finish_reason for d in finals.values()} == {sampling_pb2.FINISH_REASON_LENGTH}
    assert finals["g1"].usage == sampling_pb2.Usage(
        prompt_tokens=40, completion_tokens=MAX_TOKENS, total_tokens=40 + MAX_TOKENS
    )
    last = session_run[-1].stats
    assert (last.kv_blocks_used, last.num_running, last.kv_blocks_total) == (0, 0, KV_CACHE_BYTES // 737_280)


def test_greedy_tokens_match_the_engine(session_run, reference_tokens):
    got = tokens_by_request(session_run)
    assert {rid: got[rid] for rid in GREEDY_PROMPTS} == reference_tokens


def test_resume_continues_identically(worker, session_run):
    full = tokens_by_request(session_run)
    session = SessionClient(worker[1].address)
    try:
        resumed = [
            new_request("g1", GREEDY_PROMPTS["g1"], MAX_TOKENS),
            new_request("s0", [5, 4, 3, 2, 1], MAX_TOKENS, **SAMPLED),
        ]
        resumed[0].output_token_ids[:] = full["g1"][:3]
        resumed[1].output_token_ids[:] = full["s0"][:2]
        session.send(add=resumed)
        steps = session.until_finished({"g1", "s0"})
    finally:
        session.close()
    got = tokens_by_request(steps)
    assert got == {"g1": full["g1"][3:], "s0": full["s0"][2:]}
    first = {}
    for d in (d for s in steps for d in s.deltas):
        first.setdefault(d.request_id, d.offset)
    assert first == {"g1": 3, "s0": 2}
    assert final_deltas(steps)["s0"].usage.completion_tokens == MAX_TOKENS


def test_abort_mid_stream_frees_the_kv_blocks(worker):
    session = SessionClient(worker[1].address)
    try:
        session.send(add=[new_request("long", list(range(1, 40)), 200)])
        while not any(d.token_ids for d in session.next().deltas):
            pass
        session.send(abort=["long"])
        steps = session.until_finished({"long"})
    finally:
        session.close()
    final = final_deltas(steps)["long"]
    assert final.finish_reason == sampling_pb2.FINISH_REASON_ABORT and not final.token_ids
    assert final.usage.completion_tokens == final.offset >= 1
    assert (steps[-1].stats.kv_blocks_used, steps[-1].stats.num_running) == (0, 0)


def test_broken_session_aborts_its_requests(worker, scheduler):
    session = SessionClient(worker[1].address)
    session.send(add=[new_request("orphan", list(range(1, 40)), 200)])
    while not any(d.token_ids for d in session.next().deltas):
        pass
    scheduler.wait_for_heartbeat(lambda b: b.running == 1 and b.kv_blocks_used > 0)
    session.close()  # the scheduler's end breaks
    scheduler.wait_for_heartbeat(lambda b: b.running == 0 and b.kv_blocks_used == 0)


def test_new_session_replaces_the_previous_one(worker):
    first = SessionClient(worker[1].address)
    second = None
    try:
        first.send(add=[new_request("moved", list(range(1, 40)), 200)])
        while not any(d.token_ids for d in first.next().deltas):
            pass
        second = SessionClient(worker[1].address)
        ended = first.end()
        assert ended is not None and ended.code() == grpc.StatusCode.UNAVAILABLE
        second.send(add=[new_request("moved", list(range(1, 40)), 3)])  # re-dispatched under the same id
        steps = second.until_finished({"moved"})
    finally:
        first.close()
        if second is not None:
            second.close()
    deltas = [d for s in steps for d in s.deltas]
    assert [d.offset for d in deltas] == [0, 1, 2]  # no stale abort of the first attempt
    assert deltas[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH


def test_bad_params_finish_with_an_error_delta(worker):
    context = worker[1].max_model_len  # what its KV cache holds
    session = SessionClient(worker[1].address)
    try:
        session.send(
            add=[
                new_request("bad-top-p", [1, 2, 3], 4, top_p=2.0),
                new_request("bad-prompt", [], 4),
                new_request("bad-token", [1, 10**6], 4),
                new_request("bad-logprobs", [1, 2], 4, top_logprobs=2),
                new_request("too-long", [5] * context, 4),
                new_request("too-long-output", [5] * (context - 10), 20),
                new_request("fine", [1, 2, 3], 2, logprobs=True, top_logprobs=2),
                new_request("twice", [1, 2, 3], 2),
                new_request("twice", [1, 2, 3], 2),  # a duplicate add is ignored: the first one runs
            ]
        )
        steps = session.until_finished(
            {"bad-top-p", "bad-prompt", "bad-token", "bad-logprobs", "too-long", "too-long-output", "fine", "twice"}
        )
    finally:
        session.close()
    finals = final_deltas(steps)
    for rid, field in [
        ("bad-top-p", "top_p"),
        ("bad-prompt", "prompt_token_ids"),
        ("bad-token", "prompt_token_ids"),
        ("bad-logprobs", "top_logprobs"),
        ("too-long", "prompt_token_ids"),
        ("too-long-output", "max_tokens"),
    ]:
        assert finals[rid].finish_reason == sampling_pb2.FINISH_REASON_ERROR
        assert field in finals[rid].error and not finals[rid].token_ids
    assert finals["fine"].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert [d.offset for s in steps for d in s.deltas if d.request_id == "twice"] == [0, 1]
    fine = [d for s in steps for d in s.deltas if d.request_id == "fine"]
    assert all(
        len(d.logprobs) == 1 and len(d.logprobs[0].top) == 2 and d.logprobs[0].token_id == d.token_ids[0] for d in fine
    )


def test_a_burst_reaching_an_idle_worker_shares_its_first_step(worker):
    """Requests sent a few ms apart (as the scheduler dispatches a burst) start in one prefill step."""
    import time

    session = SessionClient(worker[1].address)
    try:
        for i in range(3):
            session.send(add=[new_request(f"burst{i}", [10 + i] * 20, 2)])
            time.sleep(0.002)
        first = session.next()
        session.until_finished({"burst0", "burst1", "burst2"} - {d.request_id for d in first.deltas if d.finish_reason})
    finally:
        session.close()
    assert first.stats.batch_size == 3 and first.stats.num_prefill_tokens == 60
    assert {d.request_id for d in first.deltas} == {"burst0", "burst1", "burst2"}


def test_structured_output_requests_wait_for_the_grammar_engine_while_others_step(worker):
    """The first constrained request loads the grammar engine (seconds on a CPU) off the engine
    thread: running requests keep stepping meanwhile. (No other test here uses structured output,
    so this worker loads it now.)"""
    choice = {"structured_output": {"choice": {"choices": ["yes", "no"]}}, "ignore_eos": False}
    session = SessionClient(worker[1].address)
    try:
        session.send(add=[new_request("free", list(range(1, 40)), 400)])
        while not any(d.token_ids for d in session.next().deltas):
            pass
        session.send(
            add=[
                new_request("picked", [1, 2, 3], 8, **choice),
                new_request("gone", [4, 5], 8, **choice),
                new_request("bad", [6], 8, structured_output={"regex": "(ab"}),
            ]
        )
        session.send(abort=["gone"])
        steps = session.until_finished({"picked", "gone", "bad"})
        session.send(abort=["free"])
        session.until_finished({"free"})
    finally:
        session.close()
    first_picked = next(i for i, s in enumerate(steps) if any(d.request_id == "picked" for d in s.deltas))
    free_steps = sum(1 for s in steps[:first_picked] if any(d.request_id == "free" and d.token_ids for d in s.deltas))
    # The load takes seconds: several steps of "free" here, 4 to 20 in test runs. Loaded on the
    # engine thread, it allowed at most the one step already under way.
    assert free_steps >= 2, free_steps
    finals = final_deltas(steps)
    assert finals["picked"].finish_reason == sampling_pb2.FINISH_REASON_STOP
    picked = tokens_by_request(steps)["picked"]
    assert len(picked) >= 2 and picked[-1] == 2  # "yes" or "no", then EOS
    assert finals["gone"].finish_reason == sampling_pb2.FINISH_REASON_ABORT and not finals["gone"].token_ids
    assert finals["bad"].finish_reason == sampling_pb2.FINISH_REASON_ERROR
    assert finals["bad"].error.startswith("structured_output: the regex does not compile")
