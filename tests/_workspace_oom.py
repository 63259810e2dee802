"""Runs one convbias call whose workspace allocation fails for real, for tests/test_workspace_fallback.py.

Finds a problem whose chosen plan (forward or weight gradient) needs a workspace of at least 16 MiB and has a
fallback plan needing none, builds its plan with the GPU's memory free, then caps this process's share of the GPU
(torch.cuda.set_per_process_memory_fraction) so that the call's output still fits but its workspace does not, and
calls it again. Prints one JSON line: what ran, the result's error against F.conv2d, or the exception raised.
Usage: python tests/_workspace_oom.py [--deterministic] (TORCH_CONVBIAS_WORKSPACE_FALLBACK and
torch.backends.cudnn.deterministic decide what must happen).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import torch_convbias

MiB = 2**20
# Workspaces this large come from segments of their own: no free remainder of a live segment can serve them.
MIN_WORKSPACE = 16 * MiB


def problems() -> list[tuple[int, int, int, int, int]]:
    """(N, C, K, HW, kernel), channels_last float32 without TF32 under cudnn.benchmark: the exhaustive search picks
    FFT and other large-workspace engines there (0.5-1.8 GB measured on the H200)."""
    return [(64, 64, 64, 56, 5), (64, 64, 64, 56, 3), (128, 32, 32, 64, 5), (32, 128, 128, 28, 3), (256, 16, 32, 32, 7)]


def segment_bytes(nbytes: int) -> int:
    """What the caching allocator reserves for one new block of `nbytes` (>= 10 MiB: rounded up to 2 MiB)."""
    return -(-nbytes // (2 * MiB)) * 2 * MiB


def candidate(n: int, c: int, k: int, hw: int, r: int) -> dict[str, Any] | None:
    cl = torch.channels_last
    x = torch.randn(n, c, hw, hw, device="cuda").contiguous(memory_format=cl)
    w = (torch.randn(k, c, r, r, device="cuda") / (c * r * r) ** 0.5).contiguous(memory_format=cl)
    b = torch.randn(k, device="cuda")
    pad = r // 2
    fwd = torch_convbias.explain(x, w, b, padding=pad)
    reference = F.conv2d(x, w, b, padding=pad)
    if segment_bytes(reference.numel() * 4) < 10 * MiB:
        return None
    engine = fwd.get("engine") or {}
    fallback = engine.get("fallback")
    if fwd["path"] != "aten" and engine.get("workspace_bytes", 0) >= MIN_WORKSPACE and fallback and fallback["workspace_bytes"] == 0:
        call = lambda: torch.ops.convbias.forward(x, w, b, [1, 1], [pad, pad], [1, 1], 1)  # noqa: E731
        return {"op": "forward", "problem": [n, c, k, hw, r], "engine": engine["name"], "workspace_bytes": engine["workspace_bytes"],
                "fallback": fallback, "call": call, "reference": reference, "output_bytes": reference.numel() * 4}  # fmt: skip
    dy = torch.randn_like(reference)
    grad = torch_convbias.explain_param_grad(dy, x, w, padding=pad)["weight_grad"]
    engine = grad.get("engine") or {}
    fallback = engine.get("fallback")
    if grad["path"] == "cudnn graph" and engine.get("workspace_bytes", 0) >= MIN_WORKSPACE and fallback and fallback["workspace_bytes"] == 0:
        ref_w = torch.ops.aten.convolution_backward(dy, x, w, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], 1, [False, True, False])[1]
        call = lambda: torch.ops.convbias.param_grad(dy, x, w, [1, 1], [pad, pad], [1, 1], 1, [True, False])[0]  # noqa: E731
        return {"op": "param_grad", "problem": [n, c, k, hw, r], "engine": engine["name"], "workspace_bytes": engine["workspace_bytes"],
                "fallback": fallback, "call": call, "reference": ref_w, "output_bytes": w.numel() * 4}  # fmt: skip
    return None


def capped(call: Callable[[], torch.Tensor], output_bytes: int) -> torch.Tensor:
    """`call()` with this process's GPU memory capped at what is reserved now plus the output and 1 MiB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    allowed = torch.cuda.memory_reserved() + segment_bytes(output_bytes) + MiB
    torch.cuda.set_per_process_memory_fraction(allowed / total)
    try:
        result = call()
        torch.cuda.synchronize()
        return result
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def main() -> int:
    torch.backends.cudnn.deterministic = "--deterministic" in sys.argv
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    found = None
    for spec in problems():
        found = candidate(*spec)
        if found is not None:
            break
    if found is None:
        print(json.dumps({"skip": "no problem chose a plan with >= 16 MiB of workspace and a workspace-free fallback"}))
        return 0
    report = {key: found[key] for key in ("op", "problem", "engine", "workspace_bytes", "fallback")}
    report["scale"] = found["reference"].abs().max().item()
    before = torch_convbias.cache_info()["workspace_fallbacks"]
    try:
        result = capped(found["call"], found["output_bytes"])
        report["error"] = (result.float() - found["reference"]).abs().max().item()
    except torch.OutOfMemoryError as e:
        report["raised"] = type(e).__name__
        report["message"] = str(e).splitlines()[0]
        # Nothing is left broken: with the memory back, the same call runs its own plan.
        again = found["call"]()
        report["after_error"] = (again.float() - found["reference"]).abs().max().item()
    report["fallbacks_run"] = torch_convbias.cache_info()["workspace_fallbacks"] - before
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
