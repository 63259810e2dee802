"""convbias::param_grad on the GPU against F.conv2d's autograd: the conv_wgrad graph (the default,
TORCH_CONVBIAS_PARAM_GRAD=cudnn) and ATen (=aten), each case's path read from explain_param_grad, and the
bias-gradient kernel against ATen and float64. Knobs are read once per process, so the knob comparisons run in a
child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HAS_CUDA

import torch_convbias

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys, torch, torch.nn.functional as F
sys.path.insert(0, "tests")
import torch_convbias
from cases import CASES
from conftest import MODES, assert_close, math_mode

checked = 0
paths = {"cudnn graph": 0, "aten": 0, "bias kernel": 0, "channels_last cases": 0}
for mode_name in ("float32", "tf32", "float16", "bfloat16"):
    mode = MODES[mode_name]
    for case in CASES:
        stride, padding, dilation, groups = case.conv_args()
        x, w, b = case.tensors("cuda", mode.dtype)
        w.requires_grad_()
        if b is not None:
            b.requires_grad_()
        w2 = w.detach().clone().requires_grad_()
        b2 = b.detach().clone().requires_grad_() if b is not None else None
        with math_mode(mode):
            out = torch_convbias.conv_bias2d(x, w, b, stride, padding, dilation, groups)
            expected = F.conv2d(x, w2, b2, stride, padding, dilation, groups)
            grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1)).to("cuda", mode.dtype)
            grad = torch.empty_like(out).copy_(grad)  # in the output's layout, as autograd hands it over
            out.backward(grad)
            expected.backward(grad)
        assert_close(w.grad, w2.grad, mode, f"{mode_name} {case.id} grad_weight")
        assert w.grad.is_contiguous(memory_format=torch.channels_last) == w.is_contiguous(memory_format=torch.channels_last) or w.shape[2] * w.shape[3] == 1
        if b is not None:
            assert_close(b.grad, b2.grad, mode, f"{mode_name} {case.id} grad_bias")
        if case.channels_last:
            # What ran: the conv_wgrad graph (or ATen, saying why) and the bias kernel.
            with math_mode(mode):
                info = torch_convbias.explain_param_grad(grad, x, w.detach(), stride, padding, dilation, groups)
            paths[info["weight_grad"]["path"]] += 1
            paths["bias kernel"] += info["bias_grad"]["way"] == "kernel"
            paths["channels_last cases"] += 1
            if info["weight_grad"]["path"] == "aten":
                assert info["weight_grad"]["notes"], info
        checked += 1

# Determinism: bitwise-repeatable gradients.
torch.use_deterministic_algorithms(True)
case = CASES[1]
x, w, b = case.tensors("cuda", torch.float32)
grads = []
for _ in range(2):
    w_ = w.detach().clone().requires_grad_()
    torch_convbias.conv_bias2d(x, w_, b, *case.conv_args()).square().sum().backward()
    grads.append(w_.grad)
assert torch.equal(grads[0], grads[1])
# channels_last problems get a weight-gradient plan (graph, or ATen where measured faster); NCHW runs ATen.
problems = len({(c.n, c.c, c.h, c.w, c.k, c.kernel, c.stride, c.padding, c.dilation, c.groups)
                for c in CASES if c.channels_last})
print(json.dumps({"checked": checked, "problems": problems, "paths": paths, "cache": torch_convbias.cache_info()}))
"""


