"""Builds a model shard and fills it from a checkpoint, one tensor at a time."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from gpu_worker_svc.model.checkpoint import CheckpointError, GGUFCheckpoint, SafetensorsCheckpoint, open_checkpoint
from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.dummy import dummy_config, init_dummy_weights, is_dummy
from gpu_worker_svc.model.families import model_class
from gpu_worker_svc.model.families.llama import LlamaForCausalLM
from gpu_worker_svc.model.layers.moe import expert_parameter, expert_tensor_name
from gpu_worker_svc.model.parallel import TPGroup
from shardline.core.model_path import resolve_model_path

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_ROTARY_POSITIONS = 32768  # the cos/sin table is precomputed; cap its size for 128k-context models


def parse_dtype(name: str | torch.dtype, device: str) -> torch.dtype:
    dtype = DTYPES.get(name) if isinstance(name, str) else name
    if dtype is None:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    allowed = (torch.float32, torch.bfloat16) if device == "cpu" else (torch.bfloat16, torch.float16, torch.float32)
    if dtype not in allowed:
        raise ValueError(f"dtype {name} is not supported on {device}")
    return dtype


def load_config(model: str | Path | None) -> ModelConfig:
    """The architecture of a model argument: None (default model), a path, or `dummy:<shape>`."""
    if is_dummy(model):
        return dummy_config(str(model))
    return open_checkpoint(resolve_model_path(model)).config()


def rotary_positions(cfg: ModelConfig, max_model_len: int | None = None) -> int:
    """Positions the model's rotary table covers: the longest sequence it can run."""
    return min(max_model_len or cfg.max_position_embeddings, MAX_ROTARY_POSITIONS)


def load_model(
    model: str | Path | None,
    tp: TPGroup,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    max_model_len: int | None = None,
) -> LlamaForCausalLM:
    """This rank's shard of the model, in eval mode on `device`."""
    t0 = time.perf_counter()
    if is_dummy(model):
        cfg = dummy_config(str(model))
        with torch.device(device):
            shard = model_class(cfg)(cfg, tp, dtype, rotary_positions(cfg, max_model_len))
        init_dummy_weights(shard)
        return shard.eval()
    path = resolve_model_path(model)
    ckpt = open_checkpoint(path)
    cfg = ckpt.config()
    if tp.is_driver:
        _warn_of_long_rope(cfg, rotary_positions(cfg, max_model_len))
        _warn_of_dynamic_rope(cfg, rotary_positions(cfg, max_model_len))
        _say_what_a_sliding_window_keeps(cfg)
    with torch.device(device):
        model = model_class(cfg)(cfg, tp, dtype, rotary_positions(cfg, max_model_len))
    _load_tensors(model, ckpt, cfg, path)
    model.eval()
    log.info(
        "loaded %s (%s, %.1fM params) rank %d/%d as %s on %s in %.2fs",
        cfg.name or path.name,
        cfg.architecture,
        cfg.num_params / 1e6,
        tp.rank,
        tp.world_size,
        dtype,
        device,
        time.perf_counter() - t0,
    )
    return model


def _warn_of_long_rope(cfg: ModelConfig, positions: int) -> None:
    """LongRoPE's factors are chosen once, by the served context (layers/rotary.py): say where that parts from HF."""
    scaling = cfg.rope_scaling or {}
    original = scaling.get("original_max_position_embeddings", 0)
    if scaling.get("rope_type", scaling.get("type")) == "longrope" and positions > original:
        log.warning(
            "%s: the served context (%d tokens) passes LongRoPE's original %d, so every sequence is rotated with "
            "the long factors; HF rotates sequences of at most %d tokens with the short ones (serve with "
            "max_model_len %d for those)",
            cfg.name or cfg.architecture,
            positions,
            original,
            original,
            original,
        )


def _warn_of_dynamic_rope(cfg: ModelConfig, positions: int) -> None:
    """Dynamic NTK's theta is chosen once, by the served context (layers/rotary.py): say where that parts from HF."""
    scaling = cfg.rope_scaling or {}
    original = scaling.get("original_max_position_embeddings", 0)
    if scaling.get("rope_type", scaling.get("type")) == "dynamic" and positions > original:
        log.warning(
            "%s: the served context (%d tokens) passes dynamic NTK's original %d, so every sequence is rotated "
            "as HF rotates one of %d tokens; HF rotates shorter ones otherwise (serve with max_model_len %d "
            "for HF's rotation of every sequence within it)",
            cfg.name or cfg.architecture,
            positions,
            original,
            positions,
            original,
        )


def _say_what_a_sliding_window_keeps(cfg: ModelConfig) -> None:
    """The window is enforced in the attention, but its blocks stay allocated: say so once, at load."""
    if cfg.sliding_window is None:
        return
    log.warning(
        "%s: sliding-window attention (%d tokens) on %d of %d layers; the KV blocks behind the window are kept, "
        "so prefix caching works as for any model but a long sequence takes as much KV memory as without a window",
        cfg.name or cfg.architecture,
        cfg.sliding_window,
        sum(cfg.sliding_layers),
        cfg.num_layers,
    )


