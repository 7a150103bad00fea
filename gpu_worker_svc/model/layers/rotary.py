"""Rotary position embedding (HF's rotate-half layout), with linear, dynamic NTK, YaRN, Llama 3 and LongRoPE
frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _longrope(head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency divisors, the long ones past the pretraining context, and a scale of
    cos and sin. HF picks short or long by the length of each forward pass, which a KV cache written at
    earlier lengths cannot follow; here the served context picks once (config.py warns at load when the
    long factors then also rotate sequences that HF would rotate with the short ones)."""
    original = scaling["original_max_position_embeddings"]
    factors = scaling["long_factor"] if max_positions > original else scaling["short_factor"]
    if len(factors) != head_dim // 2:
        raise ValueError(f"longrope has {len(factors)} factors; head_dim {head_dim} needs {head_dim // 2}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    factor = scaling["factor"]
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv, float(attention)


def _dynamic_ntk(head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int) -> torch.Tensor:
    """Dynamic NTK: past the pretraining context HF raises theta by the sequence's length, anew for each
    forward pass, which a KV cache written at earlier lengths cannot follow. Here the served context
    picks once: within the original context, the plain frequencies (HF's for every sequence there); past
    it, those of a sequence as long as the served context (loader.py warns at load)."""
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    if max_positions > original:
        theta = theta * ((factor * max_positions / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _yarn(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: the frequencies that turn fewer than beta_slow times over the pretraining context are divided by
    the factor, those that turn more than beta_fast times kept, a linear ramp between; spelled as HF's
    _compute_yarn_parameters. Its attention factor (config.py fills it in) scales cos and sin."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    kept = 1 - torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - kept) + extrapolation * kept


def _inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int | None = None
) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "dynamic":
        return _dynamic_ntk(head_dim, theta, scaling, max_positions or scaling["original_max_position_embeddings"])
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    if kind != "llama3":
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported (supported: linear, dynamic, yarn, llama3, longrope)"
        )
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables, gathered once per step for all layers (`prepare`) and applied per layer (`apply`)."""

    cos: torch.Tensor  # [max_positions, head_dim], a buffer
    sin_signed: torch.Tensor  # the same, with the first half's sign flipped

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        freq_factors: list[float] | None = None,
    ) -> None:
        super().__init__()
        attention = 1.0  # LongRoPE and YaRN scale cos and sin
        kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
        if scaling and kind == "longrope":
            inv_freq, attention = _longrope(head_dim, theta, scaling, max_positions)
        elif freq_factors is not None:  # llama.cpp's form of the same scaling: divisors, one per frequency
            if len(freq_factors) != head_dim // 2:
                raise ValueError(
                    f"rope_freqs has {len(freq_factors)} factors; head_dim {head_dim} needs {head_dim // 2}"
                )
            inv_freq = _inv_freq(head_dim, theta, None) / torch.tensor(freq_factors, dtype=torch.float32)
        else:
            inv_freq = _inv_freq(head_dim, theta, scaling, max_positions)
            if scaling and kind == "yarn":
                attention = float(scaling["attention_factor"])
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos, sin_signed = torch.cat([freqs, freqs], dim=-1).cos(), torch.cat([-freqs, freqs], dim=-1).sin()
        if attention != 1.0:
            cos, sin_signed = cos * attention, sin_signed * attention
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        # rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated): one op instead of four.
        self.register_buffer("sin_signed", sin_signed.to(dtype), persistent=False)

    def prepare(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (cos, signed sin), each [T, 1, D]."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin_signed.index_select(0, positions).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, H, D], queries and keys together (HF's rotate-half layout)."""
        cos, sin_signed = rope
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)