@pytest.mark.parametrize("way", ["cudnn", "aten"])
def test_param_grad_matches_autograd(way: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**os.environ, "TORCH_CONVBIAS_PARAM_GRAD": way, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["checked"] == 4 * 24
    paths = report["paths"]
    if way == "cudnn":
        # cudnn.benchmark off: nothing timed, so the conv_wgrad graph runs wherever it builds (explain says so).
        assert paths["cudnn graph"] >= paths["channels_last cases"] // 2 > 0, report
    else:
        assert paths["cudnn graph"] == 0 and report["cache"]["weight_grad_plans"] == 0, report
    # The bias gradient of channels_last grad_outputs with K in 16-byte rows ran our kernel.
    assert paths["bias kernel"] >= paths["channels_last cases"] // 4 > 0, report


# Many bands to fold (4096 x 24 rows of 8 x 8), columns that fill no whole fold block (24, 40), wide rows (2048).
BIAS_SHAPES = [
    (2, 8, 5, 5), (64, 64, 32, 32), (3, 24, 7, 9), (1, 2048, 3, 3), (5, 40, 1, 1), (1024, 16, 4, 4), (4096, 24, 8, 8),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bias_grad_kernel_matches_float64(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    dy = torch.randn(shape, generator=g).to("cuda", dtype).contiguous(memory_format=torch.channels_last)
    expected = dy.double().sum((0, 2, 3))
    kernel = torch.ops.convbias._bias_grad(dy, "kernel")
    aten = torch.ops.convbias._bias_grad(dy, "aten")
    assert kernel.dtype == dtype and kernel.shape == (shape[1],)
    # FP32 accumulation, one rounding at the end: as close to the exact sum as ATen's.
    count = shape[0] * shape[2] * shape[3]
    tol = {torch.float64: 1e-12, torch.float32: 1e-6 * count**0.5}.get(dtype, 0.0)
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(kernel.double(), expected, rtol=tol or {torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype], atol=(tol or 1e-2) * scale)
    torch.testing.assert_close(kernel, aten, rtol=tol or 1e-2, atol=(tol or 1e-2) * scale)
    # Deterministic: a fixed reduction order.
    assert torch.equal(kernel, torch.ops.convbias._bias_grad(dy, "kernel"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 8, 5, 5), (64, 64, 16, 16), (3, 24, 7, 9)], ids=lambda s: "x".join(map(str, s)))
def test_bias_grad_cudnn_reduction_matches_float64(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    """The cuDNN reduction graph way (TORCH_CONVBIAS_BIAS_GRAD=cudnn): runtime-compiled, so slow to build."""
    g = torch.Generator().manual_seed(sum(shape))
    dy = torch.randn(shape, generator=g).to("cuda", dtype).contiguous(memory_format=torch.channels_last)
    expected = dy.double().sum((0, 2, 3))
    got = torch.ops.convbias._bias_grad(dy, "cudnn")
    assert got.dtype == dtype and got.shape == (shape[1],)
    scale = max(1.0, expected.abs().max().item())
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * scale)
    assert torch_convbias.cache_info()["bias_grad_plans"] >= 1


def test_explain_param_grad_reports_the_paths_param_grad_takes() -> None:
    cl = torch.channels_last
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, 12, 12, generator=g).cuda().contiguous(memory_format=cl)
    w = torch.randn(32, 16, 3, 3, generator=g).cuda().contiguous(memory_format=cl)
    dy = torch.randn(8, 32, 12, 12, generator=g).cuda().contiguous(memory_format=cl)
    torch_convbias.cache_clear()
    info = torch_convbias.explain_param_grad(dy, x, w, padding=1)
    weight_grad, bias_grad = info["weight_grad"], info["bias_grad"]
    assert weight_grad["path"] in ("cudnn graph", "aten"), info
    assert weight_grad["problem"].startswith("input [8, 16, 12, 12], grad_output [8, 32, 12, 12]"), info
    assert weight_grad["cached"] is False and weight_grad["plan_build_seconds"] > 0, info
    if weight_grad["path"] == "cudnn graph":
        assert weight_grad["engine"]["name"].startswith("eng"), info
    else:
        assert weight_grad["notes"] and "ATen" in " ".join(weight_grad["notes"]), info
    # explain built the very plan param_grad then uses: cached, and no new plan built by the call.
    assert torch_convbias.explain_param_grad(dy, x, w, padding=1)["weight_grad"]["cached"] is True
    misses = torch_convbias.cache_info()["misses"]
    grad_weight, grad_bias = torch.ops.convbias.param_grad(dy, x, w, [1, 1], [1, 1], [1, 1], 1, [True, True])
    assert torch_convbias.cache_info()["misses"] == misses
    w_ref = w.detach().clone().requires_grad_()
    b_ref = torch.zeros(32, device="cuda", requires_grad=True)
    with torch.backends.cudnn.flags(allow_tf32=False):
        torch.nn.functional.conv2d(x, w_ref, b_ref, padding=1).backward(dy)
    torch.testing.assert_close(grad_bias, b_ref.grad, rtol=1e-5, atol=1e-4)
    assert bias_grad["way"] == "kernel" and bias_grad["notes"] == [], info
    assert bias_grad["launch"]["blocks_per_sm"] in (1, 2, 4, 8) and bias_grad["launch"]["loads_in_flight"] in (4, 16)
    assert bias_grad["launch"]["bands"] in ("contiguous", "interleaved")
    # Under torch.use_deterministic_algorithms the kernel's launch configuration is the fixed default, untimed.
    torch.use_deterministic_algorithms(True)
    try:
        launch = torch_convbias.explain_param_grad(dy, x, w, padding=1)["bias_grad"]["launch"]
    finally:
        torch.use_deterministic_algorithms(False)
    assert launch == {"blocks_per_sm": 4, "loads_in_flight": 16, "bands": "interleaved", "timed": False}
    # NCHW tensors: ATen for both, and why.
    nchw = torch_convbias.explain_param_grad(dy.contiguous(), x.contiguous(), w.contiguous(), padding=1)
    assert nchw["weight_grad"]["path"] == "aten" and "NCHW" in nchw["weight_grad"]["notes"][0], nchw
    assert nchw["bias_grad"]["way"] == "aten" and "channels_last" in nchw["bias_grad"]["notes"][0], nchw
    assert nchw["math"]["allow_tf32"] == torch.backends.cudnn.allow_tf32


def test_explain_param_grad_names_the_knobs_that_force_aten() -> None:
    script = (
        "import json, torch, torch_convbias\n"
        "cl = torch.channels_last\n"
        "x = torch.randn(4, 8, 6, 6, device='cuda').contiguous(memory_format=cl)\n"
        "w = torch.randn(16, 8, 3, 3, device='cuda').contiguous(memory_format=cl)\n"
        "dy = torch.randn(4, 16, 6, 6, device='cuda').contiguous(memory_format=cl)\n"
        "print(json.dumps(torch_convbias.explain_param_grad(dy, x, w, padding=1)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "TORCH_CONVBIAS_PARAM_GRAD": "aten", "TORCH_CONVBIAS_BIAS_GRAD": "aten"},
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["weight_grad"] == {"path": "aten", "notes": ["TORCH_CONVBIAS_PARAM_GRAD=aten"]}, info
    assert info["bias_grad"] == {"way": "aten", "notes": ["TORCH_CONVBIAS_BIAS_GRAD=aten"]}, info


def test_bias_grad_kernel_refuses_what_it_cannot_take() -> None:
    nchw = torch.randn(2, 8, 4, 4, device="cuda")
    with pytest.raises(ValueError, match="the kernel takes channels_last"):
        torch.ops.convbias._bias_grad(nchw, "kernel")
    with pytest.raises(ValueError, match="the cuDNN reduction graph takes channels_last"):
        torch.ops.convbias._bias_grad(nchw, "cudnn")
    odd = torch.randn(2, 6, 4, 4, device="cuda").contiguous(memory_format=torch.channels_last)  # K*4 bytes % 16 != 0
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        torch.ops.convbias._bias_grad(odd, "kernel")
    with pytest.raises(ValueError, match="expected a 4-D grad_output, got 3-D"):
        torch.ops.convbias._bias_grad(nchw[0], "aten")
    with pytest.raises(ValueError, match="way must be 'kernel', 'cudnn' or 'aten', got 'fast'"):
        torch.ops.convbias._bias_grad(odd, "fast")
    # param_grad still gives the right bias gradient for both (through ATen's sum).
    for dy in (nchw, odd):
        x = torch.randn(dy.shape[0], 3, 6, 6, device="cuda")
        w = torch.randn(dy.shape[1], 3, 3, 3, device="cuda")
        _, grad_bias = torch.ops.convbias.param_grad(dy, x, w, [1, 1], [0, 0], [1, 1], 1, [False, True])
        torch.testing.assert_close(grad_bias, dy.sum((0, 2, 3)), rtol=1e-5, atol=1e-5)
