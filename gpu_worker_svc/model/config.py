"""The model's architecture, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Every architecture a module in families/ builds; families/__init__.py checks its registry against this list
# (kept here, not there, because a config is read, and refused, before any model module is imported).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
# Architectures whose sliding window applies only when the config sets use_sliding_window (default off).
_OPT_IN_SLIDING_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Architectures with an RMSNorm over each q and k head.
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
# Architectures whose attention_bias covers o_proj too (Qwen2's and Qwen2-MoE's biases stop at q/k/v).
_O_PROJ_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *_GEMMA)
# The MLP activations families/llama.py computes (HF's names): SiLU, and Gemma's tanh-approximated GELU.
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "longrope")
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class ModelConfigError(ValueError):
    """The model's configuration is missing, malformed or unsupported."""


def _check_architecture(arch: str) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _check_supported_features(
    cfg: dict[str, Any], arch: str, rope: dict[str, Any], scaling: dict[str, Any] | None
) -> None:
    """ModelConfigError naming a setting the families here do not compute, rather than a silently wrong model."""
    act = _hidden_act(cfg, arch)
    if act not in HIDDEN_ACTS:
        raise ModelConfigError(f"hidden_act {act!r} is not supported for {arch} (supported: {', '.join(HIDDEN_ACTS)})")
    if cfg.get("use_bidirectional_attention"):
        raise ModelConfigError(f"use_bidirectional_attention is not supported for {arch} (a decoder is causal)")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelConfigError(
            f"partial_rotary_factor {partial} is not supported (the rotary embedding covers every dim)"
        )
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind not in (None, "default", *ROPE_TYPES):
        raise ModelConfigError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def _hidden_act(cfg: dict[str, Any], arch: str) -> str:
    """The MLP's activation. Gemma's configs name it hidden_activation (HF reads that one for Gemma), and
    older ones carry a hidden_act beside it that HF ignores."""
    if arch in _GEMMA:
        return str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")
    return str(cfg.get("hidden_act", cfg.get("hidden_activation", "silu")))


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float | None, dict[str, Any]]:
    """(theta, scaling or None, local layers' theta or None, the rope settings' other keys).

    transformers 5 nests rope settings in rope_parameters, per layer type for Gemma 3 ("full_attention",
    "sliding_attention"); older configs keep them flat (Gemma 3's local theta as rope_local_base_freq)."""
    nested = dict(cfg.get("rope_parameters") or {})
    local_theta = cfg.get("rope_local_base_freq")
    legacy = cfg.get("rope_scaling")
    if isinstance(nested.get("full_attention"), dict):
        local = nested.get("sliding_attention") or {}
        local_theta = local.get("rope_theta", local_theta)
        if local.get("rope_type", "default") != "default":
            raise ModelConfigError("rope scaling of the sliding-window layers is not supported (only of global ones)")
        nested, legacy = dict(nested["full_attention"]), None  # the nested settings are the whole story
    theta = nested.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = legacy or (nested if nested.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) in ("default", None):
        scaling = None
    return float(theta), scaling, None if local_theta is None else float(local_theta), nested


def _yarn_scaling(cfg: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """YaRN's settings with what HF derives filled in: the pretraining context, the factor (from the two
    contexts where a config gives none) and the attention factor that scales cos and sin."""
    scaling = dict(scaling)
    original = scaling.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 4096)
    scaling["original_max_position_embeddings"] = original
    factor = scaling.get("factor")
    if factor is None:
        factor = scaling["factor"] = cfg.get("max_position_embeddings", 4096) / original
    if scaling.get("attention_factor") is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            scaling["attention_factor"] = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            scaling["attention_factor"] = _yarn_mscale(factor)
    return scaling


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """The YaRN paper's attention scale, 0.1 * mscale * ln(factor) + 1 (1 without stretching), as HF's."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _sliding_layers(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, list[bool]]:
    """The sliding window and which layers slide: (None, []) where none does.

    Mistral and Phi-3 slide on every layer; Qwen2 and Qwen3 only with use_sliding_window, from layer
    max_window_layers on; Gemma 2 on every other layer from the first, Gemma 3 on all but every
    sliding_window_pattern-th. A config's layer_types (transformers 5 writes it) says it outright."""
    window = cfg.get("sliding_window")
    if not window or not cfg.get("use_sliding_window", arch not in _OPT_IN_SLIDING_WINDOW):
        return None, []
    if window >= cfg.get("max_position_embeddings", 4096):  # it never cuts: attend as a model without one
        return None, []
    types = cfg.get("layer_types")
    if types and arch not in ("MistralForCausalLM", "Phi3ForCausalLM"):  # HF reads no layer_types for these
        sliding = [kind == "sliding_attention" for kind in types]
    elif arch == "Gemma2ForCausalLM":
        sliding = [i % 2 == 0 for i in range(num_layers)]
    elif arch == "Gemma3ForCausalLM":
        pattern = cfg.get("sliding_window_pattern", 6)
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    elif arch in _OPT_IN_SLIDING_WINDOW:
        sliding = [i >= cfg.get("max_window_layers", 28) for i in range(num_layers)]
    else:
        sliding = [True] * num_layers
    if len(sliding) != num_layers:
        raise ModelConfigError(f"layer_types lists {len(sliding)} layers, but num_hidden_layers is {num_layers}")
    return (int(window), sliding) if any(sliding) else (None, [])


