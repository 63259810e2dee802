"""Bias-gradient benchmark: the three ways of summing grad_output over N, H, W (FP32 accumulation), side by side;
then the activation's backward fused with the bias gradient against the passes it replaces.

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
recorded.

Activation backward (``activation_rows``; ``--activations``, default relu gelu silu), per dtype, grad_output shape
and activation, on channels_last grad_output and saved (the output or the pre-activation):

================  ==================================================================================================
fused             ``torch.ops.convbias._activation_backward(dy, saved, act, slope, True)``: one pass writing dz
                  and summing it into the bias gradient (the fused kernel: explain's way is recorded per row)
two_pass          ATen's activation backward (``aten.threshold_backward``, ``gelu_backward``, ...) then our bias
                  kernel on dz (``_bias_grad(dz, "kernel")``): the backward before the fused kernel
aten              ATen's activation backward then ``dz.sum((0, 2, 3), dtype=torch.float32)``: nn.Conv2d + the
                  activation module in eager mode
copy              ``torch.add(dy, saved, out=dz)``: a plain pass over the same bytes (read 2 tensors, write 1)
================  ==================================================================================================

The fused pass must move 3 x the bytes of grad_output; ``<variant>_fraction`` is (3 x bytes / time) over the copy
bandwidth, and ``fused_vs_copy`` = copy time / fused time (the same bytes through the simplest kernel). The target:
the fused pass at >= 0.8 of copy bandwidth for the bytes it must move (on grad_outputs >= 128 MiB). Run from the
repository root on a GPU: ``python -m bench.bench_bias_grad``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

import torch_convbias

from . import harness
from .bench_param_grad import BIAS_BW_TARGET, BIAS_LARGE_BYTES, measure_copy_bandwidth
from .common import (
    add_timing_arguments,
    environment,
    print_table,
    short_error,
    time_back_to_back,
    time_side_by_side,
    verdict,
    write_json,
)

NAME = "bias_grad"
SCHEMA = "torch_convbias.bench_bias_grad/2"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WAYS = ("kernel", "cudnn", "aten")


def ways(dy: torch.Tensor) -> dict[str, Callable[[], object]]:
    fns: dict[str, Callable[[], object]] = {
        way: (lambda way=way: torch.ops.convbias._bias_grad(dy, way)) for way in WAYS  # type: ignore[misc]
    }
    fns["torch"] = lambda: dy.sum((0, 2, 3), dtype=torch.float32)
    return fns


# name -> (the op's activation, negative_slope, whether the derivative is taken from the output)
ACTIVATIONS: dict[str, tuple[str, float, bool]] = {
    "relu": ("relu", 0.01, True),
    "leaky_relu": ("leaky_relu", 0.01, True),
    "gelu": ("gelu", 0.01, False),
    "gelu_tanh": ("gelu_tanh", 0.01, False),
    "silu": ("silu", 0.01, False),
    "sigmoid": ("sigmoid", 0.01, True),
    "tanh": ("tanh", 0.01, True),
}
ACTIVATION_VARIANTS = ("fused", "two_pass", "aten", "copy")


def aten_activation_backward(dy: torch.Tensor, saved: torch.Tensor, name: str) -> torch.Tensor:
    """dz by ATen's backward kernel of the activation, as autograd of the activation module calls it."""
    activation, slope, from_output = ACTIVATIONS[name]
    aten = torch.ops.aten
    if activation == "relu":
        return aten.threshold_backward(dy, saved, 0)
    if activation == "leaky_relu":
        return aten.leaky_relu_backward(dy, saved, slope, from_output)
    if activation in ("gelu", "gelu_tanh"):
        return aten.gelu_backward(dy, saved, approximate="tanh" if activation == "gelu_tanh" else "none")
    if activation == "silu":
        return aten.silu_backward(dy, saved)
    if activation == "sigmoid":
        return aten.sigmoid_backward(dy, saved)
    return aten.tanh_backward(dy, saved)


