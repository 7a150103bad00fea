"""kernels/gguf_linear.cpp and layers/gguf.py: GGUF's Q4_0, Q4_1 and Q8_0 blocks multiplied as stored.

Every build this CPU runs (AVX2 and scalar here; AVX-512 and VNNI where the CPU has them) is held to
the same float64 reference and to the scalar build's bits; the AVX-512 builds are compiled on every
machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from gpu_worker_svc.model.layers.gguf import GGUFWeight, block_row_bytes, blocks_of_panels, panels_of
from gpu_worker_svc.model.layers.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.gguf_linear() is None, reason="the CPU kernels cannot be built here")

TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
KERNELS = torch.ops.shardline_cpu.gguf_kernels() if cpu_kernels.gguf_linear() is not None else []
U = 2.0**-24  # float32's unit roundoff


def blocks_of(w: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """`w` [N, K] quantized by the gguf package, as the file would store it: uint8 [N, row bytes]."""
    return torch.from_numpy(np.ascontiguousarray(quantize(w.numpy(), qtype)))


def dequantized64(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """The weights in float64, and |each part| summed (the magnitudes the kernel adds: d q and m apart)."""
    b = blocks.numpy()
    n = b.shape[0]
    size = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20, GGMLQuantizationType.Q8_0: 34}[qtype]
    b = b.reshape(n, -1, size)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float64)
    if qtype == GGMLQuantizationType.Q8_0:
        scaled = d * b[..., 2:].view(np.int8).astype(np.float64)
        return scaled.reshape(n, -1), np.abs(scaled).reshape(n, -1)
    start = 2 if qtype == GGMLQuantizationType.Q4_0 else 4
    q = np.concatenate([b[..., start:] & 0x0F, b[..., start:] >> 4], axis=-1).astype(np.float64)
    if qtype == GGMLQuantizationType.Q4_0:
        scaled = d * (q - 8)
        return scaled.reshape(n, -1), np.abs(scaled).reshape(n, -1)
    m = b[..., 2:4].copy().view(np.float16).astype(np.float64)
    return (d * q + m).reshape(n, -1), (np.abs(d * q) + np.abs(m)).reshape(n, -1)


def quantized_activations64(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """x as the kernel quantizes it (float64 values of its codes), and each element's block scale d."""
    codes, d, _ = torch.ops.shardline_cpu.gguf_quantize_rows(x)
    scale = d.double().repeat_interleave(32, dim=1).numpy()
    return codes.double().numpy() * scale, scale


