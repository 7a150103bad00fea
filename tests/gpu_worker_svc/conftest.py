"""The default model, and HF transformers' reading of it as the reference, for model and engine tests."""

from __future__ import annotations

import pytest
import torch

from shardline.core.model_path import default_model_path


@pytest.fixture(scope="session")
def default_model():
    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_model):
    """HF transformers' own GGUF loader is the reference implementation (slow: ~25 s)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_model.parent), gguf_file=default_model.name, dtype=torch.float32
    )
    return model.eval()