def activation_variants(dy: torch.Tensor, saved: torch.Tensor, name: str) -> dict[str, Callable[[], object]]:
    """The variants of the activation-backward table: each returns (dz, grad_bias) but ``copy`` (dz only)."""
    activation, slope, _ = ACTIVATIONS[name]
    out = torch.empty_like(dy)

    def two_pass() -> tuple[torch.Tensor, torch.Tensor]:
        dz = aten_activation_backward(dy, saved, name)
        return dz, torch.ops.convbias._bias_grad(dz, "kernel")

    def aten() -> tuple[torch.Tensor, torch.Tensor]:
        dz = aten_activation_backward(dy, saved, name)
        return dz, dz.sum((0, 2, 3), dtype=torch.float32).to(dz.dtype)

    return {
        "fused": lambda: torch.ops.convbias._activation_backward(dy, saved, activation, slope, True),
        "two_pass": two_pass,
        "aten": aten,
        "copy": lambda: torch.add(dy, saved, out=out),
    }


def activation_inputs(dims: tuple[int, int, int, int], dtype: torch.dtype, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dy, saved, z) on the GPU, channels_last: z the pre-activation, saved what the derivative needs."""
    activation, slope, from_output = ACTIVATIONS[name]
    z = torch.randn(dims, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    dy = torch.randn(dims, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    saved = z
    if from_output:
        functions = {"relu": torch.relu, "leaky_relu": lambda t: torch.nn.functional.leaky_relu(t, slope),
                     "sigmoid": torch.sigmoid, "tanh": torch.tanh}
        saved = functions[activation](z)
    return dy, saved, z


def output_shapes(dtype_names: list[str]) -> Iterator[tuple[str, torch.dtype, tuple[int, int, int, int]]]:
    """(dtype name, dtype, N x K x Ho x Wo) of every distinct convolution output of the suite, per dtype."""
    for dtype_name in dtype_names:
        seen: set[tuple[int, int, int, int]] = set()
        for shape in harness.SUITE:
            dims = (shape.n, shape.k, *shape.out_hw)
            if dims not in seen:
                seen.add(dims)
                yield dtype_name, DTYPES[dtype_name], dims


def activation_rows(args: argparse.Namespace, copy_gbps: float | None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for dtype_name, dtype, dims in output_shapes(args.dtypes):
        for name in args.activations:
            dy, saved, z = activation_inputs(dims, dtype, name)
            nbytes = dy.numel() * dy.element_size()
            activation, slope, _ = ACTIVATIONS[name]
            info = torch_convbias.explain_activation_backward(dy, saved, activation, slope)
            row: dict[str, Any] = {"dtype": dtype_name, "activation": name, "grad_output": list(dims),
                                   "bytes_moved": 3 * nbytes, "large": nbytes >= BIAS_LARGE_BYTES,
                                   "fused_way": info["way"], "fused_launch": info.get("launch"), "errors": {}}
            fns = activation_variants(dy, saved, name)
            row["cold_ms_fused"], error = cold_ms(fns["fused"])
            if error:
                row["errors"]["fused"] = error
            runnable = {v: fn for v, fn in fns.items() if v not in row["errors"]}
            timings = time_side_by_side(runnable, args.warmup, args.iters, "cuda")
            stream = time_back_to_back(runnable, args.calls, args.repeats, "cuda")
            row["timings"], row["stream_timings"] = timings, stream
            for suffix, measured in (("", timings), ("_stream", stream)):
                for variant, timing in measured.items():
                    gbps = 3 * nbytes / timing["median_ms"] / 1e6
                    row[f"{variant}{suffix}_ms"] = timing["median_ms"]
                    row[f"{variant}{suffix}_fraction"] = gbps / copy_gbps if copy_gbps else None
                if "fused" in measured and "copy" in measured:
                    row[f"fused_vs_copy{suffix}"] = measured["copy"]["median_ms"] / measured["fused"]["median_ms"]
            # Numerics against float64 autograd of the same rounded values (the bias gradient; dz checked by the
            # tests): relative to the largest |reference|.
            leaf = z.double().requires_grad_()
            functions = {"relu": torch.relu, "leaky_relu": lambda t: torch.nn.functional.leaky_relu(t, slope),
                         "gelu": torch.nn.functional.gelu,
                         "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
                         "silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}
            (reference_dz,) = torch.autograd.grad(functions[activation](leaf), [leaf], dy.double())
            reference = reference_dz.sum((0, 2, 3))
            del reference_dz, leaf
            row["max_rel_error"] = {
                variant: ((fn()[1].double() - reference).abs().max() / reference.abs().max().clamp_min(1)).item()
                for variant, fn in runnable.items()
                if variant != "copy"
            }
            rows.append(row)
            del dy, saved, z, fns, runnable
    return rows


def activation_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: the smallest fraction of copy bandwidth on large tensors, per call and back to back; the fused
    pass's smallest and median ratio to the copy of the same bytes; the verdict against the target."""
    summary: dict[str, Any] = {"large": sum(r["large"] for r in rows), "target_fraction": BIAS_BW_TARGET}
    for variant in ACTIVATION_VARIANTS:
        for suffix in ("", "_stream"):
            measured = [r[f"{variant}{suffix}_fraction"] for r in rows if r["large"] and r.get(f"{variant}{suffix}_fraction")]
            summary[f"{variant}_min{suffix}_fraction_large"] = min(measured, default=None)
    ratios = sorted(r["fused_vs_copy_stream"] for r in rows if r["large"] and r.get("fused_vs_copy_stream"))
    summary["fused_vs_copy_stream_min_large"] = ratios[0] if ratios else None
    summary["fused_vs_copy_stream_median_large"] = ratios[len(ratios) // 2] if ratios else None
    summary["fused_ran_everywhere"] = all(r["fused_way"] == "fused kernel" for r in rows)
    best = summary["fused_min_stream_fraction_large"]
    summary["target_pass"] = best >= BIAS_BW_TARGET if best is not None else None
    return summary


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
    add_timing_arguments(parser, warmup=10, iters=100, calls=20, repeats=15)
    parser.add_argument("--activations", nargs="*", default=["relu", "gelu", "silu"], choices=list(ACTIVATIONS),
                        help="activations of the fused activation-backward table (none: skip it)")
    parser.add_argument("--only-activations", action="store_true",
                        help="skip the bias-gradient table (its rows and summary are empty in the JSON)")
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_bias_grad: needs a CUDA GPU")
        return 2
    copy = measure_copy_bandwidth("cuda", args.warmup, args.iters)
    copy_gbps = copy.get("gbps")
    rows: list[dict[str, Any]] = []
    for dtype_name, dtype, dims in output_shapes([] if args.only_activations else args.dtypes):
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
    act_rows = activation_rows(args, copy_gbps)
    act_summary = activation_summary(act_rows)
    if act_rows:
        act_columns = [("dtype", "dtype", "s"), ("act", "activation", "s"), ("grad_output", "grad_output", ""),
                       ("way", "fused_way", "s")]
        for name in ACTIVATION_VARIANTS:
            act_columns += [(f"{name}_ms", f"{name}_stream_ms", ".4f"), (f"{name}/copy", f"{name}_stream_fraction", ".2f")]
        act_columns.append(("fused_vs_copy", "fused_vs_copy_stream", ".2f"))
        print_table([{**r, "grad_output": "x".join(map(str, r["grad_output"]))} for r in act_rows], act_columns)
        print(f"fused activation backward on grad_outputs >= {BIAS_LARGE_BYTES >> 20} MiB, back to back: min fraction "
              f"of copy bandwidth {act_summary['fused_min_stream_fraction_large']} (target {BIAS_BW_TARGET}: "
              f"{verdict(act_summary['target_pass'])}), vs a copy of the same bytes min "
              f"{act_summary['fused_vs_copy_stream_min_large']}, fused kernel on every row: "
              f"{act_summary['fused_ran_everywhere']}")
    results = {"schema": SCHEMA, "environment": environment(), "copy_bandwidth": copy, "rows": rows,
               "summary": summary, "activation_rows": act_rows, "activation_summary": act_summary}
    print(f"wrote {write_json(results, args.out, NAME)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
