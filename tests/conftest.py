"""Shared test settings: devices, numeric modes and their tolerances (written down once, here)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@dataclass(frozen=True)
class Mode:
    """A dtype plus the math flags it runs under. ``tf32`` is float32 with TF32 tensor cores allowed."""

    name: str
    dtype: torch.dtype
    tf32: bool
    # Tolerances relative to the magnitude of the reference: atol is scaled by max(1, max|reference|) since
    # sums over N*H*W (weight gradients) grow with the problem while their rounding errors grow with them.
    rtol: float
    atol: float


MODES = {
    "float64": Mode("float64", torch.float64, False, rtol=1e-7, atol=1e-7),
    # float32 with TF32 off: cuDNN graphs and F.conv2d may pick different algorithms (e.g. Winograd); TF32 would
    # show errors around 1e-3, well outside this.
    "float32": Mode("float32", torch.float32, False, rtol=1e-4, atol=1e-4),
    "tf32": Mode("tf32", torch.float32, True, rtol=5e-3, atol=5e-3),
    "float16": Mode("float16", torch.float16, False, rtol=5e-3, atol=5e-3),
    "bfloat16": Mode("bfloat16", torch.bfloat16, False, rtol=3e-2, atol=3e-2),
}

CPU_MODES = ["float64", "float32", "bfloat16"]
CUDA_MODES = ["float32", "tf32", "float16", "bfloat16"]


def device_modes() -> list:
    """(device, mode) pairs: the CPU reference path and, marked `cuda`, the GPU path."""
    pairs = [pytest.param("cpu", m, id=f"cpu-{m}") for m in CPU_MODES]
    pairs += [pytest.param("cuda", m, id=f"cuda-{m}", marks=cuda) for m in CUDA_MODES]
    return pairs


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=cuda)]


@contextlib.contextmanager
def math_mode(mode: Mode) -> Iterator[None]:
    """TF32 on or off for both cuDNN and matmul, restored afterwards."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = mode.tf32
    torch.backends.cuda.matmul.allow_tf32 = mode.tf32
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def assert_close(actual: torch.Tensor | None, expected: torch.Tensor | None, mode: Mode, what: str = "") -> None:
    assert (actual is None) == (expected is None), f"{what}: one of actual/expected is None"
    if actual is None or expected is None:
        return
    scale = max(1.0, expected.detach().abs().amax().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=mode.rtol, atol=mode.atol * scale, msg=lambda m: f"{what}: {m}")


def every_value(dtype: torch.dtype, bound: float) -> torch.Tensor:
    """Every finite value of a 16-bit float dtype within [-bound, bound], in order of bit pattern (1-D, CPU)."""
    assert dtype in (torch.float16, torch.bfloat16), dtype
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return values[values.isfinite() & (values.abs() <= bound)]


def tail_accurate(name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A float64 formula of the activation that keeps its relative accuracy in the far negative tail, where F's own
    float64 formulas cancel (0.5 * (1 + erf(x / sqrt 2)) and 0.5 * (1 + tanh(u)) lose all digits below ~1e-16: F.gelu's
    gradient at -8.375 is 1.4% off), for oracles of values down there; None where F's formula is accurate."""
    if name == "gelu":
        return lambda z: z * 0.5 * torch.special.erfc(-z * 0.5**0.5)
    if name == "gelu_tanh":
        return lambda z: z * torch.sigmoid(2 * (2 / math.pi) ** 0.5 * (z + 0.044715 * z**3))  # 0.5 (1 + tanh u)
    return None


# Below float32's normal range the fast exp and division of the 16-bit activation kernels flush to zero
# (csrc/cuda/activation_math.cuh); a difference this small from float64 is allowed there.
FLUSHED = 1e-35


def assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor, what: str, max_mismatch: float) -> None:
    """``got`` (16-bit) within one unit in the last place of ``want`` (float64; ``FLUSHED`` absolute near zero), and
    equal to ``want``'s correct rounding in all but a ``max_mismatch`` fraction of elements."""
    got64 = got.detach().cpu().double().flatten()
    want = want.detach().cpu().double().flatten()
    finfo = torch.finfo(got.dtype)
    _, exponent = torch.frexp(want.abs().clamp_min(finfo.tiny))
    ulp = finfo.eps * torch.ldexp(torch.ones_like(want), exponent - 1)
    error = (got64 - want).abs()
    beyond = error > ulp + FLUSHED
    assert not beyond.any(), (
        f"{what}: {int(beyond.sum())} of {want.numel()} values beyond one ulp, e.g. got {got64[beyond][:4].tolist()} "
        f"for {want[beyond][:4].tolist()}"
    )
    mismatch = (got64 != want.to(got.dtype).double()).double().mean().item()
    assert mismatch <= max_mismatch, f"{what}: {mismatch:.2e} of the values differ from float64's rounding"


def run_script_with_knobs(script: str, *args: str, **knobs: str) -> dict[str, Any]:
    """`script` (Python source printing one JSON line last) run in a fresh process from the project root, with
    TORCH_CONVBIAS_<NAME>=value for each knob (knobs are read once per process); its JSON, after checking it exited 0."""
    env = {**os.environ, **{f"TORCH_CONVBIAS_{name.upper()}": value for name, value in knobs.items()}}
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
