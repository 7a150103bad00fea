"""Requests naming a LoRA adapter go only to the workers that serve it, and their prefixes are
remembered apart from the base model's."""

from scheduler_svc.live_request import LiveRequest
from scheduler_svc.router import Router, prefix_hashes
from scheduler_svc.worker_registry import WorkerRegistry
from shardline.core.prefix_hash import chain_root, hash_block_tokens
from shardline.proto import sampling_pb2, worker_pb2


def _registry() -> WorkerRegistry:
    registry = WorkerRegistry(overcommit=1.0, heartbeat_timeout_s=10)
    registry.add(worker_pb2.WorkerInfo(worker_id="plain", model="m", block_size=4, max_num_seqs=8))
    registry.add(worker_pb2.WorkerInfo(worker_id="tuned", model="m", block_size=4, max_num_seqs=8, adapters=["x"]))
    return registry


def _request(model: str, prompt: list[int]) -> LiveRequest:
    return LiveRequest("r", "gw", model, 0, prompt, sampling_pb2.SamplingParameters(), [], 0.0)


def test_an_adapters_requests_go_only_to_workers_that_serve_it() -> None:
    registry = _registry()
    assert [w.worker_id for w in registry.with_room("x")] == ["tuned"]
    assert {w.worker_id for w in registry.with_room("m")} == {"plain", "tuned"}
    assert registry.with_room("y") == []
    assert registry.longest_sequence("y") is None


def test_an_adapters_prefixes_are_remembered_apart_from_the_base_models() -> None:
    prompt = list(range(100, 108))
    root = chain_root("x")
    assert prefix_hashes(prompt, 4, max_blocks=2, root=root) == [
        h := hash_block_tokens(root, prompt[:4]),
        hash_block_tokens(h, prompt[4:]),
    ]
    assert set(prefix_hashes(prompt, 4, max_blocks=2)).isdisjoint(prefix_hashes(prompt, 4, max_blocks=2, root=root))
    router, registry = Router(load_slack=1.0), _registry()
    assert router.choose(_request("x", prompt), registry.with_room("x")).worker_id == "tuned"
