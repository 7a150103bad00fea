"""What the wheel carries besides the sources: the gRPC stubs and the built CPU kernels.

Everything else about the package is in pyproject.toml. Both steps run when the wheel is built,
so an installed Shardline generates and compiles nothing at run time:

- the stubs of protos/shardline/v1/*.proto, with the .proto files beside them, in shardline/v1/;
- the CPU kernels, one library per instruction-set level, in gpu_worker_svc/model/layers/kernels/lib/,
  where torch is importable at build time (pyproject.toml's build requirements bring it).

An editable install (a checkout) builds neither here: setuptools would hide a failure of a custom
step there, so scripts/setup.sh runs both itself, into the checkout.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent
STUBS = Path("shardline", "v1")
KERNELS = Path("gpu_worker_svc", "model", "layers", "kernels")


def _module(path: Path):
    """A build tool of the source tree, loaded by path: the package itself is not importable yet."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def generate_stubs(package_root: Path) -> None:
    """Writes the stubs and the .proto files into package_root/shardline/v1."""
    _module(ROOT / "shardline" / "protogen.py").generate(package_root / STUBS)


def build_kernels(source_root: Path, package_root: Path) -> None:
    """Builds the kernels in the source tree (a no-op when they are current, as after scripts/setup.sh),
    then copies them into package_root."""
    if importlib.util.find_spec("torch") is None:
        print("setup.py: torch is not importable here, so the wheel ships no built CPU kernels", file=sys.stderr)
        return
    built = source_root / KERNELS / "lib"
    kernel_build = _module(source_root / KERNELS / "kernel_build.py")
    try:
        kernel_build.build(built)
    except kernel_build.KernelBuildError as exc:
        print(f"setup.py: the CPU kernels were not built, and the wheel ships none: {exc}", file=sys.stderr)
        return
    shutil.rmtree(package_root / KERNELS / "lib", ignore_errors=True)
    shutil.copytree(built, package_root / KERNELS / "lib")


class BuildPy(build_py):
    """build_py, then the stubs and the kernels into build_lib."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            generate_stubs(Path(self.build_lib))
            build_kernels(ROOT, Path(self.build_lib))


class BinaryDistribution(Distribution):
    """A distribution with native code (the kernels), so that it installs where platform code goes."""

    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    """The kernels are native code for one platform, but call no Python C API: py3-none-<platform>."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(cmdclass={"build_py": BuildPy, "bdist_wheel": PlatformWheel}, distclass=BinaryDistribution)
