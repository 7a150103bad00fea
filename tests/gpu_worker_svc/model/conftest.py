from __future__ import annotations

import pytest
import torch

from shardline.model_path import default_model_path


@pytest.fixture(scope="session")
def default_model():
    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_model):
    """HF transformers' own GGUF loader is the reference implementation (slow: ~25 s)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_model.parent), gguf_file=default_model.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    lengths = [1, 7, 33, 70]
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]
