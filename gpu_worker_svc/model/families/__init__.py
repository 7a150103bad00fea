"""The model families, one module each, and the registry that picks one from config.json's `architectures`.

A family whose maths is Llama's but for a few modules subclasses families/llama.py's and overrides
only those, so the layers (gpu_worker_svc/model/layers) and the decoder pieces are shared.
"""

from __future__ import annotations

from gpu_worker_svc.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelConfigError
from gpu_worker_svc.model.families.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from gpu_worker_svc.model.families.llama import LlamaForCausalLM
from gpu_worker_svc.model.families.mixtral import MixtralForCausalLM
from gpu_worker_svc.model.families.moe import MoeForCausalLM
from gpu_worker_svc.model.families.phi3 import Phi3ForCausalLM
from gpu_worker_svc.model.families.qwen3 import Qwen3ForCausalLM
from gpu_worker_svc.model.families.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
if set(MODEL_CLASSES) != set(SUPPORTED_ARCHITECTURES):  # one list is read by config.py, the other builds
    raise ImportError(f"model registry {sorted(MODEL_CLASSES)} differs from config.py's {SUPPORTED_ARCHITECTURES}")


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The module that builds `cfg`'s architecture; ModelConfigError naming it and the supported ones otherwise."""
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise ModelConfigError(
            f"unsupported architecture {cfg.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return cls
