"""Build torch_convbias._C, a CUDAExtension, against the installed torch.

The extension always compiles its CUDA side (cuDNN graphs through the cuDNN frontend), also on a machine
without a GPU, so that CI checks the real code. What it needs, and where it looks:

* CUDA toolkit: ``CUDA_HOME``/``CUDA_PATH``, else ``/usr/local/cuda``, else what torch finds.
* cuDNN headers and ``libcudnn.so.9``: ``CUDNN_HOME`` (or ``CUDNN_INCLUDE_DIR``/``CUDNN_LIB_DIR``), else the
  ``nvidia-cudnn-cu1x`` wheel that torch depends on, else ``CUDA_HOME``.
* cuDNN frontend headers (header-only): ``CUDNN_FRONTEND_INCLUDE_DIR``, else the ``nvidia-cudnn-frontend``
  package.

When one of them is missing the build stops with a message naming it and how to provide it.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def fail(what: str, how: str) -> None:
    sys.exit(f"\ntorch_convbias build: {what} not found.\n  {how}\n")


def pick_cuda_home() -> None:
    """torch guesses CUDA_HOME from `which nvcc`; a wrapper script in /usr/local/bin fools it into /usr/local."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    for candidate in ("/usr/local/cuda",):
        if Path(candidate, "include", "cuda_runtime.h").is_file():
            os.environ["CUDA_HOME"] = candidate
            return


