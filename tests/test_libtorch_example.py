"""The LibTorch example (examples/libtorch/): a C++ program without Python links libtorch_convbias.so, calls
convbias::forward and convbias::param_grad (csrc/convbias.h) on the CPU, and on CUDA when a GPU is present, and
checks them against LibTorch's own convolution. Configured and built with CMake here, then run."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_convbias

ROOT = Path(__file__).resolve().parents[1]


def cuda_home() -> str:
    """The toolkit setup.py builds with: CUDA_HOME / CUDA_PATH, else /usr/local/cuda, else torch's guess."""
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and Path(candidate, "include", "cuda_runtime.h").is_file():
            return candidate
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME or "/usr/local/cuda"


def cmake_args() -> list[str]:
    args = [f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", f"-DTORCH_CONVBIAS_DIR={ROOT}"]
    if torch.version.cuda:
        # TorchConfig of a CUDA build looks for the toolkit, and for libnvrtc in it; the nvidia-cuda-nvrtc wheel
        # torch depends on has one where a toolkit lacks it.
        args.append(f"-DCUDA_TOOLKIT_ROOT_DIR={cuda_home()}")
        wheels = sorted(glob.glob(str(Path(torch.__file__).parents[1] / "nvidia" / "*" / "lib" / "libnvrtc.so*")))
        if wheels:
            args.append(f"-DCUDA_nvrtc_LIBRARY={wheels[0]}")
    return args


def find_cmake() -> str | None:
    """cmake on PATH, else the one the cmake wheel installs (next to this interpreter, or in the package)."""
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if found is None:
        try:
            import cmake  # type: ignore[import-not-found]

            found = shutil.which("cmake", path=cmake.CMAKE_BIN_DIR)
        except ImportError:
            return None
    return found


CMAKE = find_cmake()


def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)  # type: ignore[call-overload]


@pytest.mark.skipif(CMAKE is None, reason="needs cmake (./dev.sh setup installs it where it can)")
def test_libtorch_program_links_the_library_and_runs(tmp_path: Path) -> None:
    assert torch_convbias.LIBRARY_PATH.is_file()
    build = tmp_path / "build"
    assert CMAKE is not None
    configure = run([CMAKE, "-S", str(ROOT / "examples" / "libtorch"), "-B", str(build), *cmake_args()])
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    compiled = run([CMAKE, "--build", str(build), "-j", "2"])
    assert compiled.returncode == 0, compiled.stdout[-3000:] + compiled.stderr[-3000:]
    result = run([str(build / "convbias_example")])
    assert result.returncode == 0, result.stdout + result.stderr
    for what in ("forward", "forward + gelu", "forward_residual + relu", "grad_weight", "grad_bias"):
        assert f"ok   cpu {what}" in result.stdout, result.stdout
    if torch.cuda.is_available():
        assert "ok   cuda:0 forward" in result.stdout, result.stdout
