"""Shardline's own C++ CPU kernels: compiled once per machine, loaded by every process that uses them.

They are compiled for the CPU they run on (-march=native), so the build folder is named by
this CPU's feature flags, the torch version and the sources: a home folder shared by machines
of two kinds never hands one the other's code. `scripts/setup.sh` builds them (`python -m
gpu_worker_svc.model.layers.kernels.cpu_build`); a process that finds them unbuilt builds
them itself (about 10 s on two cores), one process at a time. Where they cannot be built
(no C++ compiler, as in the slim Docker image), callers fall back to the torch path, slower
on CPU, and say so once in the log.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [
    _HERE / name
    for name in (
        "decode_attention.cpp",
        "gguf_linear.cpp",
        "gguf_dot_scalar.cpp",
        "gguf_dot_avx2.cpp",
        "gguf_dot_avx512.cpp",
        "gguf_dot_avx512vnni.cpp",
        "rms_norm.cpp",
        "rotary_cache.cpp",
        "silu_mul.cpp",
        "decode_layers.cpp",
    )
]
HEADERS = [
    _HERE / "gguf_dot.h",
    _HERE / "gguf_dot_avx512.inc",
    _HERE / "vec16.h",
    _HERE / "cpu_ops.h",
]  # not compiled alone, but part of the build
_NAME = "shardline_cpu_kernels"
_FLAGS = ["-O3", "-march=native", "-fopenmp"]  # -fopenmp: at::parallel_for runs on torch's own OpenMP pool


def build_dir() -> Path:
    cpu = ""
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    # The sources too: two checkouts of different versions on one machine then never rebuild over
    # each other's library, which a process of the other might be loading at that moment.
    sources = b"".join(source.read_bytes() for source in SOURCES + HEADERS)
    key = hashlib.sha256(f"{torch.__version__}\n{cpu}\n".encode() + sources).hexdigest()[:12]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "shardline" / "kernels" / key


def load() -> None:
    """Compile the kernels if this machine has no current build, and load them into torch.ops.shardline_cpu."""
    from torch.utils import cpp_extension

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    # torch's build runs ninja, which may sit beside this interpreter (the venv) rather than on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), bin_dir])
    # One builder at a time, under a lock the kernel releases when its holder dies: torch's own
    # lock is a file that a builder killed midway leaves behind, and every later build would then
    # wait for it forever. Under this lock, nobody else holds torch's: its file is removed.
    with open(folder / "build.flock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        cpp_extension.load(
            name=_NAME,
            sources=[str(s) for s in SOURCES],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )


def loaded() -> bool:
    """Whether the kernels are in torch.ops.shardline_cpu: built (here, or before) and loaded.

    Each op's getter below asks once a process; a second load of the library is a no-op."""
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - any failure to build means the torch path, not a dead worker
        logger.warning(
            "Shardline's CPU kernels could not be built here (%s): decode attention takes the torch "
            "path and GGUF weights are dequantized, which is slower on CPU",
            str(exc).strip().splitlines()[-1] if str(exc).strip() else exc,
        )
        return False
    logger.info("Shardline's CPU kernels loaded from %s", build_dir())
    return True


@functools.cache
def paged_decode_attention() -> Callable | None:
    """torch.ops.shardline_cpu.paged_decode_attention, or None where the kernels cannot be built here."""
    return torch.ops.shardline_cpu.paged_decode_attention.default if loaded() else None


@functools.cache
def gguf_linear() -> Callable | None:
    """torch.ops.shardline_cpu.gguf_linear (kernels/gguf_linear.cpp), or None where the kernels cannot be built."""
    return torch.ops.shardline_cpu.gguf_linear.default if loaded() else None


@functools.cache
def rms_norm() -> tuple[Callable, Callable] | None:
    """torch.ops.shardline_cpu's rms_norm and add_rms_norm (kernels/rms_norm.cpp), or None where the
    kernels cannot be built."""
    return (
        (torch.ops.shardline_cpu.rms_norm.default, torch.ops.shardline_cpu.add_rms_norm.default) if loaded() else None
    )


@functools.cache
def rope_cache_write() -> Callable | None:
    """torch.ops.shardline_cpu.rope_cache_write (kernels/rotary_cache.cpp), or None where the kernels
    cannot be built."""
    return torch.ops.shardline_cpu.rope_cache_write.default if loaded() else None


@functools.cache
def silu_mul() -> Callable | None:
    """torch.ops.shardline_cpu.silu_mul (kernels/silu_mul.cpp), or None where the kernels cannot be built."""
    return torch.ops.shardline_cpu.silu_mul.default if loaded() else None


@functools.cache
def llama_decode_layers() -> Callable | None:
    """torch.ops.shardline_cpu.llama_decode_layers (kernels/decode_layers.cpp), or None where the
    kernels cannot be built."""
    return torch.ops.shardline_cpu.llama_decode_layers.default if loaded() else None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if loaded():
        kernels = ", ".join(torch.ops.shardline_cpu.gguf_kernels())
        print(f"Shardline CPU kernels: built in {build_dir()}; GGUF kernels this CPU runs: {kernels}")
    else:
        print("Shardline CPU kernels: not built; torch path")
