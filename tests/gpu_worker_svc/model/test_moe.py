"""The Mixture-of-Experts layer (gpu_worker_svc/model/layers/moe.py) against HF's own routers and sparse
blocks, the ranks' expert shares against the whole, and the MoE families' loading: the registry, which
layers are sparse, a sharded checkpoint with its index, and what a wrong checkpoint or TP size is told.

Whole-model parity (HF's greedy tokens and every step's logits, batched and chunked, at TP 1 and TP 2) is
tests/gpu_worker_svc/model/test_model_families.py's, whose cases include the MoE ones (family_cases.py).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock, Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from gpu_worker_svc.engine.model_runner import ModelRunner, RunnerConfig
from gpu_worker_svc.model.checkpoint import CheckpointError
from gpu_worker_svc.model.config import ModelConfig, ModelConfigError
from gpu_worker_svc.model.families import MODEL_CLASSES
from gpu_worker_svc.model.families.llama import LlamaMLP
from gpu_worker_svc.model.families.mixtral import MixtralForCausalLM
from gpu_worker_svc.model.families.moe import MoeForCausalLM
from gpu_worker_svc.model.families.qwen3_moe import Qwen3MoeForCausalLM
from gpu_worker_svc.model.layers.moe import SparseMoeBlock, StackedExperts, route
from gpu_worker_svc.model.loader import load_config, load_model
from gpu_worker_svc.model.parallel import TPGroup
from tests.gpu_worker_svc.model.family_cases import MOE_CASES, TOL, SavedModel, save_cases
from tests.gpu_worker_svc.model.paged_driver import PagedDriver

HIDDEN = 64
LAYER_TOL = 1e-5  # max |ours - HF| of one sparse block's output, float32
_MOE = dict(hidden_size=HIDDEN, intermediate_size=96, num_experts_per_tok=2, hidden_act="silu")


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SavedModel]:
    return save_cases(tmp_path_factory, MOE_CASES)


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


def test_the_registry_builds_each_moe_family_and_its_sparse_layers(saved_models):
    assert MODEL_CLASSES["MixtralForCausalLM"] is MixtralForCausalLM
    assert MODEL_CLASSES["Qwen3MoeForCausalLM"] is Qwen3MoeForCausalLM
    assert MODEL_CLASSES["Qwen2MoeForCausalLM"] is MoeForCausalLM
    expected = {
        "mixtral-gqa4x2-8experts-top2": (MixtralForCausalLM, [True, True], 8, True, 0),
        "qwen3moe-gqa4x2-8experts-normtopk-denselayer1": (Qwen3MoeForCausalLM, [True, False, True], 8, True, 0),
        "qwen2moe-mha4-4experts-shared-sparsestep2": (MoeForCausalLM, [False, True, False, True], 4, False, 48),
    }
    for case, (cls, sparse, experts, renormalize, shared) in expected.items():
        cfg = load_config(saved_models[case].folder)
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (experts, 2, renormalize)
        assert cfg.shared_expert_intermediate_size == shared
        model = load_model(saved_models[case].folder, TPGroup())
        assert type(model) is cls and not model.model.fusable
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == sparse
        assert [isinstance(layer.mlp, LlamaMLP) for layer in model.model.layers] == [not s for s in sparse]
    # HF's own model agrees on which layers are sparse.
    hf = AutoModelForCausalLM.from_pretrained(saved_models["qwen3moe-gqa4x2-8experts-normtopk-denselayer1"].folder)
    assert [hasattr(layer.mlp, "experts") for layer in hf.model.layers] == [True, False, True]


def test_a_mixtral_checkpoint_sharded_over_files_loads_from_its_index(saved_models, tmp_path):
    """save_pretrained's shards with their index, in Mixtral's own names (block_sparse_moe, w1/w2/w3)."""
    saved = saved_models["mixtral-gqa4x2-8experts-top2"]
    AutoModelForCausalLM.from_pretrained(saved.folder, dtype=torch.float32).save_pretrained(
        tmp_path, max_shard_size="60KB"
    )
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in index
    assert len(set(index.values())) >= 3
    runner = ModelRunner(RunnerConfig(model=str(tmp_path), num_blocks=64))
    try:
        driver = PagedDriver(runner)
        seqs = [driver.add(p) for p in saved.prompts]
        logits = driver.step({s: len(p) for s, p in zip(seqs, saved.prompts)})
    finally:
        runner.shutdown()
    for s, row in zip(seqs, logits):
        assert (row - saved.logits[s][len(saved.prompts[s]) - 1]).abs().max().item() <= TOL


def _rewritten(saved: SavedModel, tmp_path, change) -> str:
    """The case's folder copied, its safetensors tensors passed through `change`."""
    folder = tmp_path / "changed"
    shutil.copytree(saved.folder, folder)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)
    return str(folder)


def test_a_checkpoint_missing_an_expert_is_refused_naming_it(saved_models, tmp_path):
    saved = saved_models["qwen3moe-gqa4x2-8experts-normtopk-denselayer1"]
    folder = _rewritten(saved, tmp_path, lambda t: t.pop("model.layers.2.mlp.experts.7.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\): model\.layers\.2\.mlp\.experts\.7\.down_proj"):
        load_model(folder, TPGroup())


def test_an_expert_past_num_experts_or_in_a_dense_layer_is_refused(saved_models, tmp_path):
    saved = saved_models["qwen3moe-gqa4x2-8experts-normtopk-denselayer1"]

    def extra(name: str):
        return lambda t: t.update({name: t["model.layers.0.mlp.experts.0.gate_proj.weight"].clone()})

    past = _rewritten(saved, tmp_path / "past", extra("model.layers.0.mlp.experts.8.gate_proj.weight"))
    with pytest.raises(CheckpointError, match=r"experts\.8\.gate_proj\.weight' has no place.*num_experts=8"):
        load_model(past, TPGroup())
    dense = _rewritten(saved, tmp_path / "dense", extra("model.layers.1.mlp.experts.0.gate_proj.weight"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.0\.gate_proj\.weight' has no place"):
        load_model(dense, TPGroup())


def test_a_tp_size_that_does_not_divide_the_experts_is_refused_naming_the_valid_ones():
    """Each rank holds whole experts: 6 experts over 4 ranks would not split, though the heads would."""
    config = MixtralConfig(
        vocab_size=256, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2, num_local_experts=6, **_MOE
    ).to_dict()
    config["architectures"] = ["MixtralForCausalLM"]
    cfg = ModelConfig.from_hf_dict(config)
    assert cfg.valid_tp_sizes(8) == [1, 2]
    with pytest.raises(ModelConfigError, match=r"num_experts 6 is not divisible by 4; valid sizes: 1, 2"):
        cfg.check_tp(4)


def test_batch_invariance_is_refused_for_a_moe_naming_why(saved_models):
    folder = saved_models["mixtral-gqa4x2-8experts-top2"].folder
    with pytest.raises(ValueError, match=r"batch_invariant is not supported for MixtralForCausalLM: its experts"):
        ModelRunner(RunnerConfig(model=str(folder), num_blocks=16, batch_invariant=True))