def random_case(n: int, k: int, rows: int, qtype: GGMLQuantizationType, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + 0.01 * torch.randn(n, 1, generator=g)  # rows with an offset
    x = torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    return blocks_of(w, qtype), x


@pytest.mark.parametrize("isa", KERNELS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n, k, rows", [(37, 576, 1), (100, 96, 5), (3, 32, 33), (64, 1536, 2), (1, 64, 1)])
def test_each_kernel_is_the_float64_product_of_the_blocks_and_the_quantized_activations(isa, qtype, n, k, rows):
    """Within fp32 summation of the per-block exact integer sums: |error| <= (blocks + 4) u sum|terms|."""
    blocks, x = random_case(n, k, rows, qtype)
    y = GGUFWeight(qtype, blocks, k, isa).matmul(x)
    w64, parts = dequantized64(blocks, qtype)
    x64, _ = quantized_activations64(x)
    reference = x64 @ w64.T
    bound = (k // 32 + 4) * U * (np.abs(x64) @ parts.T)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert (np.abs(y.double().numpy() - reference) <= bound).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_kernels_are_within_the_activations_rounding_of_the_fp32_layer(qtype):
    """Against today's path (the dequantized weights in an fp32 F.linear): each input is off by at
    most half its block's step d, so |error| <= sum_j |w_j| d_j / 2, plus fp32 rounding."""
    blocks, x = random_case(576, 576, 7, qtype, seed=1)
    w64, parts = dequantized64(blocks, qtype)
    fp32 = F.linear(x, torch.from_numpy(w64).float()).double().numpy()
    _, steps = quantized_activations64(x)
    bound = (steps / 2) @ np.abs(w64).T + 1e-5 * (np.abs(x.double().numpy()) @ parts.T)
    for isa in KERNELS:
        y = GGUFWeight(qtype, blocks, 576, isa).matmul(x).double().numpy()
        assert (np.abs(y - fp32) <= bound).all()
        assert np.linalg.norm(y - fp32) / np.linalg.norm(fp32) < 0.01  # the typical error is far below the bound


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n, rows", [(200, 3), (37, 13), (16, 1)])
def test_every_build_gives_the_scalar_builds_bits(qtype, n, rows):
    """Every build follows one arithmetic lane for lane (kernels/gguf_dot.h), so the instruction
    set a machine picks never changes a token."""
    blocks, x = random_case(n, 1536, rows, qtype, seed=2)
    scalar = GGUFWeight(qtype, blocks, 1536, "scalar").matmul(x)
    for isa in KERNELS:
        assert torch.equal(GGUFWeight(qtype, blocks, 1536, isa).matmul(x), scalar), isa


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 16, 37, 48])
def test_panels_hold_the_files_bytes_in_another_order(qtype, n):
    blocks, _ = random_case(n, 96, 1, qtype, seed=6)
    panels = panels_of(qtype, blocks)
    assert panels.shape == (-(-n // 16), 16 * blocks.shape[1])  # as small as the file, padded to 16 rows
    assert torch.equal(blocks_of_panels(qtype, panels, n), blocks)
    assert sorted(panels[: n // 16].flatten().tolist()) == sorted(blocks[: n // 16 * 16].flatten().tolist())


@pytest.mark.parametrize("isa", KERNELS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_gives_the_same_bits_alone_in_any_batch_and_on_any_thread_count(isa, qtype):
    blocks, x = random_case(300, 576, 71, qtype, seed=3)  # 71 rows: past one 64-row activation tile
    layer = GGUFWeight(qtype, blocks, 576, isa)
    full = layer.matmul(x)
    assert torch.equal(full, torch.cat([layer.matmul(x[i : i + 1]) for i in range(71)]))
    assert torch.equal(full[5:9], layer.matmul(x[5:9]))
    assert torch.equal(full.flip(0), layer.matmul(x.flip(0).contiguous()))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(full, layer.matmul(x))
    finally:
        torch.set_num_threads(threads)


def test_activation_rows_are_quantized_per_block_of_32_with_round_half_to_even():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 96, generator=g)
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, codes 0, never a division by zero
    x[2, :32] = torch.arange(32) - 15.5  # halves: 0.5 steps round to even
    codes, d, s = torch.ops.shardline_cpu.gguf_quantize_rows(x)
    blocks = x.view(3, 3, 32)
    scale = blocks.abs().amax(-1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    expected = torch.round(blocks * inverse[..., None]).to(torch.int8)
    assert torch.equal(codes.view(3, 3, 32), expected) and torch.equal(d, scale)
    assert torch.equal(s, scale * expected.sum(-1).float())
    assert codes.abs().max() == 127 and d[1, 1] == 0 and (codes[1, 32:64] == 0).all()


def test_a_2d_or_3d_float_input_keeps_its_leading_shape_and_dtype():
    blocks, x = random_case(48, 64, 6, GGMLQuantizationType.Q4_1, seed=5)
    layer = GGUFWeight(GGMLQuantizationType.Q4_1, blocks, 64)
    flat = layer.matmul(x)
    assert torch.equal(layer.matmul(x.view(2, 3, 64)), flat.view(2, 3, 48))
    assert layer.matmul(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_malformed_weights_and_unknown_kernels_are_refused():
    blocks, _ = random_case(8, 64, 1, GGMLQuantizationType.Q4_0)
    with pytest.raises(ValueError, match="expected uint8 rows of 40 bytes, got torch.uint8 \\(8, 36\\)"):
        GGUFWeight(GGMLQuantizationType.Q4_1, blocks, 64)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        block_row_bytes(GGMLQuantizationType.Q8_0, 40)
    with pytest.raises(ValueError, match="not Q6_K"):
        GGUFWeight(GGMLQuantizationType.Q6_K, blocks, 64)
    with pytest.raises(RuntimeError, match="no kernels named"):
        GGUFWeight(GGMLQuantizationType.Q4_0, blocks, 64, "neon").matmul(torch.randn(1, 64))


def test_every_build_is_compiled_here_and_only_those_this_cpu_runs_are_offered():
    """The AVX-512 sources are part of every build; where the CPU lacks AVX-512 they refuse to run."""
    assert KERNELS[-1] == "scalar" and set(KERNELS) <= {"avx512vnni", "avx512", "avx2", "scalar"}
    blocks, x = random_case(8, 64, 1, GGMLQuantizationType.Q4_0)
    for isa in {"avx512vnni", "avx512", "avx2"} - set(KERNELS):
        with pytest.raises(RuntimeError, match=f"this CPU cannot run the {isa} kernels"):
            GGUFWeight(GGMLQuantizationType.Q4_0, blocks, 64, isa).matmul(x)
