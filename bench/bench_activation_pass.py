"""Activation-pass benchmark: the pass that applies the activation after a cuDNN graph without it in its epilogue,
ours against ATen's, beside a copy of the same bytes.

================  ==================================================================================================
graph             ``torch.ops.convbias._activation_pass(z, act, slope, "graph")``: what the forward runs after the
                  fused conv+bias graph (float16 / bfloat16: our pass with the cheaper float math of
                  ``csrc/cuda/activation_math.cuh``; float32: ATen's kernel)
aten              ``torch.ops.convbias._activation_pass(z, act, slope, "aten")``: ATen's kernel (``F.gelu`` ...),
                  what nn.Conv2d + the activation module runs
fast, exact       ``_activation_pass(z, act, slope, "fast" | "exact")`` (16-bit dtypes): our pass with the cheaper
                  float math, or with ATen's float formulas: which math pays, per activation
copy              ``z.clone()``: the simplest pass over the same bytes (read z, write a new tensor)
================  ==================================================================================================

On channels_last tensors of the suite's large convolution outputs (``--min-mib``, default 128 MiB), per dtype and
activation. ``<variant>_ms`` is the time per call of calls queued back to back (``common.time_back_to_back``: the
GPU's throughput), ``<variant>_vs_copy`` = copy time / variant time (1.0: the pass moves its bytes as fast as a
copy), ``graph_over_aten`` = aten time / graph time. Per-call event times (interleaved) are recorded beside them.
Why it exists: ATen's 16-bit GELU pass measured at 0.75-0.78 of a copy on the H200 (its ``erff`` makes it
arithmetic-bound), and after a cuDNN graph whose GELU epilogue measures slower, that pass is half of the forward's
traffic. Run from the repository root on a GPU: ``python -m bench.bench_activation_pass``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import harness
from .common import add_timing_arguments, environment, geomean, print_table, time_back_to_back, time_side_by_side, write_json

NAME = "activation_pass"
SCHEMA = "torch_convbias.bench_activation_pass/1"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# name -> (the op's activation name, negative_slope, float64 reference)
ACTIVATIONS: dict[str, tuple[str, float, Callable[[torch.Tensor], torch.Tensor]]] = {
    "relu": ("relu", 0.0, torch.relu),
    "leaky_relu": ("leaky_relu", 0.01, lambda t: torch.nn.functional.leaky_relu(t, 0.01)),
    "gelu": ("gelu", 0.0, torch.nn.functional.gelu),
    "gelu_tanh": ("gelu_tanh", 0.0, lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
    "silu": ("silu", 0.0, torch.nn.functional.silu),
    "sigmoid": ("sigmoid", 0.0, torch.sigmoid),
    "tanh": ("tanh", 0.0, torch.tanh),
}
VARIANTS = ("graph", "aten", "fast", "exact", "copy")


def variants(z: torch.Tensor, name: str) -> dict[str, Callable[[], torch.Tensor]]:
    """The passes over z, each returning a new tensor (fast / exact: 16-bit dtypes only)."""
    activation, slope, _ = ACTIVATIONS[name]
    op = torch.ops.convbias._activation_pass
    ways = ("graph", "aten", "fast", "exact") if z.element_size() == 2 else ("graph", "aten")
    return {**{way: (lambda way=way: op(z, activation, slope, way)) for way in ways}, "copy": lambda: z.clone()}


def large_outputs(min_bytes: int, dtype: torch.dtype) -> Iterator[tuple[int, int, int, int]]:
    """N x K x Ho x Wo of every distinct convolution output of the suite of at least min_bytes in `dtype`."""
    seen: set[tuple[int, int, int, int]] = set()
    size = torch.empty((), dtype=dtype).element_size()
    for shape in harness.SUITE:
        dims = (shape.n, shape.k, *shape.out_hw)
        if dims not in seen and shape.n * shape.k * dims[2] * dims[3] * size >= min_bytes:
            seen.add(dims)
            yield dims


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for dims in large_outputs(args.min_mib << 20, dtype):
            generator = torch.Generator(device="cuda").manual_seed(0)
            # N(0, 3): the range where the activations' curvature is (and their tails) in one tensor.
            z = (3 * torch.randn(dims, device="cuda", generator=generator)).to(dtype)
            z = z.contiguous(memory_format=torch.channels_last)
            for name in args.activations:
                fns = variants(z, name)
                stream = time_back_to_back(fns, args.calls, args.repeats, "cuda")
                per_call = time_side_by_side(fns, args.warmup, args.iters, "cuda")
                row: dict[str, Any] = {"dtype": dtype_name, "activation": name, "shape": list(dims),
                                       "bytes_moved": 2 * z.numel() * z.element_size()}
                for variant in fns:
                    row[f"{variant}_ms"] = stream[variant]["median_ms"]
                    row[f"{variant}_call_ms"] = per_call[variant]["median_ms"]
                for variant in fns:
                    if variant != "copy":
                        row[f"{variant}_vs_copy"] = row["copy_ms"] / row[f"{variant}_ms"]
                row["graph_over_aten"] = row["aten_ms"] / row["graph_ms"]
                # Largest error in units of the dtype's spacing at the float64 result (tests bound it per value).
                want = ACTIVATIONS[name][2](z.double())
                spacing = torch.finfo(dtype).eps * want.abs().clamp_min(torch.finfo(dtype).tiny)
                row["max_error_in_eps"] = {
                    v: ((fns[v]().double() - want).abs() / spacing).max().item() for v in fns if v != "copy"
                }
                row["layout_kept"] = fns["graph"]().is_contiguous(memory_format=torch.channels_last)
                rows.append(row)
            del z
    return rows


def summarize_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per dtype and activation: the geomean and the smallest of graph_over_aten and of each pass's copy ratio."""
    summary = []
    for key in sorted({(r["dtype"], r["activation"]) for r in rows}):
        mine = [r for r in rows if (r["dtype"], r["activation"]) == key]
        entry: dict[str, Any] = {"dtype": key[0], "activation": key[1], "shapes": len(mine)}
        for field in ("graph_over_aten", "graph_vs_copy", "aten_vs_copy", "fast_vs_copy", "exact_vs_copy"):
            if all(field in r for r in mine):
                entry[f"geomean_{field}"] = geomean(r[field] for r in mine)
                entry[f"min_{field}"] = min(r[field] for r in mine)
        summary.append(entry)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--activations", nargs="+", default=list(ACTIVATIONS), choices=list(ACTIVATIONS))
    parser.add_argument("--min-mib", type=int, default=128, help="smallest tensor measured (MiB)")
    add_timing_arguments(parser, warmup=5, iters=30, calls=20, repeats=7)
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_activation_pass: needs a CUDA GPU")
        return 2
    import torch_convbias  # noqa: F401 - registers torch.ops.convbias

    rows = measure(args)
    columns = [("dtype", "dtype", "s"), ("act", "activation", "s"), ("shape", "shape", "")]
    for variant in VARIANTS:
        columns.append((f"{variant}_ms", f"{variant}_ms", ".4f"))
    columns += [(f"{v}/copy", f"{v}_vs_copy", ".2f") for v in VARIANTS if v != "copy"]
    columns.append(("graph_over_aten", "graph_over_aten", ".2f"))
    print_table([{**r, "shape": "x".join(map(str, r["shape"]))} for r in rows], columns)
    summary = summarize_rows(rows)
    for s in summary:
        ours = "".join(f", {v} {s[f'min_{v}_vs_copy']:.2f}" for v in ("fast", "exact") if f"min_{v}_vs_copy" in s)
        print(f"{s['dtype']:5} {s['activation']:10} ours over ATen geomean {s['geomean_graph_over_aten']:.2f}x "
              f"(min {s['min_graph_over_aten']:.2f}); of a copy (min): graph {s['min_graph_vs_copy']:.2f}, "
              f"ATen {s['min_aten_vs_copy']:.2f}{ours}")
    results = {"schema": SCHEMA, "environment": environment(), "config": vars(args), "rows": rows, "summary": summary}
    path = write_json(results, args.out, NAME)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
