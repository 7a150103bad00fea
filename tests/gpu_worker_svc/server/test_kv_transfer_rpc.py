"""KV blocks pushed between two real worker processes over the KvTransfer service."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from shardline.core.ports import free_port
from shardline.proto import worker_pb2, worker_pb2_grpc
from tests.gpu_worker_svc.server.conftest import KV_CACHE_BYTES
from tests.gpu_worker_svc.server.harness import (
    REPO,
    SessionClient,
    WorkerProcess,
    final_deltas,
    new_request,
    tokens_by_request,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def _prompt(seed: int) -> list[int]:
    """70 tokens: four full blocks of 16, then a partial one."""
    return torch.randint(100, 49152, (70,), generator=torch.Generator().manual_seed(seed)).tolist()


def _start(scheduler, tmp_path_factory, worker_id: str) -> tuple[WorkerProcess, worker_pb2.WorkerInfo]:
    args = ["--port", str(free_port()), "--worker-id", worker_id, "--scheduler", scheduler.address]
    args += ["--kv-cache-bytes", str(KV_CACHE_BYTES), "--max-num-batched-tokens", "256"]
    proc = WorkerProcess(args, tmp_path_factory.mktemp(worker_id) / "worker.log")
    try:
        return proc, proc.wait_registered(scheduler)
    except BaseException:
        proc.stop()
        raise


@pytest.fixture(scope="module")
def worker_procs(scheduler, tmp_path_factory) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """Worker A, which computes prompts, and worker B, which receives their blocks."""
    a, a_info = _start(scheduler, tmp_path_factory, "worker-a")
    try:
        b, b_info = _start(scheduler, tmp_path_factory, "worker-b")
    except BaseException:
        a.stop()
        raise
    a.info, b.info = a_info, b_info
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def workers(worker_procs) -> tuple[worker_pb2.WorkerInfo, worker_pb2.WorkerInfo]:
    return worker_procs[0].info, worker_procs[1].info


def _serve(info: worker_pb2.WorkerInfo, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens served from the prefix cache) of one request on one worker."""
    session = SessionClient(info.address)
    try:
        session.send(add=[new_request(rid, prompt, MAX_TOKENS)])
        steps = session.until_finished({rid})
    finally:
        session.close()
    return tokens_by_request(steps)[rid], final_deltas(steps)[rid].usage.cached_tokens


def _kv(info: worker_pb2.WorkerInfo) -> tuple[grpc.Channel, worker_pb2_grpc.KvTransferStub]:
    channel = grpc.insecure_channel(info.address)
    return channel, worker_pb2_grpc.KvTransferStub(channel)


def test_pushed_blocks_are_prefix_hits_with_identical_greedy_output(workers):
    a, b = workers
    prompt = _prompt(1)
    computed, cached = _serve(a, "on-a", prompt)
    assert cached == 0
    channel, stub = _kv(a)
    with channel:
        result = stub.SendBlocks(worker_pb2.SendBlocksRequest(target_address=b.address, prompt_token_ids=prompt))
    assert (result.imported, result.already_cached, result.no_room) == (4, 0, 0)

    served, cached = _serve(b, "on-b", prompt)

    assert cached == 64, "B prefills only the partial last block"
    assert served == computed