def links_libstdcxx_dynamically(compiler: str) -> bool:
    """Whether `compiler` has a shared libstdc++ to link (else it silently links the static archive)."""
    try:
        found = subprocess.run(
            [compiler, "-print-file-name=libstdc++.so"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return False
    return os.path.isabs(found) and os.path.exists(found)


def pick_cxx_compiler() -> None:
    """Use a C++ compiler that links libstdc++ dynamically.

    A static copy of libstdc++ inside _C clashes with the shared one that torch already loaded (seen crashing
    on the first number formatted into an error message). Some images set CXX to a private GCC that only has
    the static archive; then fall back to the system compiler.
    """
    configured = os.environ.get("CXX", "c++")
    if links_libstdcxx_dynamically(configured):
        return
    for candidate in ("/usr/bin/g++", "g++", "c++"):
        path = shutil.which(candidate)
        if path and links_libstdcxx_dynamically(path):
            print(f"torch_convbias build: {configured} has no shared libstdc++ to link; using {path} instead")
            os.environ["CXX"] = path
            c_compiler = shutil.which(path[: -len("g++")] + "gcc") if path.endswith("g++") else None
            os.environ["CC"] = c_compiler or path
            return
    fail(
        "a C++ compiler that links libstdc++ dynamically",
        f"{configured} has only a static libstdc++; set CXX (and CC) to a compiler with libstdc++.so.",
    )


def pick_cuda_arch_list() -> None:
    """torch compiles CUDA kernels for the GPUs it sees; on a machine without one (CI, a build box) it finds none
    and fails. Then build for Ampere and Hopper, with PTX that newer GPUs compile at load time."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"


pick_cuda_home()
pick_cxx_compiler()
pick_cuda_arch_list()

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def cuda_home() -> Path:
    if CUDA_HOME is None or not Path(CUDA_HOME, "include", "cuda_runtime.h").is_file():
        fail("CUDA toolkit (nvcc and include/cuda_runtime.h)", "Install the CUDA toolkit or set CUDA_HOME.")
    return Path(CUDA_HOME)


def installed_package_dir(dist: str, *parts: str) -> Path | None:
    try:
        path = Path(str(importlib.metadata.distribution(dist).locate_file(Path(*parts))))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.exists() else None


def cudnn_dirs() -> tuple[Path, Path]:
    """(include dir, library dir) of cuDNN 9."""
    include = os.environ.get("CUDNN_INCLUDE_DIR")
    lib = os.environ.get("CUDNN_LIB_DIR")
    if os.environ.get("CUDNN_HOME"):
        home = Path(os.environ["CUDNN_HOME"])
        include = include or str(home / "include")
        lib = lib or str(next((home / d for d in ("lib64", "lib") if (home / d).is_dir()), home / "lib"))
    candidates: list[tuple[Path, Path]] = []
    if include and lib:
        candidates.append((Path(include), Path(lib)))
    for dist in ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
        wheel = installed_package_dir(dist, "nvidia", "cudnn")
        if wheel is not None:
            candidates.append((wheel / "include", wheel / "lib"))
    home = cuda_home()
    candidates += [(home / "include", home / d) for d in ("lib64", "lib")]
    for inc, lib_dir in candidates:
        if (inc / "cudnn.h").is_file() and glob.glob(str(lib_dir / "libcudnn.so*")):
            return inc, lib_dir
    fail(
        "cuDNN 9 (cudnn.h and libcudnn.so.9)",
        "pip install the nvidia-cudnn-cu13 wheel (a dependency of CUDA builds of torch), "
        "or set CUDNN_HOME (or CUDNN_INCLUDE_DIR and CUDNN_LIB_DIR).",
    )
    raise AssertionError  # unreachable: fail() exits


def cudnn_frontend_include() -> Path:
    env = os.environ.get("CUDNN_FRONTEND_INCLUDE_DIR")
    candidates = [Path(env)] if env else []
    wheel = installed_package_dir("nvidia-cudnn-frontend", "include")
    if wheel is not None:
        candidates.append(wheel)
    for inc in candidates:
        if (inc / "cudnn_frontend.h").is_file():
            if inc.name != "include":
                # Some frontend headers include "../include/<header>": the folder must keep its name.
                fail(
                    f"cuDNN frontend headers in a folder named 'include' ({inc} is named {inc.name!r})",
                    "Copy the package's include/ folder keeping its name, e.g. to .carry/cudnn_frontend/include.",
                )
            return inc
    fail(
        "cuDNN frontend headers (cudnn_frontend.h)",
        "pip install nvidia-cudnn-frontend, or set CUDNN_FRONTEND_INCLUDE_DIR to a folder holding cudnn_frontend.h"
        + (f" (CUDNN_FRONTEND_INCLUDE_DIR={env} has none)" if env else ""),
    )
    raise AssertionError


def nvrtc_include() -> Path:
    """The frontend's headers include nvrtc.h (for its runtime-compiled engines); we never call NVRTC ourselves."""
    candidates = [cuda_home() / "include"]
    for dist in ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu13", "nvidia-cuda-nvrtc-cu12"):
        for sub in (("nvidia", "cu13", "include"), ("nvidia", "cuda_nvrtc", "include")):
            wheel = installed_package_dir(dist, *sub)
            if wheel is not None:
                candidates.append(wheel)
    for inc in candidates:
        if (inc / "nvrtc.h").is_file():
            return inc
    fail("nvrtc.h (needed by the cuDNN frontend headers)", "Install the full CUDA toolkit or the nvidia-cuda-nvrtc wheel.")
    raise AssertionError


def nvrtc_link_args() -> list[str]:
    """The frontend's runtime-compiled (OSS) engines call NVRTC from inline code that ends up in _C, so _C
    needs libnvrtc at load time: link it by soname, preferring the wheel torch itself uses."""
    import torch

    major = (torch.version.cuda or "13").split(".")[0]
    candidates = [
        installed_package_dir(dist, *sub)
        for dist in ("nvidia-cuda-nvrtc", f"nvidia-cuda-nvrtc-cu{major}")
        for sub in (("nvidia", f"cu{major}", "lib"), ("nvidia", "cuda_nvrtc", "lib"))
    ]
    candidates += [cuda_home() / "lib64", cuda_home() / "lib"]
    for lib_dir in candidates:
        if lib_dir is not None and (lib_dir / f"libnvrtc.so.{major}").exists():
            return [f"-L{lib_dir}", f"-l:libnvrtc.so.{major}", f"-Wl,-rpath,{lib_dir}"]
    fail(f"libnvrtc.so.{major} (needed by the cuDNN frontend)", "Install the nvidia-cuda-nvrtc wheel or the CUDA toolkit.")
    raise AssertionError


def cudnn_link_args(lib_dir: Path) -> list[str]:
    """Link libcudnn the way torch does: by soname, since the wheel ships only libcudnn.so.9 (no libcudnn.so)."""
    sonames = sorted(Path(p).name for p in glob.glob(str(lib_dir / "libcudnn.so*")))
    soname = "libcudnn.so.9" if "libcudnn.so.9" in sonames else sonames[0]
    # At run time torch has already loaded libcudnn.so.9 by the time _C is imported; the rpaths cover
    # LibTorch programs and a wheel install next to nvidia/cudnn.
    return [
        f"-L{lib_dir}",
        f"-l:{soname}",
        f"-Wl,-rpath,{lib_dir}",
        "-Wl,-rpath,$ORIGIN/../nvidia/cudnn/lib",
    ]


def torch_rpath_args() -> list[str]:
    """Where the op library finds libtorch and libc10 at run time without Python (which loads them first): the
    torch it was built against, and a torch installed next to torch_convbias."""
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    return [f"-Wl,-rpath,{torch_lib}", "-Wl,-rpath,$ORIGIN/../torch/lib"]


def op_library() -> CUDAExtension:
    """``torch_convbias/libtorch_convbias.so``: the operators and their kernels (everything in csrc/ but csrc/python/).

    Not a Python module: ``torch_convbias/__init__.py`` loads it with ``torch.ops.load_library``, and LibTorch
    programs link it (examples/libtorch/). So it must not depend on Python: torch_python, which CUDAExtension adds
    for Python modules, is left out.
    """
    cudnn_include, cudnn_lib = cudnn_dirs()
    frontend_include = cudnn_frontend_include()
    # nvrtc.h's folder: the toolkit's, or the NVRTC wheel's (nvidia/cu13/include), which also holds the CUDA runtime's
    # headers of that wheel's version (and cusparse.h, cublas*.h, ... that ATen's CUDA headers need and a minimal
    # toolkit lacks). Searched after the toolkit's own include folder (CUDAExtension adds it with -I, after ours): the
    # wheel only fills what the toolkit lacks, and never shadows its runtime headers (nvcc refuses headers of another
    # version: torch 2.15's cu132 wheels with nvcc 13.0).
    after_toolkit = [str(nvrtc_include())]
    sources = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "csrc").rglob("*")
        if p.suffix in {".cpp", ".cu"} and PYTHON_SOURCES not in p.parents
    )
    debug = os.environ.get("TORCH_CONVBIAS_DEBUG_BUILD") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    library = CUDAExtension(
        name="torch_convbias.libtorch_convbias",
        sources=sources,
        include_dirs=[str(ROOT / "csrc"), str(cudnn_include), str(frontend_include)],
        # The C++ standard is left to torch (C++17 or C++20 depending on its version).
        # --extended-lambda: ATen's gpu_kernel (cuda/bias_activation.cu) launches __host__ __device__ lambdas.
        extra_compile_args={
            "cxx": [*opt, *(f"-idirafter{d}" for d in after_toolkit)],
            "nvcc": [
                *opt,
                "--extended-lambda",
                *(flag for d in after_toolkit for flag in ("-isystem", d)),
                *(f"-Xcompiler=-idirafter{d}" for d in after_toolkit),
            ],
        },
        extra_link_args=cudnn_link_args(cudnn_lib) + nvrtc_link_args() + torch_rpath_args(),
        py_limited_api=False,
    )
    library.libraries = [name for name in library.libraries if name != "torch_python"]
    return library


def python_module() -> CppExtension:
    """``torch_convbias/_C.so``: the Python entry points (csrc/python/), calling the operators through the
    dispatcher (csrc/convbias.h), so it needs no link to the op library."""
    return CppExtension(
        name="torch_convbias._C",
        sources=sorted(str(p.relative_to(ROOT)) for p in PYTHON_SOURCES.rglob("*.cpp")),
        include_dirs=[str(ROOT / "csrc")],
        extra_compile_args={"cxx": ["-O3"]},
        py_limited_api=False,
    )


PYTHON_SOURCES = ROOT / "csrc" / "python"

setup(
    packages=find_packages(include=["torch_convbias", "torch_convbias.*"]),
    ext_modules=[op_library(), python_module()],
    # No ABI tag in the file names: libtorch_convbias.so is a plain shared library that C++ programs link.
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True, no_python_abi_suffix=True)},
)
