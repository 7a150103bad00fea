"""Compiles Shardline's C++ CPU kernels: one shared library per instruction-set level.

The wheel and the images are built with every level (setup.py; in a checkout, scripts/setup.sh
runs `python -m gpu_worker_svc.model.layers.kernels.kernel_build`), and a worker loads the best
that its CPU runs (cpu_kernels.py), so a host without a compiler runs the same code as the one
that built it. Each folder of libraries has a manifest naming the torch release and the sources
it was built from: the libraries link against torch's C++ API, whose ABI holds within a release.

The levels are x86-64's psABI levels: AVX-512 (v4), AVX2 (v3) and the baseline. The GGUF dot
products, the only code with instructions past those (AVX-512 VNNI), pick theirs at run time inside
every library (gguf_linear.cpp): scalar, AVX2, AVX-512 or VNNI. A v4 library built with VNNI enabled
is byte for byte the v4 one, so there is no fourth level.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [
    HERE / name
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
HEADERS = [HERE / "gguf_dot.h", HERE / "gguf_dot_avx512.inc", HERE / "vec16.h", HERE / "cpu_ops.h"]
# Where the wheel, the image and a checkout keep the libraries: beside the sources (git-ignored).
PREBUILT_DIR = HERE / "lib"
LIBRARY = "libshardline_cpu.so"
MANIFEST = "manifest.json"
# -fopenmp: at::parallel_for is a header template that runs on torch's own OpenMP pool.
COMMON_FLAGS = ["-std=c++20", "-O3", "-fPIC", "-fopenmp"]

# x86-64-v3 and -v4 are the psABI levels: what each needs of /proc/cpuinfo's flags.
_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True, slots=True)
class Variant:
    """One build of the library: its name, its compiler flags, and the CPU flags it needs."""

    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]


X86_VARIANTS = (
    Variant("avx512", ("-march=x86-64-v4",), _V4),
    Variant("avx2", ("-march=x86-64-v3",), _V3),
    Variant("scalar", ("-march=x86-64",), frozenset()),
)
# Elsewhere (aarch64), one build with the compiler's defaults.
GENERIC_VARIANTS = (Variant("generic", (), frozenset()),)


class KernelBuildError(RuntimeError):
    """The compiler is missing or refused a source."""


def variants() -> tuple[Variant, ...]:
    """The builds of this platform, best first."""
    return X86_VARIANTS if platform.machine() in ("x86_64", "AMD64") else GENERIC_VARIANTS


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags, as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def best_variant(flags: frozenset[str], among: tuple[Variant, ...] | None = None) -> Variant:
    """The first build, best first, whose instructions a CPU with these flags has."""
    options = among if among is not None else variants()
    return next(v for v in options if v.needs <= flags)


def torch_release() -> str:
    """The installed torch's release, without a local tag: 2.13.0+cpu and 2.13.0+cu130 share an ABI."""
    import torch

    return torch.__version__.split("+")[0]


def sources_digest() -> str:
    """A digest of every source and header, so that an edited kernel is never run from an old build."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a folder of libraries, or None where it has none."""
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def unusable_reason(folder: Path, variant: Variant) -> str | None:
    """Why this folder's build of `variant` must not be loaded here, or None when it may."""
    manifest = read_manifest(folder)
    if manifest is None:
        return f"no kernels are built in {folder}"
    if manifest.get("torch") != torch_release():
        return (
            f"the kernels in {folder} were built for torch {manifest.get('torch')}, and this is torch {torch_release()}"
        )
    if manifest.get("sources") != sources_digest():
        return f"the kernels in {folder} were built from other sources"
    if variant.name not in manifest.get("variants", []) or not (folder / variant.name / LIBRARY).is_file():
        return f"{folder} has no {variant.name} build"
    return None


def _compiler() -> str:
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler ({compiler}: not found)")
    return compiler


def _torch_flags() -> tuple[list[str], list[str]]:
    import torch
    from torch.utils import cpp_extension

    includes = [flag for path in cpp_extension.include_paths() for flag in ("-isystem", path)]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    links = [f"-L{path}" for path in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu"]
    return [*includes, abi], links


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise KernelBuildError(f"{' '.join(command[:1] + command[-3:])} failed:\n{done.stderr.strip()[-4000:]}")


def _compile_all(variants_: tuple[Variant, ...], out: Path, jobs: int) -> None:
    """Compiles every source for every variant into out/<variant>/, then links each library."""
    compiler = _compiler()
    cflags, ldflags = _torch_flags()
    objects: dict[str, list[Path]] = {}
    commands = []
    for variant in variants_:
        (out / variant.name).mkdir(parents=True)
        objects[variant.name] = []
        for source in SOURCES:
            obj = out / variant.name / f"{source.stem}.o"
            objects[variant.name].append(obj)
            commands.append([compiler, *COMMON_FLAGS, *variant.flags, *cflags, "-c", str(source), "-o", str(obj)])
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(_run, commands))
        links = [
            [compiler, "-shared", "-fopenmp", *map(str, objects[v.name]), *ldflags, "-o", str(out / v.name / LIBRARY)]
            for v in variants_
        ]
        list(pool.map(_run, links))
    for obj in (obj for objs in objects.values() for obj in objs):
        obj.unlink()


def build(dest: Path = PREBUILT_DIR, variants_: tuple[Variant, ...] | None = None, jobs: int | None = None) -> bool:
    """Builds the libraries into `dest` unless it already holds this build; True when it compiled.

    The new folder is written beside `dest` and renamed into place, so a build killed midway
    leaves the old one, or none, and never half of one."""
    chosen = variants_ if variants_ is not None else variants()
    manifest = {"torch": torch_release(), "sources": sources_digest(), "variants": [v.name for v in chosen]}
    current = read_manifest(dest)
    if current is not None and all(current.get(k) == manifest[k] for k in ("torch", "sources")):
        if set(manifest["variants"]) <= set(current.get("variants", [])):
            return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        _compile_all(chosen, scratch, jobs or os.cpu_count() or 1)
        (scratch / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        old = dest.with_name(f".{dest.name}-old")
        shutil.rmtree(old, ignore_errors=True)
        if dest.exists():
            dest.rename(old)
        scratch.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return True


def check(folder: Path = PREBUILT_DIR) -> str | None:
    """Why this machine cannot load the build in `folder`, or None when it can (an image's last step)."""
    return unusable_reason(folder, best_variant(cpu_flags()))


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if argv[:1] == ["--check"]:
        reason = check()
        variant = best_variant(cpu_flags()).name
        print(f"Shardline CPU kernels: {reason or f'the {variant} build in {PREBUILT_DIR} loads here'}")
        return 1 if reason else 0
    dest = Path(argv[0]) if argv else PREBUILT_DIR
    try:
        compiled = build(dest)
    except KernelBuildError as exc:
        print(f"Shardline CPU kernels: not built ({exc})", file=sys.stderr)
        return 1
    names = ", ".join(read_manifest(dest)["variants"])
    print(f"Shardline CPU kernels: {'built' if compiled else 'up to date'} in {dest} ({names})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
