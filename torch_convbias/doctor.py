"""``python -m torch_convbias.doctor``: what torch_convbias runs with, and a self-check.

Prints the GPU, driver, torch, CUDA, cuDNN (loaded and compiled against) and cuDNN frontend versions, the plan
cache settings, then runs the seed case through the op and compares it with F.conv2d. Without a GPU it says so,
checks the CPU reference path, and exits cleanly.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch


def _driver_version() -> str:
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"{version.value // 1000}.{version.value % 1000 // 10}"
    except OSError:
        pass
    return "unknown"


def main() -> int:
    import torch_convbias

    info = torch_convbias.versions()
    print(f"torch_convbias {torch_convbias.__version__}")
    for key, value in info.items():
        print(f"  {key:15s} {value}")
    if info["cudnn_loaded"] != info["cudnn_compiled"]:
        print("  note: cuDNN loaded at run time differs from the headers compiled against (fine within 9.x)")
    for knob in ("TORCH_CONVBIAS_CACHE_SIZE", "TORCH_CONVBIAS_PATH", "TORCH_CONVBIAS_AUTOTUNE",
                 "TORCH_CONVBIAS_NO_RUNTIME_COMPILATION", "TORCH_CONVBIAS_RUNTIME_COMPILATION"):
        if knob in os.environ:
            print(f"  {knob}={os.environ[knob]}")

    if not torch.cuda.is_available():
        print("no CUDA GPU visible: only the CPU reference path is available")
        passed, report = torch_convbias.diagnostics.self_check("cpu")
        print(("ok   " if passed else "FAIL ") + report)
        return 0 if passed else 1

    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        print(f"  gpu {index}: {props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB")
    print(f"  driver          {_driver_version()}")
    passed, report = torch_convbias.diagnostics.self_check("cuda")
    print(("ok   " if passed else "FAIL ") + report)
    print(f"  plan cache: {torch_convbias.cache_info()}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
