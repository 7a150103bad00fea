"""A LoRA adapter in PEFT's format (a folder with adapter_config.json and adapter_model.safetensors),
read and checked against the served model before anything of the model is touched.

The config's base_model_name_or_path may name anything (a hub id, a local path, another copy of the
same weights), so the check is the tensors' shapes against the model's own. Every refusal is a
LoraAdapterError naming the adapter and the field or tensor at fault.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from gpu_worker_svc.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_MAX_LORA_RANK = 64

# A PEFT tensor name: base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>[.<adapter>].weight
_TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True, slots=True)
class LoraTarget:
    """Where an adapted module's delta goes in the model's fused linear layers."""

    layer: str  # the linear layer inside a decoder layer, e.g. "self_attn.qkv_proj"
    row: int  # first output row of the layer it writes
    rows: int  # output rows it writes
    inputs: int  # input features it reads
    inputs_named: str  # the config's name for those, for the error message


def lora_layers(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """The LoRA-capable linear layers of a decoder layer: their input features, and the output rows of
    each of their sub-modules (q, k, v of qkv_proj; gate, up of gate_up_proj), in order."""
    h, n = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "self_attn.qkv_proj": (h, [q, kv, kv]),
        "self_attn.o_proj": (q, [h]),
        "mlp.gate_up_proj": (h, [n, n]),
        "mlp.down_proj": (n, [h]),
    }


def lora_targets(cfg: ModelConfig) -> dict[str, LoraTarget]:
    """The modules an adapter may adapt, by PEFT's name: Llama's seven, and the fused qkv_proj and
    gate_up_proj that Phi-3's checkpoints (and adapters trained on them) name."""
    h, n = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inter, heads = "hidden_size", "intermediate_size", "num_heads * head_dim"
    return {
        "q_proj": LoraTarget("self_attn.qkv_proj", 0, q, h, hidden),
        "k_proj": LoraTarget("self_attn.qkv_proj", q, kv, h, hidden),
        "v_proj": LoraTarget("self_attn.qkv_proj", q + kv, kv, h, hidden),
        "qkv_proj": LoraTarget("self_attn.qkv_proj", 0, q + 2 * kv, h, hidden),
        "o_proj": LoraTarget("self_attn.o_proj", 0, h, q, heads),
        "gate_proj": LoraTarget("mlp.gate_up_proj", 0, n, h, hidden),
        "up_proj": LoraTarget("mlp.gate_up_proj", n, n, h, hidden),
        "gate_up_proj": LoraTarget("mlp.gate_up_proj", 0, 2 * n, h, hidden),
        "down_proj": LoraTarget("mlp.down_proj", 0, h, n, inter),
    }


class LoraAdapterError(ValueError):
    """An adapter refused at load; the message names the adapter and the field or tensor at fault."""

    def __init__(self, adapter: str, field: str, problem: str) -> None:
        super().__init__(f"LoRA adapter {adapter!r}: {field}: {problem}")
        self.adapter = adapter
        self.field = field
        self.problem = problem


class LoraAdapterInUse(LoraAdapterError):
    """An adapter that requests still use cannot be replaced or unloaded yet."""


@dataclass(slots=True)
class LoraAdapter:
    """An adapter's weights on the host, checked against the model, ready to be put in a slot."""

    name: str  # what requests call it
    path: Path  # the folder it was read from
    rank: int  # the largest rank of its modules
    # A digest of its config and weights: the same adapter under any name, on any worker, computes
    # the same KV, and another one never does (prefix_hash.chain_root).
    identity: str
    # (decoder layer, PEFT module name) -> (A [r, in], B [rows, r] times the scaling), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def parts(
        self, layer: int, targets: dict[str, LoraTarget]
    ) -> dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]:
        """Decoder layer `layer`'s weights by linear layer, as LoraSlots.write takes them."""
        found: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for (index, module), (a, b) in self.weights.items():
            if index == layer:
                target = targets[module]
                found.setdefault(target.layer, []).append((target.row, a, b))
        return found


