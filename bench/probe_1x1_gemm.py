"""Probe: 1x1 convolutions (+ bias + activation) as one matrix multiply, against our op and nn.Conv2d's cuDNN call.

A channels_last 1x1 convolution with stride 1, no padding and one group is a GEMM: ``x`` viewed as [N*H*W, C] times
the weight viewed as [K, C] transposed gives the output viewed as [N*H*W, K], already channels_last. cuBLASLt adds the
bias (``torch.addmm``) and, for relu and tanh-approximated gelu, the activation (``torch._addmm_activation``) in the
GEMM's epilogue. Compiled nn.Conv2d measured faster than every cuDNN route of ours on the strict-fp32 1x1 rows of
``forward_gelu`` (its convolution ran as a matmul), so this measures, per shape, mode and activation:

==============  ====================================================================================================
ours            ``torch.ops.convbias.forward(x, w, b, ..., activation)`` (cudnn.benchmark on: its timed choice)
cudnn           ``F.conv2d(x, w, b)`` then the activation: nn.Conv2d + the activation module, eager
mm              ``torch.addmm(b, x2d, w2d.t())`` then the activation (cuBLASLt's bias epilogue)
mm_epilogue     ``torch._addmm_activation(b, x2d, w2d.t(), use_gelu)``: bias and relu / gelu-tanh in the epilogue
==============  ====================================================================================================

Each variant is captured in a CUDA graph (``common.capture_replay``: the GPU work alone) and timed back to back and
per call, interleaved; every output is checked against float64 (a matmul in float64 of the same rounded inputs).
Run on a GPU: ``python -m bench.probe_1x1_gemm [--modes fp32 tf32 bf16] [--out DIR]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from . import harness
from .common import (
    add_timing_arguments,
    capture_replay,
    check_against_float64,
    environment,
    geomean,
    mode_flags,
    modes,
    short_error,
    time_back_to_back,
    time_side_by_side,
    write_json,
)

NAME = "gemm_1x1"
# The activations cuBLASLt can apply in a GEMM's epilogue (torch._addmm_activation), and identity.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda t: t,
    "relu": torch.relu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def one_by_one_shapes() -> list[harness.Shape]:
    """The suites' 1x1, stride-1, unpadded convolutions, each once."""
    shapes = [s for s in (*harness.ACTIVATION_SUITE, *harness.SUITE) if (s.kernel, s.stride, s.pad) == (1, 1, 0)]
    return list(dict.fromkeys(shapes))


