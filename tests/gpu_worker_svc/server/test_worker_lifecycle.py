"""Shutdown and failure of a tensor-parallel worker (a tiny random Llama, TP=2)."""

from __future__ import annotations

import json
import signal
import time

import grpc
import psutil
import pytest
import torch
from safetensors.torch import save_file

from shardline.core.ports import free_port
from tests.gpu_worker_svc.server.harness import (
    SchedulerStandIn,
    SessionClient,
    WorkerProcess,
    new_request,
    tokens_by_request,
)

pytestmark = pytest.mark.slow

TINY = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    eos_token_id=2,
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A Hugging Face folder with random weights: loads in milliseconds on every rank."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY))
    h, i = TINY["hidden_size"], TINY["intermediate_size"]
    d = h // TINY["num_attention_heads"]
    kv = TINY["num_key_value_heads"] * d
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (TINY["vocab_size"], h), "model.norm.weight": (h,)}
    for layer in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    save_file(
        {name: torch.randn(shape, generator=g) * 0.1 for name, shape in shapes.items()},
        str(folder / "model.safetensors"),
    )
    return folder


@pytest.fixture
def tp_worker(tiny_model, tmp_path):
    scheduler = SchedulerStandIn()
    proc = WorkerProcess(
        [
            "--port",
            str(free_port()),
            "--scheduler",
            scheduler.address,
            "--model",
            str(tiny_model),
            "--tp",
            "2",
            "--kv-cache-bytes",
            str(1 << 20),
        ],
        tmp_path / "worker.log",
    )
    try:
        info = proc.wait_registered(scheduler)
        ranks = [
            p for p in psutil.Process(proc.proc.pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())
        ]
        assert len(ranks) == 1, "TP=2 runs one rank process beside rank 0"
        yield proc, info, ranks[0]
    finally:
        proc.stop()
        scheduler.stop()


def _running_session(info) -> SessionClient:
    session = SessionClient(info.address)
    session.send(add=[new_request("r", [1, 2, 3], 100)])
    while not any(d.token_ids for d in session.next().deltas):
        pass
    return session


def _gone(processes: list[psutil.Process], timeout_s: float = 10.0) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return not alive


def test_sigterm_stops_the_ranks_and_exits_zero(tp_worker):
    proc, info, rank = tp_worker
    children = psutil.Process(proc.proc.pid).children(recursive=True)
    session = _running_session(info)
    try:
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=30) == 0, proc.log()
        ended = session.end()
        assert ended is not None and ended.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        session.close()
    assert _gone(children), "no orphaned rank processes"


def test_killed_rank_makes_the_worker_exit_nonzero(tp_worker):
    proc, info, rank = tp_worker
    children = psutil.Process(proc.proc.pid).children(recursive=True)
    session = SessionClient(info.address)
    try:
        session.send(add=[new_request("r", [1, 2, 3], 4)])
        assert len(tokens_by_request(session.until_finished({"r"}))["r"]) == 4  # both ranks serve
        rank.kill()  # while idle: the worker must notice without a request failing
        assert proc.proc.wait(timeout=15) == 1, proc.log()
        ended = session.end()
        assert ended is not None and ended.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine died" in ended.details()
        assert "died with exit code -9" in proc.log()  # reaped before it is reported (it said None)
    finally:
        session.close()
    assert _gone(children)


def _cmdline(process: psutil.Process) -> str:
    """A child's command line; empty for one that exited meanwhile (a short-lived helper, not yet
    reaped, is a zombie whose command line psutil refuses to read)."""
    try:
        return " ".join(process.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return ""


def test_sigterm_during_the_model_load_exits_at_once_with_its_ranks(tmp_path):
    # The default model at TP=3 takes its ranks many seconds to load on this machine: stop it half-way.
    scheduler = SchedulerStandIn()
    proc = WorkerProcess(
        ["--port", str(free_port()), "--scheduler", scheduler.address, "--tp", "3"], tmp_path / "worker.log"
    )
    try:
        deadline = time.monotonic() + 60
        while not (
            ranks := [p for p in psutil.Process(proc.proc.pid).children(recursive=True) if "spawn_main" in _cmdline(p)]
        ):
            assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log()
            time.sleep(0.05)
        assert "loading the default model" in proc.log()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=10) == 0, proc.log()
        assert "engine ready" not in proc.log(), "it waited for the load to finish"
        assert _gone(ranks)
    finally:
        proc.stop()
        scheduler.stop()
