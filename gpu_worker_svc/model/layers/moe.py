"""Mixture of Experts: top-k routing over SwiGLU experts stored stacked per layer, run as one grouped dispatch.

Every (token, choice) pair of a step is sorted by expert, so each expert's tokens are one contiguous slice
of a single gathered batch: a prefill and a decode step take the same path, and nothing loops over tokens.
The experts are split across the tensor-parallel ranks (expert parallelism within the worker): each rank
holds E / tp whole experts, computes its experts' share of every token, and the block's one all-reduce
adds the ranks' shares (and a shared expert's row-parallel halves) together.
"""

from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker_svc.model.layers.kernels import cpu_kernels
from gpu_worker_svc.model.parallel import TPGroup

# A checkpoint's per-expert tensors (`...mlp.experts.5.up_proj.weight`), each one part of a stacked parameter.
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_TENSOR = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$"
)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) of each token's top-k experts.

    The softmax runs over every expert in float32, as HF's routers do; `renormalize` rescales the k
    chosen to sum to 1, which is the softmax over their k logits alone (Mixtral; Qwen-MoE with
    norm_topk_prob). Without it each weight stays its share of all experts (Qwen2-MoE's default).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_parameter(name: str) -> tuple[str, tuple[int, int]] | None:
    """A per-expert checkpoint tensor's stacked parameter and its shard there, (expert, part index in
    EXPERT_PARTS); None for any other tensor."""
    m = _EXPERT_TENSOR.match(name)
    if m is None:
        return None
    part = EXPERT_PARTS.index(m["part"])
    stacked = "down_proj" if part == 2 else "gate_up_proj"
    return f"{m['prefix']}.{stacked}", (int(m["expert"]), part)


def expert_tensor_name(param: str, shard: tuple[int, int]) -> str:
    """The checkpoint's name of one shard of a stacked parameter (`...experts.gate_up_proj`, (5, 1) ->
    `...experts.5.up_proj.weight`)."""
    prefix = param.rsplit(".", 1)[0]
    return f"{prefix}.{shard[0]}.{EXPERT_PARTS[shard[1]]}.weight"


class ReplicatedLinear(nn.Module):
    """y = x W^T with W whole on every rank: a router's (or a shared expert's gate's) few rows, which each
    rank needs for every token."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = lambda p, t, s=None: p.data.copy_(t.read())  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class StackedExperts(nn.Module):
    """This rank's experts, E / tp whole SwiGLU MLPs: gate and up stacked as gate_up_proj [E_local, 2I, H],
    down as down_proj [E_local, H, I] (HF's own layout). forward gives this rank's share of the output."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_local = num_experts // tp.world_size
        self.first = tp.rank * self.num_local
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(
            torch.empty(self.num_local, 2 * intermediate, hidden, dtype=dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(self.num_local, hidden, intermediate, dtype=dtype), requires_grad=False
        )
        mine = range(self.first, self.first + self.num_local)
        # What a complete checkpoint gives each parameter on this rank: its own experts' tensors only.
        for param, parts in ((self.gate_up_proj, (0, 1)), (self.down_proj, (2,))):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            param.checkpoint_shards = [(e, part) for e in mine for part in parts]  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, tensor, shard: tuple[int, int]) -> None:
        expert, part = shard
        local = expert - self.first
        if not 0 <= local < self.num_local:
            return  # another rank's expert: this rank never reads it
        n = self.intermediate
        rows = param.data[local] if part == 2 else param.data[local, part * n : (part + 1) * n]
        rows.copy_(tensor.read())

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts' weighted outputs summed per token [T, H] (zero where it holds none of a
        token's experts). x [T, H]; weights, ids [T, k] from route()."""
        top_k = ids.shape[1]
        local = ids.reshape(-1) - self.first
        mine = (local >= 0) & (local < self.num_local)
        # Pairs routed to other ranks' experts form one last group, sorted past this rank's own.
        group = torch.where(mine, local, self.num_local)
        # Sorted by expert, a token's pairs are added in ascending expert order, as HF adds them; stable, so
        # each expert's rows are its tokens in order, the same for the same step.
        order = torch.argsort(group, stable=True)
        rows = order // top_k  # the token of each sorted pair
        pair_weights = weights.reshape(-1)[order].to(x.dtype)
        out = torch.zeros_like(x)
        if self._grouped_gemm(x):
            # Counted by a scatter-add: bincount would read its size from the device.
            counts = torch.zeros(self.num_local + 1, dtype=torch.long, device=x.device)
            counts.scatter_add_(0, group, torch.ones_like(group))
            y = self._grouped_swiglu(x[rows], counts)
            # Past the last offset the grouped GEMM leaves rows unwritten: they are other ranks' pairs.
            y = torch.where(mine[order][:, None], y * pair_weights[:, None], 0.0)
            return out.index_add_(0, rows, y)
        # The slices' bounds, read on the host once a layer (which bincount's own size read costs nothing more).
        bounds = torch.bincount(group, minlength=self.num_local + 1).cumsum(0).tolist()
        n = bounds[-2]  # this rank's pairs, sorted first
        xs = x[rows[:n]]
        y = torch.empty_like(xs)
        start = 0
        # A loop over this rank's experts, never over tokens: each expert's rows are one contiguous slice,
        # run as two GEMMs. On CPU that is the batched path; the grouped GEMM replaces it on CUDA.
        for e, end in enumerate(bounds[:-1]):
            if end > start:
                gate_up = F.linear(xs[start:end], self.gate_up_proj[e])
                y[start:end] = F.linear(_silu_mul(gate_up), self.down_proj[e])
            start = end
        return out.index_add_(0, rows[:n], y * pair_weights[:n, None])

    @staticmethod
    def _grouped_gemm(x: torch.Tensor) -> bool:
        """Whether torch's grouped GEMM runs this step (bf16 on CUDA, sm80 and later): one kernel for all the
        experts, with no host read."""
        return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm") and _sm80(x.device.index or 0)

    def _grouped_swiglu(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = counts[: self.num_local].cumsum(0).to(torch.int32)  # group e's rows end at offs[e]
        gate_up = F.grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs)
        return F.grouped_mm(_silu_mul(gate_up), self.down_proj.transpose(1, 2), offs=offs)


@functools.cache
def _sm80(device: int) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [T, 2n] -> [T, n]; one pass on CPU float32 (kernels/silu_mul.cpp)."""
    if gate_up.device.type == "cpu" and gate_up.dtype == torch.float32 and gate_up.is_contiguous():
        kernel = cpu_kernels.silu_mul()
        if kernel is not None:
            return kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SparseMoeBlock(nn.Module):
    """A decoder layer's MoE MLP: the router (`gate`, replicated), this rank's experts, and optionally a
    shared expert every token goes through, scaled by a sigmoid gate (Qwen2-MoE). One all-reduce adds up
    the ranks' expert shares and the shared expert's row-parallel halves."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        renormalize: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = ReplicatedLinear(hidden, num_experts, dtype)
        self.experts = StackedExperts(num_experts, hidden, intermediate, tp, dtype)
        # The shared expert must not all-reduce its own output: this block's one all-reduce covers it.
        self.shared_expert = shared_expert
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, dtype) if shared_expert is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        y = self.experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # The sigmoid is one scalar per token, so it scales each rank's half of the sum alike.
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(y)
