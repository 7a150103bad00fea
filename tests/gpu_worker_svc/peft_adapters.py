"""LoRA adapters made by the `peft` package with random weights, saved in its format, and its
merged-weight model as the reference for their outputs."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What an adapter made for a test adapts, and how."""

    r: int
    targets: tuple[str, ...]
    alpha: float = 16.0
    use_rslora: bool = False
    seed: int = 0


def make_adapter(hf_model: torch.nn.Module, folder: Path, spec: AdapterSpec) -> torch.nn.Module:
    """Saves a PEFT adapter of `spec` for `hf_model` (left untouched) in `folder`, with random A and
    non-zero B so that it changes the output; returns peft's merged-weight model of it."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.use_rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    g = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:  # x A^T of order one per rank, whatever the layer's width
                param.copy_(torch.randn(param.shape, generator=g) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.02)
    model.save_pretrained(str(folder), save_embedding_layers=False)  # "auto" would look the base up online
    return model.merge_and_unload().eval()


def greedy(hf_model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy continuation of `prompt`, never stopping at EOS."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()
