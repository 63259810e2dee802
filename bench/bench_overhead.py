"""Per-call overhead benchmark: host time of one call on a tiny problem, where the convolution itself is nearly
free, so what is measured is dispatch, argument checks, plan-cache lookup and launch.

Variants (each called ``--calls`` times back to back, then one synchronisation; the per-call figure is wall time /
calls, the median of ``--repeats`` such loops, interleaved):

==========================  ======================================================================================
torch_conv2d                ``F.conv2d(x, w, b)``
ours                        ``torch.ops.convbias.forward(x, w, b, ...)`` (no tensor requires grad)
torch_conv2d_grad           ``F.conv2d`` with a weight that requires grad (autograd records the call)
ours_grad                   ``torch.ops.convbias.forward`` with a weight that requires grad
torch_aten_convolution      ``torch.ops.aten.convolution.default``: the floor of any call through ``torch.ops``
torch_module / ours_module  ``nn.Conv2d(x)`` vs ``ConvBias2d(x)`` under no_grad: what a model calls (ours through
                            the eager C++ entry ``_C._forward_eager``, not torch.ops)
torch_step / ours_step      forward + backward of a weight that requires grad: nn.Conv2d vs ConvBias2d
==========================  ======================================================================================

Run from the repository root: ``python -m bench.bench_overhead`` (CUDA if present, else CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import torch_convbias

from .common import environment, print_table, synchronize, write_json

NAME = "overhead"
SCHEMA = "torch_convbias.bench_overhead/1"


def per_call_us(fn: Callable[[], object], calls: int, device: str) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / calls * 1e6


def variants(device: str, shape: Sequence[int], channels_last: bool) -> dict[str, Callable[[], object]]:
    n, c, hw, k = shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(n, c, hw, hw, device=device).contiguous(memory_format=fmt)
    conv = nn.Conv2d(c, k, 3, padding=1, device=device).to(memory_format=fmt)
    ours = torch_convbias.ConvBias2d(c, k, 3, padding=1, device=device).to(memory_format=fmt)
    w, b = conv.weight.detach(), conv.bias.detach()
    forward = torch.ops.convbias.forward
    aten = torch.ops.aten.convolution.default

    def torch_step() -> None:
        conv(x).sum().backward()

    def ours_step() -> None:
        ours(x).sum().backward()

    return {
        "torch_conv2d": lambda: F.conv2d(x, w, b, 1, 1),
        "ours": lambda: forward(x, w, b, [1, 1], [1, 1], [1, 1], 1),
        "torch_conv2d_grad": lambda: F.conv2d(x, conv.weight, conv.bias, 1, 1),
        "ours_grad": lambda: forward(x, conv.weight, conv.bias, [1, 1], [1, 1], [1, 1], 1),
        "torch_aten_convolution": lambda: aten(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
        "torch_module": torch.no_grad()(lambda: conv(x)),
        "ours_module": torch.no_grad()(lambda: ours(x)),
        "torch_step": torch_step,
        "ours_step": ours_step,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cudnn.benchmark = True
    rows: list[dict[str, Any]] = []
    for shape, channels_last in (((1, 8, 4, 8), True), ((1, 8, 4, 8), False), ((16, 16, 16, 16), True)):
        fns = variants(device, shape, channels_last)
        for fn in fns.values():  # plans built, caches warm
            for _ in range(20):
                fn()
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                samples[name].append(per_call_us(fn, args.calls, device))
        row: dict[str, Any] = {"shape": "x".join(map(str, shape)), "layout": "channels_last" if channels_last else "nchw"}
        row.update({f"{name}_us": statistics.median(values) for name, values in samples.items()})
        rows.append(row)
    print_table(
        rows,
        [("shape", "shape", "s"), ("layout", "layout", "s")]
        + [(name, f"{name}_us", ".1f") for name in ("torch_conv2d", "ours", "torch_conv2d_grad", "ours_grad",
                                                      "torch_aten_convolution", "torch_module", "ours_module",
                                                      "torch_step", "ours_step")],
    )
    results = {"schema": SCHEMA, "environment": environment(), "device": device, "calls": args.calls,
               "repeats": args.repeats, "rows": rows}
    print(f"wrote {write_json(results, args.out, NAME)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
