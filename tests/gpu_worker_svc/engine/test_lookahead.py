"""Async scheduling (lookahead.py) gives every request the tokens that stepping one by one gives.

On CPU the launched step runs at once rather than beside the host, but the same code decides
what is launched, what is taken and what is dropped: arrivals, aborts, finishes at different
lengths, preemption and sampling all change the next step's batch under it.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams

Script = dict[int, list[tuple[str, str, list[int] | None, SamplingParams | None]]]


def _engine(lookahead: bool, num_blocks: int = 256, invariant: bool = False, tp: int = 1) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            runner=RunnerConfig(model="dummy:tiny", num_blocks=num_blocks, batch_invariant=invariant, tp_size=tp),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
            async_scheduling=lookahead,
        )
    )


def _prompt(i: int, length: int) -> list[int]:
    return torch.randint(3, 1024, (length,), generator=torch.Generator().manual_seed(i)).tolist()


def _run(engine: LLMEngine, script: Script) -> dict[str, tuple[list[int], str | None]]:
    """Steps until idle, adding and aborting requests at the steps the script names."""
    engine.preempted = 0  # type: ignore[attr-defined]
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    step = 0
    while engine.has_unfinished or any(k >= step for k in script):
        for action, rid, prompt, params in script.get(step, []):
            if action == "add":
                assert prompt is not None
                engine.add_request(rid, prompt, params)
                tokens[rid] = []
            else:
                engine.abort_request(rid)
        out = engine.step()
        engine.preempted += out.stats.num_preempted if out.stats else 0  # type: ignore[attr-defined]
        for o in out.outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
        step += 1
    return {rid: (toks, finish.get(rid)) for rid, toks in tokens.items()}


def _both(script: Script, **kwargs) -> tuple[dict, dict, LLMEngine]:
    """The script without and with lookahead; one engine at a time (a process has one TP group)."""
    results = []
    for lookahead in (False, True):
        engine = _engine(lookahead, **kwargs)
        try:
            results.append(_run(engine, script))
        finally:
            engine.shutdown()
    return results[0], results[1], engine


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_greedy_requests_of_different_lengths_get_the_same_tokens():
    script: Script = {0: [("add", f"r{i}", _prompt(i, 5 + 7 * i), _greedy(6 + 5 * i)) for i in range(5)]}
    plain, ahead, engine = _both(script)
    assert ahead == plain
    assert all(finish == "length" for _, finish in plain.values())
    # Every step of a steady batch was launched by the one before; a finish drops one launch.
    assert engine.lookahead.num_used >= 15 and engine.lookahead.num_dropped <= 5


def test_arrivals_and_aborts_between_steps_get_the_same_tokens():
    seeded = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7, frequency_penalty=0.5, ignore_eos=True)
    script: Script = {
        0: [("add", "a", _prompt(1, 12), _greedy(30)), ("add", "b", _prompt(2, 20), seeded)],
        4: [("add", "c", _prompt(3, 9), _greedy(12))],
        9: [("abort", "b", None, None)],
        11: [("add", "d", _prompt(4, 33), SamplingParams(max_tokens=20, temperature=1.0, seed=3, top_k=20))],
    }
    plain, ahead, engine = _both(script)
    assert ahead == plain
    assert plain["b"][1] == "abort" and len(plain["b"][0]) < 30
    assert engine.lookahead.num_used > 0 and engine.lookahead.num_dropped > 0


def test_preemption_for_want_of_blocks_gets_the_same_tokens():
    """12 blocks of 16 tokens for four requests that need 4 blocks each: they preempt each other,
    and the lookahead's early block for a next position is one the scheduler could have given."""
    script: Script = {0: [("add", f"p{i}", _prompt(10 + i, 30), _greedy(30)) for i in range(4)]}
    plain, ahead, engine = _both(script, num_blocks=12)
    assert ahead == plain
    assert engine.preempted > 0 and engine.lookahead.num_used > 0  # type: ignore[attr-defined]
    assert all(len(toks) == 30 for toks, _ in plain.values())


def test_with_batch_invariant_rows_a_finished_requests_row_is_left_out_not_run_again():
    script: Script = {0: [("add", f"r{i}", _prompt(20 + i, 10), _greedy(4 + 3 * i)) for i in range(4)]}
    plain, ahead, engine = _both(script, invariant=True)
    assert ahead == plain
    assert engine.runner.rows_independent and engine.lookahead.num_dropped == 0


def test_tensor_parallel_ranks_get_the_launched_steps_tokens():
    """Rank 1 builds its step from the broadcast batch: the launch's tokens must be in it, not the placeholders."""
    script: Script = {0: [("add", f"t{i}", _prompt(30 + i, 9 + i), _greedy(8 + 4 * i)) for i in range(3)]}
    single = _run(one := _engine(False), script)
    one.shutdown()
    plain, ahead, engine = _both(script, tp=2)
    assert ahead == plain
    assert [toks for toks, _ in ahead.values()] == [toks for toks, _ in single.values()]
    assert engine.lookahead.num_used > 0


def test_logprobs_and_prefills_step_without_a_launch():
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, ignore_eos=True)
    engine = _engine(True)
    try:
        out = engine.generate([_prompt(5, 8)], params)[0]
    finally:
        engine.shutdown()
    assert len(out.token_ids) == 5 and out.logprobs is not None and len(out.logprobs) == 5
    assert engine.lookahead.num_used == 0


@pytest.mark.parametrize("device", ["cpu"])
def test_async_scheduling_is_on_only_on_cuda_by_default(device: str):
    engine = LLMEngine(EngineConfig(runner=RunnerConfig(model="dummy:tiny", device=device, num_blocks=16)))
    try:
        assert engine.lookahead.enabled is False
    finally:
        engine.shutdown()
