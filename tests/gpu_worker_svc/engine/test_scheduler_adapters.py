"""The batch scheduler with LoRA adapters: at most max_loras_per_batch adapters run at once, a request
of another adapter waits without holding up the rest, and adapters never share prefix-cache blocks."""

from shardline.core.prefix_hash import chain_root
from tests.gpu_worker_svc.engine.test_batch_scheduler import run_to_end, step


def _with_adapters(seqs, adapters):
    for seq, adapter in zip(seqs, adapters):
        seq.adapter = adapter
        seq.chain_root = chain_root(adapter) if adapter is not None else None
    return seqs


def test_a_request_of_an_adapter_beyond_the_limit_waits_and_others_pass_it(create_scheduler, create_requests):
    sched = create_scheduler(max_loras_per_batch=2)
    seqs = _with_adapters(create_requests(5, num_tokens=4, max_tokens=3), ["x", "y", "z", None, "x"])
    for seq in seqs:
        sched.add(seq)
    out, _ = step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["req0", "req1", "req3", "req4"]
    assert seqs[2] in sched.waiting
    finished = run_to_end(sched)
    assert {s.request_id for s in finished} == {"req0", "req1", "req2", "req3", "req4"}


def test_running_adapters_never_exceed_the_limit(create_scheduler, create_requests):
    sched = create_scheduler(max_loras_per_batch=3, max_num_seqs=8)
    names = ["a", "b", "c", "d", "e", None, "a", "e", "b", "d"]
    for seq in _with_adapters(create_requests(len(names), num_tokens=5, max_tokens=4), names):
        sched.add(seq)
    while sched.has_unfinished:
        step(sched)
        assert len({seq.adapter for seq in sched.running if seq.adapter is not None}) <= 3


def test_the_same_prompt_under_two_adapters_shares_no_blocks(create_scheduler, create_requests):
    sched = create_scheduler()
    first, second, base = _with_adapters(create_requests(3, num_tokens=13, same_prompt=True), ["x", "y", None])
    sched.add(first)
    run_to_end(sched)
    for seq in (second, base):
        sched.add(seq)
        step(sched)
        assert seq.num_cached_tokens == 0
    again = _with_adapters(create_requests(1, num_tokens=13, same_prompt=True, prefix="again"), ["x"])[0]
    sched.add(again)
    step(sched)
    assert again.num_cached_tokens == 12  # its own adapter's three full blocks
