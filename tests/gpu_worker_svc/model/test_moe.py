"""The Mixture-of-Experts layer (gpu_worker_svc/model/layers/moe.py) against HF's own routers and sparse
blocks, and the ranks' expert shares against the whole."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock, Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.families.llama import LlamaMLP
from gpu_worker_svc.model.layers.moe import SparseMoeBlock, StackedExperts, route
from gpu_worker_svc.model.parallel import TPGroup

HIDDEN = 64
LAYER_TOL = 1e-5  # max |ours - HF| of one sparse block's output, float32
_MOE = dict(hidden_size=HIDDEN, intermediate_size=96, num_experts_per_tok=2, hidden_act="silu")


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights of order 1 / sqrt(fan_in), so routing and outputs are far from ties and from zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return module.eval()


def _hidden(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("router", "renormalize"),
    [
        (MixtralTopKRouter(MixtralConfig(num_local_experts=8, **_MOE)), True),
        (Qwen2MoeTopKRouter(Qwen2MoeConfig(num_experts=8, norm_topk_prob=False, **_MOE)), False),
        (Qwen2MoeTopKRouter(Qwen2MoeConfig(num_experts=8, norm_topk_prob=True, **_MOE)), True),
    ],
    ids=["mixtral", "qwen-moe", "qwen-moe-norm-topk-prob"],
)
def test_routing_weights_and_experts_are_each_routers(router, renormalize):
    """Mixtral's softmax over the top-k logits, Qwen-MoE's softmax share with and without norm_topk_prob."""
    _randomize(router, seed=1)
    x = _hidden(50)
    with torch.no_grad():
        _, hf_weights, hf_ids = router(x)
    weights, ids = route(torch.nn.functional.linear(x, router.weight), 2, renormalize)
    assert torch.equal(ids, hf_ids)
    assert (weights - hf_weights.float()).abs().max().item() <= 1e-6
    assert torch.allclose(weights.sum(-1), torch.ones(50)) == renormalize


def _ours_from_hf(hf: torch.nn.Module, num_experts: int, renormalize: bool, width: int, shared: int) -> SparseMoeBlock:
    """layers/moe.py's block at TP 1 holding HF's block's weights (the stacked experts share HF's layout)."""
    cfg = ModelConfig("LlamaForCausalLM", 256, HIDDEN, 96, 1, 4, 4, 16)  # the shared expert's hidden size
    shared_expert = LlamaMLP(cfg, TPGroup(), torch.float32, width=shared, reduce_results=False) if shared else None
    ours = SparseMoeBlock(HIDDEN, num_experts, 2, width, renormalize, TPGroup(), torch.float32, shared_expert)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
        if shared_expert is not None:
            mlp = hf.shared_expert
            shared_expert.gate_up_proj.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            shared_expert.down_proj.weight.copy_(mlp.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)  # type: ignore[union-attr]
    return ours


@pytest.mark.parametrize("tokens", [1, 3, 70])
@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "qwen2-moe-shared-expert"])
def test_the_sparse_block_is_hfs_for_a_decode_and_a_prefill(family, tokens):
    """One grouped dispatch per layer, whatever the step's token count, gives HF's sparse block's output."""
    if family == "mixtral":
        hf = MixtralSparseMoeBlock(MixtralConfig(num_local_experts=8, **_MOE))
        ours_args = (8, True, 96, 0)
    elif family == "qwen3-moe":
        hf = Qwen3MoeSparseMoeBlock(
            Qwen3MoeConfig(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, **_MOE)
        )
        ours_args = (8, True, 32, 0)
    else:
        hf = Qwen2MoeSparseMoeBlock(
            Qwen2MoeConfig(
                num_experts=4,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                norm_topk_prob=False,
                **_MOE,
            )
        )
        ours_args = (4, False, 32, 48)
    _randomize(hf, seed=2)
    ours = _ours_from_hf(hf, *ours_args)
    x = _hidden(tokens, seed=3)
    with torch.no_grad():
        ref = hf(x[None])[0]
        got = ours(x)
    assert (got - ref).abs().max().item() <= LAYER_TOL


def test_each_ranks_experts_are_its_own_and_their_shares_add_up_to_the_whole():
    """Expert parallelism: rank r of 2 holds experts 4r..4r+3 only; its share of a token is zero unless one
    of its experts was chosen, and the ranks' shares sum (the block's all-reduce) to the TP 1 output."""
    whole = _randomize(StackedExperts(8, HIDDEN, 32, TPGroup(), torch.float32), seed=4)
    x = _hidden(40, seed=5)
    weights, ids = route(torch.randn(40, 8, generator=torch.Generator().manual_seed(6)), 2, True)
    shares = []
    for rank in range(2):
        part = StackedExperts(8, HIDDEN, 32, TPGroup(rank=rank, world_size=2), torch.float32)
        assert part.gate_up_proj.checkpoint_shards == [(e, p) for e in range(4 * rank, 4 * rank + 4) for p in (0, 1)]
        with torch.no_grad():
            part.gate_up_proj.copy_(whole.gate_up_proj[4 * rank : 4 * rank + 4])
            part.down_proj.copy_(whole.down_proj[4 * rank : 4 * rank + 4])
            shares.append(part(x, weights, ids))
        untouched = ~((ids >= 4 * rank) & (ids < 4 * rank + 4)).any(-1)
        assert untouched.any() and torch.equal(shares[-1][untouched], torch.zeros_like(x[untouched]))
    with torch.no_grad():
        ref = whole(x, weights, ids)
    assert (shares[0] + shares[1] - ref).abs().max().item() <= 1e-6


@pytest.mark.parametrize("rank", [0, 1])
def test_the_grouped_gemm_path_gives_the_per_expert_loops_output(monkeypatch, rank):
    """The path CUDA bf16 takes (torch's grouped GEMM, no host read), forced on CPU in float32, where torch
    runs it too: as rank r of 2, the pairs routed to the other rank's experts sort past the last offset."""
    experts = _randomize(StackedExperts(8, HIDDEN, 32, TPGroup(rank=rank, world_size=2), torch.float32), seed=7)
    x = _hidden(70, seed=8)
    weights, ids = route(torch.randn(70, 8, generator=torch.Generator().manual_seed(9)), 2, False)
    with torch.no_grad():
        loop = experts(x, weights, ids)
        monkeypatch.setattr(StackedExperts, "_grouped_gemm", staticmethod(lambda x: True))
        grouped = experts(x, weights, ids)
    assert loop.abs().max().item() > 0.1
    assert (grouped - loop).abs().max().item() <= 1e-5