def _load_tensors(
    model: LlamaForCausalLM, ckpt: SafetensorsCheckpoint | GGUFCheckpoint, cfg: ModelConfig, path: Path
) -> None:
    """Every checkpoint tensor into its parameter's shard, each checked against the config's shape;
    CheckpointError naming the tensor for one that has no place, the wrong shape, or is missing."""
    params = dict(model.named_parameters())
    expected = _expected_shards(params)
    loaded: set[tuple[str, object]] = set()
    for tensor in model.checkpoint_tensors(ckpt.tensors(cfg), cfg):
        name = tensor.name
        if "rotary_emb.inv_freq" in name or (cfg.tie_word_embeddings and name.startswith("lm_head.")):
            continue
        name, shard_id = fused_parameter(name)
        param = params.get(name)
        want = _checkpoint_shape(cfg, tensor.name)
        if param is None and want is None:
            log.warning("%s: ignoring unexpected tensor %s", path, tensor.name)
            continue
        # A weight the model would have but lacks (an extra layer, a bias, an expert past num_experts, a
        # MoE tensor in a dense layer) means the config is wrong.
        if param is None or not want:
            raise CheckpointError(
                f"{path}: tensor {tensor.name!r} has no place in the model its config describes "
                f"({cfg.num_layers} layers, attention_bias={cfg.attention_bias}, num_experts={cfg.num_experts})"
            )
        # A smaller tensor than the config implies would load partially, without an error, so check it all.
        if tuple(tensor.shape) != want:
            raise CheckpointError(
                f"{path}: tensor {tensor.name!r} has shape {tuple(tensor.shape)}, but the config implies {want}"
            )
        param.weight_loader(param, tensor, shard_id)
        loaded.add((name, shard_id))
    missing = sorted(_checkpoint_name(n, s) for n, s in expected - loaded)
    if missing:
        raise CheckpointError(
            f"{path}: checkpoint lacks {len(missing)} tensor(s): {', '.join(missing[:5])}"
            + (", ..." if len(missing) > 5 else "")
        )


def fused_parameter(name: str) -> tuple[str, object]:
    """A checkpoint tensor's parameter in the model, and its shard there (`up_proj` is shard 1 of `gate_up_proj`;
    expert 5's `up_proj` is shard (5, 1) of its layer's stacked `experts.gate_up_proj`)."""
    expert = expert_parameter(name)
    if expert is not None:
        return expert
    for ckpt_key, (fused, shard) in LlamaForCausalLM.packed_modules_mapping.items():
        if f".{ckpt_key}." in name:
            return name.replace(ckpt_key, fused), shard
    return name, None


def _checkpoint_shape(cfg: ModelConfig, name: str) -> tuple[int, ...] | None:
    """The full, unsharded shape `cfg` implies for checkpoint tensor `name`; None if the model has no such module,
    () for a MoE tensor the config gives no place."""
    h, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    weights = {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
        "embed_tokens": (vocab, h),
        "lm_head": (vocab, h),
    }
    module, kind = name.split(".")[-2:]
    moe = _moe_tensor_shape(cfg, name)
    if moe is not None:
        return moe
    if module in ("q_norm", "k_norm"):  # Qwen3's, one weight per head size shared by every head
        return (cfg.head_dim,) if cfg.qk_norm else None
    if module.endswith("norm"):
        return (h,)
    shape = weights.get(module)
    return shape if shape is None or kind == "weight" else shape[:1]


def _moe_tensor_shape(cfg: ModelConfig, name: str) -> tuple[int, ...] | None:
    """The shape of a MoE block's tensor (an expert's projection, the router, the shared expert and its gate),
    () for one the config gives no place (a dense layer's, an expert past num_experts), None for any other."""
    if ".mlp." not in name or not name.startswith("model.layers."):
        return None
    h, width = cfg.hidden_size, cfg.moe_intermediate_size
    layer = int(name.split(".")[2])
    expert = expert_parameter(name)
    if expert is not None:
        if not cfg.is_moe_layer(layer) or expert[1][0] >= cfg.num_experts:
            return ()
        return (h, width) if expert[1][1] == 2 else (width, h)
    module, kind = name.split(".")[-2:]
    if module == "gate" or name.endswith(".shared_expert_gate.weight"):
        rows = cfg.num_experts if module == "gate" else 1
        sparse = cfg.is_moe_layer(layer) and (module == "gate" or cfg.shared_expert_intermediate_size > 0)
        return (rows, h) if sparse and kind == "weight" else ()
    if ".mlp.shared_expert." in name:
        shared = cfg.shared_expert_intermediate_size
        shapes = {"gate_proj": (shared, h), "up_proj": (shared, h), "down_proj": (h, shared)}
        return shapes[module] if cfg.is_moe_layer(layer) and shared and kind == "weight" and module in shapes else ()
    return () if cfg.is_moe_layer(layer) else None  # a dense MLP's tensor in a sparse layer


def _checkpoint_name(name: str, shard_id: object) -> str:
    """The checkpoint's name for one shard of a parameter (`up_proj`, not the fused `gate_up_proj`)."""
    if isinstance(shard_id, tuple):
        return expert_tensor_name(name, shard_id)
    for ckpt_key, (fused, shard) in LlamaForCausalLM.packed_modules_mapping.items():
        if shard_id is not None and shard == shard_id and f".{fused}." in name:
            return name.replace(fused, ckpt_key)
    return name


def _expected_shards(params: dict[str, torch.Tensor]) -> set[tuple[str, object]]:
    """(parameter, shard id) pairs a complete checkpoint fills; fused parameters need every shard."""
    fused: dict[str, list[object]] = {}
    for fused_name, shard in LlamaForCausalLM.packed_modules_mapping.values():
        fused.setdefault(fused_name, []).append(shard)
    expected: set[tuple[str, object]] = set()
    for name, param in params.items():
        # A stacked expert parameter lists the (expert, part) shards this rank holds.
        shards = getattr(param, "checkpoint_shards", None) or next(
            (s for f, s in fused.items() if f".{f}." in name), [None]
        )
        expected |= {(name, s) for s in shards}
    return expected
