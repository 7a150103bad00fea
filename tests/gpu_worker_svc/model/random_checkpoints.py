"""Tiny random Hugging Face models, and the checkpoints the tests write from them.

Each model is a real transformers model, so its forward pass is the reference the
runtime must match. Checkpoints are written the way their producers write them:
safetensors folders by `save_pretrained`, GGUF files laid out like llama.cpp's
converter (its tensor names, its Q/K row permutation for llama) through `gguf.GGUFWriter`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel


def random_hf_model(config: PretrainedConfig, seed: int = 0) -> PreTrainedModel:
    """An fp32 causal LM in eval mode whose every parameter is drawn from a seeded normal.

    transformers' own init (std 0.02, unit norms, zero biases) gives near-zero logits that
    would hide layout bugs, so weights are scaled by 1/sqrt(fan_in) to keep activations and
    logits of order one, and norms and biases get random values too.
    """
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)
    return model.eval()


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_logits(model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    """HF's logits at every position of `prompt`, [len, vocab]."""
    return model(torch.tensor([prompt])).logits[0].float()


# HF parameter name (within a layer, or top level) -> llama.cpp tensor name. Written out
# here rather than imported, so a wrong entry in the loader's own table cannot hide.
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`."""
    module, suffix = hf_name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{_LAYER_NAMES[rest]}.{suffix}"
    return f"{_TOP_NAMES[module]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Q/K row permutation (HF rotate-half -> interleaved rope pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    model: PreTrainedModel,
    path: Path,
    qtype: GGMLQuantizationType,
    omit: set[str] | frozenset[str] = frozenset(),
    extra: dict[str, np.ndarray] | None = None,
    arch: str = "llama",
) -> dict[str, torch.Tensor]:
    """Write a Llama (or, with `arch` "qwen3", a Qwen3) `model` as llama.cpp's converter does, its 2-D
    weights stored as `qtype` (norms as F32). Only llama's Q/K rows are permuted: llama.cpp rotates
    Qwen's in HF's rotate-half layout (NeoX).

    `omit` names HF tensors to leave out, to write a broken file; `extra` adds GGUF tensors by
    their GGUF name, as stored (llama.cpp's `rope_freqs.weight`).

    Returns the state dict the file holds, in HF layout, after the quantization round trip:
    load it into the HF model to get the reference for this file.
    """
    cfg = model.config
    writer = GGUFWriter(path, arch)
    writer.add_name(path.stem)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)

    reference: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name in omit or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue  # for tied embeddings llama.cpp writes no `output`: token_embd serves both
        w = tensor.numpy().astype(np.float32)
        if w.ndim == 1:
            writer.add_tensor(gguf_name(name), w)
            reference[name] = tensor.clone()
            continue
        # Quantization blocks run along a row, and the permutation only moves whole rows,
        # so dequantize(quantize(w)) is the reference whatever the row order on disk.
        reference[name] = torch.from_numpy(dequantize(quantize(w, qtype), qtype).reshape(w.shape).copy())
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        stored = quantize(w, qtype)
        writer.add_tensor(gguf_name(name), stored, raw_dtype=qtype if stored.dtype == np.uint8 else None)
    for name, tensor in (extra or {}).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference
