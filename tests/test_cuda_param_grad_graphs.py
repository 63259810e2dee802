"""The conv_wgrad graph path of convbias::param_grad (TORCH_CONVBIAS_PARAM_GRAD=cudnn), against F.conv2d's
autograd. The knob is read once per process, so the comparisons run in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys, torch, torch.nn.functional as F
sys.path.insert(0, "tests")
import torch_convbias
from cases import CASES
from conftest import MODES, assert_close, math_mode

checked = 0
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
            out.backward(grad)
            expected.backward(grad)
        assert_close(w.grad, w2.grad, mode, f"{mode_name} {case.id} grad_weight")
        assert w.grad.is_contiguous(memory_format=torch.channels_last) == w.is_contiguous(memory_format=torch.channels_last) or w.shape[2] * w.shape[3] == 1
        if b is not None:
            assert_close(b.grad, b2.grad, mode, f"{mode_name} {case.id} grad_bias")
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
# Layout is normalised to channels_last before the key is made, so NCHW and channels_last twins share a plan.
problems = len({(c.n, c.c, c.h, c.w, c.k, c.kernel, c.stride, c.padding, c.dilation, c.groups) for c in CASES})
print(json.dumps({"checked": checked, "problems": problems, "cache": torch_convbias.cache_info()}))
"""


def test_wgrad_graph_matches_autograd() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**os.environ, "TORCH_CONVBIAS_PARAM_GRAD": "cudnn", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["checked"] == 4 * 24
    # A weight-gradient plan per (mode, problem) at least: the conv_wgrad path really ran.
    assert report["cache"]["weight_grad_plans"] >= 4 * report["problems"], report