def read_lora_adapter(
    name: str, path: str | Path, cfg: ModelConfig, max_rank: int = DEFAULT_MAX_LORA_RANK
) -> LoraAdapter:
    """Reads and checks the adapter in folder `path` for the model `cfg` describes (LoraAdapterError)."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoraAdapterError(name, "lora_path", f"{folder} is not a folder")
    config_bytes = _read(name, folder / CONFIG_FILE)
    weight_bytes = _read(name, folder / WEIGHTS_FILE)
    config = _parse_config(name, config_bytes)
    _check_config(name, config, max_rank)
    try:
        tensors = load_safetensors(weight_bytes)
    except Exception as exc:  # safetensors raises its own error types, and others on a torn header
        raise LoraAdapterError(name, WEIGHTS_FILE, f"not a readable safetensors file ({exc})") from None
    weights = _adapter_weights(name, tensors, cfg, config, max_rank)
    # The config as its values, not its bytes: the same settings written with other spacing are the same adapter.
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    identity = hashlib.sha256(canonical + b"\0" + weight_bytes).hexdigest()[:32]
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoraAdapter(name, folder, rank, identity, weights)


def _read(name: str, file: Path) -> bytes:
    if not file.is_file():
        raise LoraAdapterError(name, file.name, f"missing from {file.parent}")
    try:
        return file.read_bytes()
    except OSError as exc:
        raise LoraAdapterError(name, file.name, f"unreadable ({exc})") from None


def _parse_config(name: str, data: bytes) -> dict[str, Any]:
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraAdapterError(name, CONFIG_FILE, f"not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(name, CONFIG_FILE, "must hold a JSON object")
    return config


def _check_config(name: str, config: dict[str, Any], max_rank: int) -> None:
    """The settings whose maths is not a plain scaled B A delta on the targeted linear layers are refused."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraAdapterError(name, "peft_type", f"{peft_type!r}; only LORA adapters are served")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraAdapterError(name, "r", f"must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoraAdapterError(name, "r", f"rank {r} is above max_lora_rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoraAdapterError(name, "lora_alpha", f"must be a number, got {alpha!r}")
    refused = {
        "use_dora": "DoRA's magnitude vectors are not served",
        "fan_in_fan_out": "transposed (Conv1D) weights are not served",
        "lora_bias": "LoRA biases are not served",
        "modules_to_save": "fully trained modules (an embedding, an LM head) are not served",
        "alpha_pattern": "per-module lora_alpha is not served",
    }
    for field, why in refused.items():
        if config.get(field):
            raise LoraAdapterError(name, field, f"{config[field]!r}: {why}")
    bias = config.get("bias", "none")
    if bias != "none":
        raise LoraAdapterError(name, "bias", f"{bias!r}: trained biases are not served (only 'none')")
    if not isinstance(config.get("use_rslora", False), bool):
        raise LoraAdapterError(name, "use_rslora", f"must be true or false, got {config['use_rslora']!r}")


def _adapter_weights(
    name: str, tensors: dict[str, torch.Tensor], cfg: ModelConfig, config: dict[str, Any], max_rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A, scaled B), every tensor checked against the model's shapes."""
    targets = lora_targets(cfg)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR_NAME.search(key)
        if match is None:
            raise LoraAdapterError(name, key, "not a LoRA A or B weight of a decoder layer's linear module")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in targets:
            raise LoraAdapterError(name, key, f"targets {module!r}; supported: {', '.join(targets)}")
        if layer >= cfg.num_layers:
            raise LoraAdapterError(name, key, f"layer {layer}, but the model has {cfg.num_layers} layers")
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise LoraAdapterError(name, key, f"must be a 2-D float matrix, got {tensor.dtype} {tuple(tensor.shape)}")
        if not bool(torch.isfinite(tensor).all()):
            raise LoraAdapterError(name, key, "holds NaN or infinite values")
        halves.setdefault((layer, module), {})[half] = tensor.float()
    if not halves:
        raise LoraAdapterError(name, WEIGHTS_FILE, "holds no LoRA weights")
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), pair in sorted(halves.items()):
        where = f"layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoraAdapterError(name, where, f"has no {missing} weight")
        a, b = pair["A"], pair["B"]
        target = targets[module]
        r = a.shape[0]
        if r > max_rank:
            raise LoraAdapterError(name, f"{where}.lora_A", f"rank {r} is above max_lora_rank {max_rank}")
        if a.shape[1] != target.inputs:
            raise LoraAdapterError(
                name,
                f"{where}.lora_A",
                f"shape {tuple(a.shape)}: the model's {module} takes {target.inputs} inputs "
                f"({target.inputs_named}); the adapter was made for another base model",
            )
        if tuple(b.shape) != (target.rows, r):
            raise LoraAdapterError(
                name,
                f"{where}.lora_B",
                f"shape {tuple(b.shape)}, the model's {module} with rank {r} needs {(target.rows, r)}; "
                "the adapter was made for another base model",
            )
        # PEFT's scaling: lora_alpha / r, or / sqrt(r) with rsLoRA; r is the module's own (rank_pattern).
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    for layer in {layer for layer, _ in weights}:
        modules = {module for index, module in weights if index == layer}
        for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            both = [p for p in parts if p in modules]
            if fused in modules and both:
                raise LoraAdapterError(name, f"layers.{layer}.{fused}", f"adapted both fused and as {both[0]}")
    return weights
