"""Builds a model shard and fills it from a checkpoint, one tensor at a time."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from gpu_worker_svc.model.checkpoint import CheckpointError, open_checkpoint
from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.llama import LlamaForCausalLM
from gpu_worker_svc.model.parallel import TPGroup

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


def load_config(path: Path) -> ModelConfig:
    return open_checkpoint(path).config()


def load_model(path: Path, tp: TPGroup, dtype: torch.dtype = torch.float32, device: str = "cpu",
               max_model_len: int | None = None) -> LlamaForCausalLM:
    """This rank's shard of the model at `path`, in eval mode on `device`."""
    t0 = time.perf_counter()
    ckpt = open_checkpoint(path)
    cfg = ckpt.config()
    max_positions = min(max_model_len or cfg.max_position_embeddings, MAX_ROTARY_POSITIONS)
    with torch.device(device):
        model = LlamaForCausalLM(cfg, tp, dtype, max_positions)
    params = dict(model.named_parameters())
    expected = _expected_shards(params)
    loaded: set[tuple[str, object]] = set()
    for tensor in ckpt.tensors(cfg):
        name = tensor.name
        if "rotary_emb.inv_freq" in name or (cfg.tie_word_embeddings and name.startswith("lm_head.")):
            continue
        shard_id = None
        for ckpt_key, (fused, shard) in LlamaForCausalLM.packed_modules_mapping.items():
            if f".{ckpt_key}." in name:
                name, shard_id = name.replace(ckpt_key, fused), shard
                break
        param = params.get(name)
        if param is None:
            log.warning("%s: ignoring unexpected tensor %s", path, tensor.name)
            continue
        if tensor.shape[-1] != _full_last_dim(param, name, tp) and param.dim() > 1:
            raise CheckpointError(f"{path}: tensor {tensor.name!r} has shape {tensor.shape}, "
                                  f"which does not fit the config's {name} {tuple(param.shape)}")
        param.weight_loader(param, tensor, shard_id)
        loaded.add((name, shard_id))
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:5])}")
    model.eval()
    log.info("loaded %s (%s, %.1fM params) rank %d/%d as %s on %s in %.2fs", cfg.name or path.name,
             cfg.architecture, cfg.num_params / 1e6, tp.rank, tp.world_size, dtype, device,
             time.perf_counter() - t0)
    return model


def _full_last_dim(param: torch.Tensor, name: str, tp: TPGroup) -> int:
    """The checkpoint's last dim for this parameter: row-parallel weights are split along it."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return param.shape[-1] * tp.world_size
    return param.shape[-1]


def _expected_shards(params: dict[str, torch.Tensor]) -> set[tuple[str, object]]:
    """(parameter, shard id) pairs a complete checkpoint fills; fused parameters need every shard."""
    fused: dict[str, list[object]] = {}
    for fused_name, shard in LlamaForCausalLM.packed_modules_mapping.values():
        fused.setdefault(fused_name, []).append(shard)
    expected: set[tuple[str, object]] = set()
    for name in params:
        shards = next((s for f, s in fused.items() if f".{f}." in name), [None])
        expected |= {(name, s) for s in shards}
    return expected
