"""Concurrency on the GPU: 8 threads hammering the plan cache with mixed shapes, dtypes and layouts, forward and
param_grad, each result checked against F.conv2d / ATen. Run in a subprocess twice: with the default cache, and
with a cache of 4 plans, so that threads evict each other's plans while they use them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, random, sys, threading
import torch, torch.nn.functional as F, torch_convbias

torch.backends.cudnn.allow_tf32 = False
THREADS, ITERS = 8, 40
SHAPES = [  # n, c, h, w, k, kernel, stride, padding, groups
    (2, 8, 8, 8, 8, 3, 1, 1, 1), (3, 16, 10, 9, 16, 3, 2, 1, 1), (1, 4, 12, 12, 16, 1, 1, 0, 1),
    (2, 32, 7, 7, 32, 3, 1, 1, 4), (4, 8, 16, 16, 24, 5, 1, 2, 1), (2, 24, 9, 11, 8, 3, 1, 0, 2),
]
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
cases = []
gen = torch.Generator().manual_seed(0)
for n, c, h, w, k, r, s, p, g in SHAPES:
    for dtype in TOL:
        for fmt in (torch.channels_last, torch.contiguous_format):
            x = torch.randn(n, c, h, w, generator=gen).to("cuda", dtype).contiguous(memory_format=fmt)
            wt = (torch.randn(k, c // g, r, r, generator=gen) / (c // g * r * r) ** 0.5).to("cuda", dtype).contiguous(memory_format=fmt)
            b = torch.randn(k, generator=gen).to("cuda", dtype)
            out = F.conv2d(x, wt, b, s, p, 1, g)
            dy = torch.randn(out.shape, generator=gen).to("cuda", dtype).contiguous(memory_format=fmt)
            _, gw, gb = torch.ops.aten.convolution_backward(dy, x, wt, [k], [s, s], [p, p], [1, 1], False, [0, 0], g, [False, True, True])
            cases.append((x, wt, b, s, p, g, out, dy, gw, gb, TOL[dtype]))
torch.cuda.synchronize()
errors, calls = [], [0] * THREADS

def close(actual, expected, tol, what):
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale, msg=lambda m: what + ": " + m)

def work(t):
    rng = random.Random(t)
    try:
        for i in range(ITERS):
            x, wt, b, s, p, g, out, dy, gw, gb, tol = cases[rng.randrange(len(cases))]
            close(torch_convbias.conv_bias2d(x, wt, b, s, p, 1, g), out, tol, "forward")
            got_w, got_b = torch.ops.convbias.param_grad(dy, x, wt, [s, s], [p, p], [1, 1], g, [True, True])
            close(got_w, gw, tol, "grad_weight")
            close(got_b, gb, tol, "grad_bias")
            calls[t] += 1
    except BaseException as e:
        errors.append(repr(e))

threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
for th in threads:
    th.start()
for th in threads:
    th.join()
torch.cuda.synchronize()
info = torch_convbias.cache_info()
if errors:
    print(errors[0])
    sys.exit(1)
print(json.dumps({"calls": sum(calls), "cache": info}))
"""


@pytest.mark.parametrize("cache_size", [None, "4"])
def test_eight_threads_mixed_shapes_share_the_plan_cache(cache_size: str | None) -> None:
    env = dict(os.environ)
    if cache_size is not None:
        env["TORCH_CONVBIAS_CACHE_SIZE"] = cache_size
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-2000:])
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["calls"] == 8 * 40, report
    if cache_size is not None:
        # 24 (shape, dtype, layout) keys through caches of 4 plans each (forward, weight- and bias-gradient plans):
        # plans were evicted while other threads ran, and no cache grew past its capacity.
        cache = report["cache"]
        assert cache["capacity"] == 4 and cache["evictions"] > 0, report
        for kind in ("forward_plans", "weight_grad_plans", "bias_grad_plans"):
            assert cache[kind] <= 4, (kind, report)