def test_a_sender_killed_mid_stream_leaves_the_receiver_serving_by_computing(workers, worker_procs):
    a, b = workers
    prompt = _prompt(2)
    computed, _ = _serve(a, "on-a-2", prompt)
    # A relay that streams A's export into B and is SIGKILLed after the header and two of four blocks.
    relay = f"""
import os, signal, time, grpc
from shardline.proto import worker_pb2, worker_pb2_grpc
chunks = list(worker_pb2_grpc.KvTransferStub(grpc.insecure_channel({a.address!r})).ExportBlocks(
    worker_pb2.ExportBlocksRequest(prompt_token_ids={prompt!r})))
assert len(chunks) == 5, len(chunks)
def stream():
    yield from chunks[:3]
    time.sleep(1.0)  # the three chunks reach B first
    os.kill(os.getpid(), signal.SIGKILL)
worker_pb2_grpc.KvTransferStub(grpc.insecure_channel({b.address!r})).PushBlocks(stream())
"""
    done = subprocess.run([sys.executable, "-c", relay], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    # The receiver may see the dead sender's stream end like a finished one (the header's block
    # count then tells it the transfer was cut short) or broken; either way it imports nothing.
    deadline = time.monotonic() + 20
    while not re.search(r"ended with 2 of 4 blocks complete|broke after 3 chunks", worker_procs[1].log(tail=None)):
        assert time.monotonic() < deadline, "the receiver never noticed the broken transfer"
        time.sleep(0.1)

    served, cached = _serve(b, "on-b-2", prompt)

    assert cached == 0, "no block of the broken transfer was imported"
    assert served == computed


def test_blocks_of_another_model_are_refused_naming_the_field(workers):
    a, b = workers
    prompt = _prompt(3)
    _serve(a, "on-a-3", prompt)
    channel, stub = _kv(a)
    with channel:
        chunks = list(stub.ExportBlocks(worker_pb2.ExportBlocksRequest(prompt_token_ids=prompt)))
    chunks[0].header.model = "another-model"
    channel, stub = _kv(b)
    with channel, pytest.raises(grpc.RpcError) as refused:
        stub.PushBlocks(iter(chunks))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details().startswith("model: blocks from another layout")


def test_a_slab_of_the_wrong_size_is_refused_and_nothing_is_imported(workers):
    a, b = workers
    prompt = _prompt(4)
    computed, _ = _serve(a, "on-a-4", prompt)
    channel, stub = _kv(a)
    with channel:
        chunks = list(stub.ExportBlocks(worker_pb2.ExportBlocksRequest(prompt_token_ids=prompt)))
    chunks[3].slab.kv = chunks[3].slab.kv[:-4]
    channel, stub = _kv(b)
    with channel, pytest.raises(grpc.RpcError) as refused:
        stub.PushBlocks(iter(chunks))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("slab.kv:")
    assert _serve(b, "on-b-4", prompt) == (computed, 0)


def test_a_running_requests_blocks_let_its_resumption_elsewhere_skip_their_prefill(workers):
    """What a drain's hand-off does: the request's computed blocks go to B, which resumes it with the
    tokens so far (as the scheduler re-dispatches it) and continues exactly as A does."""
    a, b = workers
    prompt, total = _prompt(5), 30
    session = SessionClient(a.address)
    try:
        session.send(add=[new_request("moving", prompt, total)])
        steps = [session.next()]
        while sum(len(d.token_ids) for s in steps for d in s.deltas) < 10:
            steps.append(session.next())
        channel, stub = _kv(a)
        with channel:
            result = stub.SendBlocks(worker_pb2.SendBlocksRequest(target_address=b.address, request_id="moving"))
        steps += session.until_finished({"moving"})
        with pytest.raises(grpc.RpcError) as gone:
            _kv(a)[1].SendBlocks(worker_pb2.SendBlocksRequest(target_address=b.address, request_id="moving"))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        session.close()
    on_a = tokens_by_request(steps)["moving"]
    assert len(on_a) == total and result.imported >= 4  # the prompt's four full blocks, at least
    so_far = on_a[:10]
    resumed = worker_pb2.NewRequest(
        request_id="moved",
        prompt_token_ids=prompt,
        output_token_ids=so_far,
        params={"max_tokens": total, "ignore_eos": True, "temperature": 0.0},
    )
    session = SessionClient(b.address)
    try:
        session.send(add=[resumed])
        steps = session.until_finished({"moved"})
    finally:
        session.close()
    assert final_deltas(steps)["moved"].usage.cached_tokens == 64, "the four blocks sent are hits; the rest is computed"
    assert so_far + tokens_by_request(steps)["moved"] == on_a


def test_a_remote_prefill_sends_the_prompts_blocks_and_shows_nothing_on_the_session(workers):
    """What a prefill worker does: PrefillBlocks computes the prompt in A's engine and pushes its full
    blocks to B, where the request is then served from them. A's own Session sees the steps' figures,
    never a delta of the prefill."""
    a, b = workers
    prompt = _prompt(6)
    session = SessionClient(a.address)
    try:
        session.send(add=[new_request("on-a-6", prompt, MAX_TOKENS)])
        steps = session.until_finished({"on-a-6"})
        computed, cached = tokens_by_request(steps)["on-a-6"], final_deltas(steps)["on-a-6"].usage.cached_tokens
        assert cached == 0
        channel, stub = _kv(a)
        with channel:
            result = stub.PrefillBlocks(
                worker_pb2.PrefillBlocksRequest(request_id="remote-6", token_ids=prompt, target_address=b.address)
            )
        assert (result.imported, result.already_cached, result.no_room) == (4, 0, 0)
        during = [session.next(timeout_s=10)]  # the prefill's step: the 6 tokens past A's cached blocks
        assert during[0].stats.num_prefill_tokens > 0
        assert not [d for step in during for d in step.deltas]
    finally:
        session.close()

    served, cached = _serve(b, "on-b-6", prompt)

    assert cached == 64, "B prefills only the partial last block"
    assert served == computed


def test_a_remote_prefill_refuses_what_it_cannot_compute_naming_the_field(workers):
    a, b = workers
    channel, stub = _kv(a)
    cases = [
        (worker_pb2.PrefillBlocksRequest(token_ids=[1, 2], target_address=""), "target_address:"),
        (worker_pb2.PrefillBlocksRequest(token_ids=[], target_address=b.address), "token_ids:"),
        (worker_pb2.PrefillBlocksRequest(token_ids=[1, 10**6], target_address=b.address), "token_ids:"),
    ]
    with channel:
        for request, field in cases:
            with pytest.raises(grpc.RpcError) as refused:
                stub.PrefillBlocks(request)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith(field), refused.value.details()
        # A decode worker that is gone: the sender's answer says so, with its address.
        gone = f"127.0.0.1:{free_port()}"
        with pytest.raises(grpc.RpcError) as refused:
            stub.PrefillBlocks(worker_pb2.PrefillBlocksRequest(token_ids=_prompt(7), target_address=gone))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details().startswith(f"target {gone}:")