def _longrope_scaling(cfg: dict[str, Any], scaling: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Phi-3's LongRoPE settings with what HF derives filled in: the pretraining context (in the rope
    settings or, in older configs, at the top level) and the factor the attention scale comes from."""
    scaling = dict(scaling)
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not original:
        raise ModelConfigError("longrope rope_scaling lacks original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = original
    if scaling.get("factor") is None:
        scaling["factor"] = cfg.get("max_position_embeddings", 4096) / original
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != head_dim // 2:
            raise ModelConfigError(f"longrope {key} must list {head_dim // 2} factors (head_dim / 2), got {factors!r}")
    return scaling


def _moe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig's Mixture-of-Experts fields from an HF config (none for a dense architecture)."""
    if arch not in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    # Qwen-MoE configs name the expert count num_experts, Mixtral's num_local_experts; transformers 5 writes
    # either model's under the other name too.
    experts = cfg["num_local_experts"] if "num_local_experts" in cfg else cfg["num_experts"]
    if arch == "MixtralForCausalLM":  # every layer sparse; its experts are intermediate_size wide
        return dict(
            num_experts=experts,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["intermediate_size"],
            norm_topk_prob=True,
        )
    return dict(
        num_experts=experts,
        num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["moe_intermediate_size"],
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0)
        if arch == "Qwen2MoeForCausalLM"
        else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
        mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
    )