def as_matrices(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, C, H, W] channels_last as [N*H*W, C] and w [K, C, 1, 1] as [K, C], both views (no copy)."""
    n, c, h, wd = x.shape
    return x.permute(0, 2, 3, 1).reshape(n * h * wd, c), w.reshape(w.shape[0], c)


def from_matrix(y2d: torch.Tensor, n: int, h: int, w: int) -> torch.Tensor:
    """[N*H*W, K] back to the [N, K, H, W] channels_last output (a view)."""
    return y2d.view(n, h, w, y2d.shape[1]).permute(0, 3, 1, 2)


def variants(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, activation: str) -> dict[str, Callable[[], torch.Tensor]]:
    """The ways to compute act(conv1x1(x, w) + b), each returning [N, K, H, W] channels_last."""
    n, _, h, wd = x.shape
    act = ACTIVATIONS[activation]
    x2d, w2d = as_matrices(x, w)
    fns: dict[str, Callable[[], torch.Tensor]] = {
        "ours": lambda: torch.ops.convbias.forward(x, w, b, [1, 1], [0, 0], [1, 1], 1, activation, 0.0),
        "cudnn": lambda: act(F.conv2d(x, w, b)),
        "mm": lambda: from_matrix(act(torch.addmm(b, x2d, w2d.t())), n, h, wd),
    }
    # cuBLASLt's GELU epilogue is the tanh approximation; on the CPU _addmm_activation applies erf's gelu instead.
    if activation == "relu" or (activation == "gelu_tanh" and x.is_cuda):
        use_gelu = activation == "gelu_tanh"
        fns["mm_epilogue"] = lambda: from_matrix(torch._addmm_activation(b, x2d, w2d.t(), use_gelu=use_gelu), n, h, wd)
    return fns


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, activation: str) -> torch.Tensor:
    """float64 act(x2d @ w2d^T + b) of the same rounded inputs, as [N, K, H, W]."""
    n, _, h, wd = x.shape
    x2d, w2d = as_matrices(x.double(), w.double())
    return from_matrix(ACTIVATIONS[activation](x2d @ w2d.t() + b.double()), n, h, wd)


def measure_row(shape: harness.Shape, mode_name: str, activation: str, args: argparse.Namespace) -> dict[str, Any]:
    mode = modes()[mode_name]
    row: dict[str, Any] = {"mode": mode_name, "label": shape.label, "activation": activation, "status": "ok"}
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    x = torch.randn(shape.n, shape.c, shape.h, shape.w, device=args.device, generator=generator).to(mode.dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    w = (torch.randn(shape.k, shape.c, 1, 1, device=args.device, generator=generator) / shape.c**0.5).to(mode.dtype)
    w = w.contiguous(memory_format=torch.channels_last)
    b = torch.randn(shape.k, device=args.device, generator=generator).to(mode.dtype)
    with mode_flags(mode, cudnn_benchmark=True):
        fns = variants(x, w, b, activation)
        want = reference(x, w, b, activation)
        row["numerics"] = {name: check_against_float64(fn(), want, mode, terms=shape.c) for name, fn in fns.items()}
        row["layout_kept"] = {n: fn().is_contiguous(memory_format=torch.channels_last) for n, fn in fns.items()}
        del want
        if args.device == "cuda":
            fns = {name: capture_replay(fn) for name, fn in fns.items()}
        stream = time_back_to_back(fns, args.calls, args.repeats, args.device)
        per_call = time_side_by_side(fns, args.warmup, args.iters, args.device)
    for name in fns:
        row[f"{name}_ms"] = stream[name]["median_ms"]
        row[f"{name}_call_ms"] = per_call[name]["median_ms"]
    best_mm = min(row[f"{name}_ms"] for name in fns if name.startswith("mm"))
    row["ours_over_best_mm"] = row["ours_ms"] / best_mm  # > 1: the GEMM route is faster than ours
    row["cudnn_over_best_mm"] = row["cudnn_ms"] / best_mm
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probe_1x1_gemm", description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["fp32", "tf32", "bf16"], choices=list(modes()))
    parser.add_argument("--activations", nargs="+", default=list(ACTIVATIONS), choices=list(ACTIVATIONS))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    add_timing_arguments(parser, warmup=3, iters=20, calls=10, repeats=5)
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("probe_1x1_gemm: needs a CUDA GPU (--device cpu checks the script)")
        return 2
    import torch_convbias  # noqa: F401 - registers torch.ops.convbias

    shapes = one_by_one_shapes()
    if args.device == "cpu":  # the script's logic only: small problems
        shapes = [harness.Shape(2, s.c, 4, 4, s.k, 1, 1, 0) for s in shapes[:1]]
    results: dict[str, Any] = {"environment": environment(), "config": vars(args), "rows": []}
    for mode_name in args.modes:
        for shape in shapes:
            for activation in args.activations:
                try:
                    row = measure_row(shape, mode_name, activation, args)
                except Exception as error:  # noqa: BLE001 - recorded; the other rows still run
                    row = {"mode": mode_name, "label": shape.label, "activation": activation, "status": "failed",
                           "error": short_error(error)}
                results["rows"].append(row)
                write_json(results, args.out, NAME)
                print(f"{mode_name:4} {shape.label:30} {activation:9} {row['status']}: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_ms"))
                      + f"; ours / best mm {row.get('ours_over_best_mm', float('nan')):.2f}", flush=True)
    ok = [r for r in results["rows"] if r["status"] == "ok"]
    results["summary"] = {
        mode: {"geomean_ours_over_best_mm": geomean(r["ours_over_best_mm"] for r in ok if r["mode"] == mode),
               "numerics_failures": [f"{r['label']} {r['activation']} {name}" for r in ok if r["mode"] == mode
                                     for name, check in r["numerics"].items() if not check["passed"]]}
        for mode in args.modes
    }
    path = write_json(results, args.out, NAME)
    print(f"summary {results['summary']}\nresults: {path}")
    return 0 if len(ok) == len(results["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
