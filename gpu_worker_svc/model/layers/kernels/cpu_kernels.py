"""Shardline's own C++ CPU kernels, loaded once a process into torch.ops.shardline_cpu.

A worker loads the build for its CPU's instruction set from the libraries that came with it
(kernel_build.py builds them with the wheel, the image, or a checkout's setup). Where those do not
fit (another torch release, edited sources), it compiles its own into the cache folder, one process
at a time, and says so; where it cannot (no compiler), callers take the torch path, slower on CPU,
and say so once in the log.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from gpu_worker_svc.model.layers.kernels import kernel_build

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where a process compiles the kernels when the shipped ones do not fit: per torch release and sources."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "shardline" / "kernels" / f"torch{kernel_build.torch_release()}-{kernel_build.sources_digest()}"


def find_library(prebuilt: Path = kernel_build.PREBUILT_DIR) -> Path:
    """The library to load here: the shipped build for this CPU, or one compiled now into cache_dir().

    Raises KernelBuildError where neither is possible."""
    variant = kernel_build.best_variant(kernel_build.cpu_flags())
    reason = kernel_build.unusable_reason(prebuilt, variant)
    if reason is None:
        return prebuilt / variant.name / kernel_build.LIBRARY
    folder = cache_dir()
    if kernel_build.unusable_reason(folder, variant) is None:
        return folder / variant.name / kernel_build.LIBRARY
    logger.warning("%s: compiling the %s kernels for this machine into %s", reason, variant.name, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time; the kernel drops the lock of a builder that dies.
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        kernel_build.build(folder, (variant,))
    return folder / variant.name / kernel_build.LIBRARY


@functools.cache
def library() -> Path | None:
    """The library loaded into torch.ops.shardline_cpu, or None where the kernels cannot run here.

    Each op's getter below asks once a process; the library is loaded at most once."""
    try:
        path = find_library()
        torch.ops.load_library(str(path))
    except (kernel_build.KernelBuildError, OSError) as exc:
        logger.warning(
            "Shardline's CPU kernels cannot run here (%s): decode attention takes the torch path and "
            "GGUF weights are dequantized, which is slower on CPU",
            str(exc).strip().splitlines()[-1] if str(exc).strip() else exc,
        )
        return None
    logger.info("Shardline's CPU kernels loaded from %s", path)
    return path


def loaded() -> bool:
    """Whether the kernels are in torch.ops.shardline_cpu."""
    return library() is not None


@functools.cache
def paged_decode_attention() -> Callable | None:
    """torch.ops.shardline_cpu.paged_decode_attention, or None where the kernels cannot run here."""
    return torch.ops.shardline_cpu.paged_decode_attention.default if loaded() else None


@functools.cache
def gguf_linear() -> Callable | None:
    """torch.ops.shardline_cpu.gguf_linear (kernels/gguf_linear.cpp), or None where the kernels cannot run."""
    return torch.ops.shardline_cpu.gguf_linear.default if loaded() else None


@functools.cache
def rms_norm() -> tuple[Callable, Callable] | None:
    """torch.ops.shardline_cpu's rms_norm and add_rms_norm (kernels/rms_norm.cpp), or None where the
    kernels cannot run."""
    return (
        (torch.ops.shardline_cpu.rms_norm.default, torch.ops.shardline_cpu.add_rms_norm.default) if loaded() else None
    )


@functools.cache
def rope_cache_write() -> Callable | None:
    """torch.ops.shardline_cpu.rope_cache_write (kernels/rotary_cache.cpp), or None where the kernels
    cannot run."""
    return torch.ops.shardline_cpu.rope_cache_write.default if loaded() else None


@functools.cache
def silu_mul() -> Callable | None:
    """torch.ops.shardline_cpu.silu_mul (kernels/silu_mul.cpp), or None where the kernels cannot run."""
    return torch.ops.shardline_cpu.silu_mul.default if loaded() else None


@functools.cache
def llama_decode_layers() -> Callable | None:
    """torch.ops.shardline_cpu.llama_decode_layers (kernels/decode_layers.cpp), or None where the
    kernels cannot run."""
    return torch.ops.shardline_cpu.llama_decode_layers.default if loaded() else None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    where = library()
    if where is not None:
        kernels = ", ".join(torch.ops.shardline_cpu.gguf_kernels())
        print(f"Shardline CPU kernels: {where}; GGUF kernels this CPU runs: {kernels}")
    else:
        print("Shardline CPU kernels: cannot run here; torch path")