@dataclass(slots=True)
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder-only model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    # llama.cpp's per-frequency divisors [head_dim / 2]: how a GGUF file of Llama 3.1 or later carries its
    # llama3 rope scaling (a `rope_freqs` tensor, not metadata). When set, rope_scaling is not applied.
    rope_freq_factors: list[float] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v (Qwen2; Llama and Qwen3 with attention_bias)
    o_proj_bias: bool = False  # a bias on o_proj too (Llama and Qwen3 with attention_bias; never Qwen2's)
    # Mixture of Experts (0 experts: a dense model). A layer is sparse unless listed in mlp_only_layers or
    # off the decoder_sparse_step grid (Qwen-MoE); its dense MLP, if any, is intermediate_size wide.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert, sigmoid-gated (0: none)
    norm_topk_prob: bool = False  # rescale the top-k routing weights to sum to 1 (always, for Mixtral)
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each q and k head, before the rotary embedding
    hidden_act: str = "silu"  # the MLP's activation of its gate (HIDDEN_ACTS)
    sliding_window: int | None = None  # keys a sliding layer's query sees, its own included
    sliding_layers: list[bool] = field(default_factory=list)  # per layer, whether it slides; empty: none does
    attn_scale: float | None = None  # scores' scale (Gemma: query_pre_attn_scalar ** -0.5); None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None  # Gemma 2: scores capped to softcap * tanh(score / softcap)
    final_softcap: float | None = None  # Gemma 2: logits capped alike
    embed_scale: float | None = None  # Gemma: the embeddings multiplied by sqrt(hidden_size), in the model's dtype
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' rope theta, without the scaling
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""

    def __post_init__(self) -> None:
        _check_architecture(self.architecture)
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(
                f"num_experts_per_tok {self.num_experts_per_tok} must be between 1 and num_experts {self.num_experts}"
            )
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ModelConfigError(f"{len(self.sliding_layers)} sliding-layer flags for {self.num_layers} layers")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (from 0) has the sparse MoE block rather than a dense MLP (HF's rule)."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None where it attends to its whole context."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else None

    @property
    def num_params(self) -> int:
        """Parameter count, every expert's included: load reporting and the weight bytes of MBU estimates."""
        return self._params(self.num_experts)

    @property
    def active_params(self) -> int:
        """Parameters a token goes through (its top-k experts only, in a MoE): MFU's FLOPs per token."""
        return self._params(self.num_experts_per_tok)

    def _params(self, experts: int) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        total = 0
        for layer in range(self.num_layers):
            total += h * (q + 2 * kv) + q * h + 2 * h
            if self.is_moe_layer(layer):
                shared = 3 * h * self.shared_expert_intermediate_size + (
                    h if self.shared_expert_intermediate_size else 0
                )
                total += self.num_experts * h + experts * 3 * h * self.moe_intermediate_size + shared
            else:
                total += 3 * h * self.intermediate_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total + embed + h

    def valid_tp_sizes(self, limit: int = 64) -> list[int]:
        return [tp for tp in range(1, limit + 1) if self.tp_problem(tp) is None]

    def tp_problem(self, tp: int) -> str | None:
        """Why this model cannot be split `tp` ways, or None if it can."""
        if tp < 1:
            return f"tensor-parallel size must be >= 1, got {tp}"
        if self.num_heads % tp:
            return f"num_heads {self.num_heads} is not divisible by {tp}"
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            return f"num_kv_heads {self.num_kv_heads} neither divides nor is divisible by {tp}"
        dense = any(not self.is_moe_layer(layer) for layer in range(self.num_layers))
        if dense and self.intermediate_size % tp:
            return f"intermediate_size {self.intermediate_size} is not divisible by {tp}"
        if self.num_experts % tp:  # each rank holds whole experts (expert parallelism)
            return f"num_experts {self.num_experts} is not divisible by {tp}"
        if self.shared_expert_intermediate_size % tp:
            return f"shared_expert_intermediate_size {self.shared_expert_intermediate_size} is not divisible by {tp}"
        return None

    def check_tp(self, tp: int) -> None:
        problem = self.tp_problem(tp)
        if problem:
            raise ModelConfigError(
                f"invalid tensor-parallel size {tp} for {self.name or self.architecture}: {problem}; "
                f"valid sizes: {', '.join(map(str, self.valid_tp_sizes()))}"
            )

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        arch = archs[0]
        # Before reading fields: other architectures name them differently (GPT-2's n_head).
        _check_architecture(arch)
        heads = cfg["num_attention_heads"]
        theta, scaling, local_theta, rope = _rope_settings(cfg)
        _check_supported_features(cfg, arch, rope, scaling)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
        if kind == "longrope":
            scaling = _longrope_scaling(cfg, scaling, head_dim)
        elif kind == "yarn":
            scaling = _yarn_scaling(cfg, scaling)
        elif kind == "dynamic":  # HF stretches past max_position_embeddings, the pretraining context
            scaling = {**scaling, "original_max_position_embeddings": cfg.get("max_position_embeddings", 4096)}
        eos = cfg.get("eos_token_id")
        gemma = arch in _GEMMA
        window, sliding = _sliding_layers(cfg, arch, cfg["num_hidden_layers"])
        scalar = cfg.get("query_pre_attn_scalar", 256) if gemma else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            # Qwen2-MoE names its q/k/v biases qkv_bias (on unless set off; older configs lack the key).
            attention_bias=bool(
                cfg.get("qkv_bias", True)
                if arch == "Qwen2MoeForCausalLM"
                else cfg.get("attention_bias", arch == "Qwen2ForCausalLM")
            ),
            o_proj_bias=bool(cfg.get("attention_bias", False)) and arch in _O_PROJ_BIAS,
            qk_norm=arch in _QK_NORM,
            hidden_act=_hidden_act(cfg, arch),
            sliding_window=window,
            sliding_layers=sliding,
            attn_scale=float(scalar) ** -0.5 if scalar else None,
            attn_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else None,
            rope_local_theta=(local_theta or 10000.0) if arch == "Gemma3ForCausalLM" else None,
            **_moe_fields(cfg, arch),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=list(eos) if isinstance(eos, list) else ([eos] if eos is not None else []),
            name=name,
        )

    @classmethod
    def from_hf_folder(cls, folder: Path) -> ModelConfig:
        path = folder / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{path}: config.json not found")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path}: invalid JSON ({exc})") from exc
        try:
            return cls.from_hf_dict(cfg, name=folder.name)
        except KeyError as exc:
            raise ModelConfigError(f"{path}: missing field {exc}") from exc
        except ModelConfigError as exc:
            raise ModelConfigError(f"{path}: {exc}") from exc

    @classmethod
    def from_gguf_metadata(
        cls, meta: dict[str, Any], path: Path, has_output_weight: bool, rope_freq_factors: list[float] | None = None
    ) -> ModelConfig:
        arch = meta.get("general.architecture", "?")
        if arch not in _GGUF_ARCHITECTURES:
            raise ModelConfigError(
                f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHITECTURES)}"
            )

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelConfigError(f"{path}: GGUF metadata lacks {arch}.{key}")
            return value

        heads = get("attention.head_count")
        hidden = get("embedding_length")
        scaling = None
        if meta.get(f"{arch}.rope.scaling.type") == "llama3" or f"{arch}.rope.scaling.low_freq_factor" in meta:
            scaling = {
                "rope_type": "llama3",
                "factor": get("rope.scaling.factor"),
                "low_freq_factor": get("rope.scaling.low_freq_factor"),
                "high_freq_factor": get("rope.scaling.high_freq_factor"),
                "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            }
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=_GGUF_ARCHITECTURES[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=heads,
            num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
            head_dim=meta.get(f"{arch}.attention.key_length", hidden // heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=None if rope_freq_factors else scaling,
            rope_freq_factors=rope_freq_factors,
            max_position_embeddings=get("context_length", 4096),
            tie_word_embeddings=not has_output_weight,
            attention_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[eos] if eos is not None else [],
            name=meta.get("general.name", path.stem),
        )
