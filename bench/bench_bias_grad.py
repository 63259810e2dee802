"""Bias-gradient benchmark: the three ways of summing grad_output over N, H, W (FP32 accumulation), side by side.

================  ==================================================================================================
kernel            ``torch.ops.convbias._bias_grad(dy, "kernel")``: our column-sum kernel (the default way)
cudnn             ``torch.ops.convbias._bias_grad(dy, "cudnn")``: a cuDNN reduction graph (runtime-compiled engine)
aten              ``torch.ops.convbias._bias_grad(dy, "aten")``: ATen's ``sum(dtype=float32)`` cast back
torch             ``dy.sum((0, 2, 3), dtype=torch.float32)``: what nn.Conv2d's backward runs
================  ==================================================================================================

On the grad_outputs of the forward suite (channels_last, shapes from ``harness.SUITE``), per dtype. Each way's read
bandwidth (bytes of grad_output / time) is reported as a fraction of the copy bandwidth
(``bench_param_grad.measure_copy_bandwidth``); the issue's target is >= 0.8 on grad_outputs of >= 128 MiB. Two
times per way: ``<way>_ms``, the median of per-call CUDA events with the ways interleaved (a call's cost among
others, launch latency included where the GPU waits for the host), and ``<way>_stream_ms``, the time per call of
calls queued back to back (``common.time_back_to_back``: the GPU's throughput, the bandwidth figure); fractions
``<way>_fraction`` and ``<way>_stream_fraction`` follow them. The cold
first call of ``cudnn`` (plan build: NVRTC) and of ``kernel`` (its launch configuration is timed once per shape) is
recorded. Run from the repository root on a GPU: ``python -m bench.bench_bias_grad``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import torch_convbias  # noqa: F401  (registers torch.ops.convbias)

from . import harness
from .bench_param_grad import BIAS_BW_TARGET, BIAS_LARGE_BYTES, measure_copy_bandwidth
from .common import environment, print_table, short_error, time_back_to_back, time_side_by_side, write_json

NAME = "bias_grad"
SCHEMA = "torch_convbias.bench_bias_grad/1"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WAYS = ("kernel", "cudnn", "aten")


def ways(dy: torch.Tensor) -> dict[str, Callable[[], object]]:
    fns: dict[str, Callable[[], object]] = {
        way: (lambda way=way: torch.ops.convbias._bias_grad(dy, way)) for way in WAYS  # type: ignore[misc]
    }
    fns["torch"] = lambda: dy.sum((0, 2, 3), dtype=torch.float32)
    return fns


def cold_ms(fn: Callable[[], object]) -> tuple[float | None, str | None]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - recorded per way
        return None, short_error(error)
    return (time.perf_counter() - start) * 1e3, None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--calls", type=int, default=20, help="calls queued back to back per throughput sample")
    parser.add_argument("--repeats", type=int, default=15, help="throughput samples per way")
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_bias_grad: needs a CUDA GPU")
        return 2
    copy = measure_copy_bandwidth("cuda", args.warmup, args.iters)
    copy_gbps = copy.get("gbps")
    rows: list[dict[str, Any]] = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        seen: set[tuple[int, int, int, int]] = set()
        for shape in harness.SUITE:
            ho, wo = shape.out_hw
            dims = (shape.n, shape.k, ho, wo)
            if dims in seen:
                continue
            seen.add(dims)
            dy = torch.randn(dims, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
            nbytes = dy.numel() * dy.element_size()
            fns = ways(dy)
            row: dict[str, Any] = {"dtype": dtype_name, "grad_output": list(dims), "bytes": nbytes,
                                   "large": nbytes >= BIAS_LARGE_BYTES, "errors": {}}
            for way in ("kernel", "cudnn"):
                row[f"cold_ms_{way}"], error = cold_ms(fns[way])
                if error:
                    row["errors"][way] = error
            runnable = {name: fn for name, fn in fns.items() if name not in row["errors"]}
            timings = time_side_by_side(runnable, args.warmup, args.iters, "cuda")
            row["timings"] = timings
            stream = time_back_to_back(runnable, args.calls, args.repeats, "cuda")
            row["stream_timings"] = stream
            for suffix, measured in (("", timings), ("_stream", stream)):
                for name, timing in measured.items():
                    gbps = nbytes / timing["median_ms"] / 1e6
                    row[f"{name}{suffix}_ms"] = timing["median_ms"]
                    row[f"{name}{suffix}_fraction"] = gbps / copy_gbps if copy_gbps else None
            reference = dy.double().sum((0, 2, 3))
            row["max_rel_error"] = {
                name: ((fn().double() - reference).abs().max() / reference.abs().max().clamp_min(1)).item()
                for name, fn in runnable.items()
            }
            rows.append(row)
            del dy
    columns = [("dtype", "dtype", "s"), ("grad_output", "grad_output", "")]
    for name in (*WAYS, "torch"):
        columns += [
            (f"{name}_ms", f"{name}_ms", ".4f"),
            (f"{name}/copy", f"{name}_fraction", ".2f"),
            (f"{name}/copy_stream", f"{name}_stream_fraction", ".2f"),
        ]
    print_table([{**r, "grad_output": "x".join(map(str, r["grad_output"]))} for r in rows], columns)
    summary: dict[str, Any] = {}
    for name in (*WAYS, "torch"):
        summary[name] = {"large": sum(r["large"] for r in rows)}
        for suffix in ("", "_stream"):
            measured = [r[f"{name}{suffix}_fraction"] for r in rows if r["large"] and r.get(f"{name}{suffix}_fraction")]
            summary[name][f"min{suffix}_fraction_large"] = min(measured, default=None)
            summary[name][f"measured{suffix}_large"] = len(measured)
    summary["target_fraction"] = BIAS_BW_TARGET
    for name in (*WAYS, "torch"):
        s = summary[name]
        print(f"{name:7} min fraction of copy bandwidth on grad_outputs >= {BIAS_LARGE_BYTES >> 20} MiB: "
              f"per call {s['min_fraction_large']}, back to back {s['min_stream_fraction_large']}")
    results = {"schema": SCHEMA, "environment": environment(), "copy_bandwidth": copy, "rows": rows,
               "summary": summary}
    print(f"wrote {write_json(results, args.out, NAME)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
