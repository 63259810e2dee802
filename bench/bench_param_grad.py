"""Parameter-gradient benchmark: ``convbias::param_grad`` against PyTorch's weight and bias gradients.

The input does not require grad (layer-wise training), so only grad_weight and grad_bias are computed. For every
numeric mode and shape of the forward suite (``bench_forward.SUITE``), on the same channels_last tensors, six
variants run interleaved in one timing loop:

================  ==============================================================================================
ours              ``torch.ops.convbias.param_grad(grad_output, x, w, stride, pad, dil, 1, [True, True])``
torch             ``torch.ops.aten.convolution_backward(grad_output, x, w, [K], stride, pad, dil, False, [0, 0],
                  1, [False, True, True])``: exactly the call autograd makes in nn.Conv2d's backward when the
                  input does not require grad (ConvolutionBackward0); the baseline
torch_autograd    ``torch.autograd.grad(out, [weight, bias], grad_output, retain_graph=True)`` through an
                  ``nn.Conv2d`` graph built once: the same ATen call plus the autograd engine's overhead, without
                  the forward (rebuilding the graph every iteration would time the forward too)
ours_autograd     the same through ``torch_convbias.ConvBias2d`` (our registered backward -> param_grad)
ours_bias_only    ``param_grad`` with output_mask ``[False, True]``: the bias gradient alone
torch_bias_only   ``grad_output.sum((0, 2, 3), dtype=torch.float32)``
================  ==============================================================================================

Ratios: ``speedup = torch / ours`` (the targets: geomean >= 1.3 bf16, >= 1.1 tf32, no shape below 1.0x),
``speedup_vs_autograd = torch_autograd / ours``, ``autograd_speedup = torch_autograd / ours_autograd``,
``bias_only_speedup = torch_bias_only / ours_bias_only``. ``speedup_back_to_back``: ``torch`` / ``ours`` with each
queued back to back (``harness.time_throughput``), the rate a training loop gets: per-call events with the variants
interleaved also count launch latency wherever a host-heavy neighbour (the autograd variants) left the GPU idle,
which moves sub-0.3 ms rows by up to 20% between runs.

The bias gradient is a pure read of grad_output, so it is also reported as bandwidth: bytes of grad_output / time,
and that as a fraction of the device's copy bandwidth (``dst.copy_(src)`` of a 2 GiB tensor, (read + write bytes)
/ time, measured once per run). Target: >= 0.8 on grad_outputs of at least 128 MiB; smaller ones can partly sit in
L2 after the other variants and launch overhead weighs more, so their figures are recorded but not judged.

Numerics (recorded, not fatal): ours against torch for grad_weight and grad_bias, and ours_bias_only against
torch_bias_only, with the mode's tolerance and atol scaled by max|reference| (weight gradients sum over N*H*W, so
their magnitude and rounding grow with the problem). Run from the repository root:
``python -m bench.bench_param_grad``.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import torch_convbias

from . import harness
from .common import (
    Mode,
    check_against_float64,
    fmt,
    free_memory,
    geomean,
    short_error,
    time_cuda,
    verdict,
)

NAME = "param_grad"
SCHEMA = "torch_convbias.bench_param_grad/1"

# Geometric-mean speedup (torch / ours) goals per mode; fp32 and fp16 have none. No shape below 1.0x in any mode.
TARGETS: dict[str, float] = {"bf16": 1.3, "tf32": 1.1}

# Bias-gradient bandwidth goal (fraction of copy bandwidth) and the grad_output size from which it applies.
BIAS_BW_TARGET = 0.8
BIAS_LARGE_BYTES = 128 * 2**20

# Copy-bandwidth probe: 2 GiB (far beyond L2) on the GPU; on the CPU only the logic is tested, so keep it small.
COPY_BYTES = {"cuda": 2 * 2**30, "cpu": 32 * 2**20}

VARIANTS: dict[str, str] = {
    "ours": "torch.ops.convbias.param_grad(grad_output, x, w, stride, padding, dilation, 1, [True, True])",
    "torch": (
        "torch.ops.aten.convolution_backward(grad_output, x, w, [K], stride, padding, dilation, False, [0, 0], 1, "
        "[False, True, True]) -- the call nn.Conv2d's autograd (ConvolutionBackward0) makes for an input that does "
        "not require grad"
    ),
    "torch_autograd": (
        "torch.autograd.grad(out, [weight, bias], grad_output, retain_graph=True) on an nn.Conv2d graph built once "
        "(forward not timed; autograd engine overhead included)"
    ),
    "ours_autograd": "the same through torch_convbias.ConvBias2d (registered backward -> convbias::param_grad)",
    "ours_bias_only": "torch.ops.convbias.param_grad(..., [False, True])",
    "torch_bias_only": "grad_output.sum((0, 2, 3), dtype=torch.float32)",
}

RATIOS: dict[str, tuple[str, str]] = {
    "speedup": ("torch", "ours"),
    "speedup_vs_autograd": ("torch_autograd", "ours"),
    "autograd_speedup": ("torch_autograd", "ours_autograd"),
    "bias_only_speedup": ("torch_bias_only", "ours_bias_only"),
}

ROW_FIELDS = (
    "back_to_back",
    "speedup_back_to_back",
    "tflops_ours",
    "tflops_torch",
    "grad_output_bytes",
    "bias_large",
    "bias_gbps_ours",
    "bias_gbps_torch",
    "bias_bw_fraction_ours",
    "bias_bw_fraction_torch",
    "bias_stream_fraction_ours",
    "bias_stream_fraction_torch",
    "grad_weight_channels_last",
    "first_call_ms",
    "plan_cache",
    "explain",
)

TABLE: list[tuple[str, str, str]] = [
    ("shape", "label", ""),
    ("ours", "ours", ".3f"),
    ("torch", "torch", ".3f"),
    ("t_autograd", "torch_autograd", ".3f"),
    ("o_autograd", "ours_autograd", ".3f"),
    ("o_bias", "ours_bias_only", ".3f"),
    ("t_bias", "torch_bias_only", ".3f"),
    ("speedup", "speedup", ".2f"),
    ("vs_autograd", "speedup_vs_autograd", ".2f"),
    ("autograd", "autograd_speedup", ".2f"),
    ("b2b_spd", "speedup_back_to_back", ".2f"),
    ("bias_GB/s", "bias_gbps_ours", ".0f"),
    ("bias/copy", "bias_bw_fraction_ours", ".2f"),
    ("t_bias/copy", "bias_bw_fraction_torch", ".2f"),
    ("1st_ms", "first_call_ms", ".1f"),
    *harness.VERDICT_COLUMNS,
    ("wgrad", "wgrad", ""),
    ("bias_way", "bias_way", ""),
]


# --------------------------------------------------------------------------------------------------------------
# One problem: its tensors, graphs and variants


@dataclass
class Problem:
    """All tensors of one (shape, mode): channels_last x, w, grad_output, and both autograd graphs built once."""

    x: torch.Tensor
    w: torch.Tensor
    grad_output: torch.Tensor
    stride: list[int]
    padding: list[int]
    dilation: list[int]
    torch_out: torch.Tensor  # nn.Conv2d(x): root of the retained graph
    torch_params: tuple[torch.Tensor, torch.Tensor]
    ours_out: torch.Tensor  # ConvBias2d(x), same parameters' values
    ours_params: tuple[torch.Tensor, torch.Tensor]

    def run_ours(self, mask: list[bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        args = (self.grad_output, self.x, self.w, self.stride, self.padding, self.dilation, 1, mask)
        return torch.ops.convbias.param_grad(*args)

    def run_torch(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        return torch.ops.aten.convolution_backward(
            self.grad_output, self.x, self.w, [self.w.shape[0]], self.stride, self.padding, self.dilation,
            False, [0, 0], 1, [False, True, True],
        )  # fmt: skip

    def variants(self) -> dict[str, Callable[[], object]]:
        go = self.grad_output
        return {
            "ours": lambda: self.run_ours([True, True]),
            "torch": self.run_torch,
            "torch_autograd": lambda: torch.autograd.grad(self.torch_out, self.torch_params, go, retain_graph=True),
            "ours_autograd": lambda: torch.autograd.grad(self.ours_out, self.ours_params, go, retain_graph=True),
            "ours_bias_only": lambda: self.run_ours([False, True]),
            "torch_bias_only": lambda: go.sum((0, 2, 3), dtype=torch.float32),
        }


def make_problem(shape: harness.Shape, mode: Mode, device: str, seed: int) -> Problem:
    """Input and grad_output ~ N(0, 1), parameters from nn.Conv2d's initialisation, everything channels_last.

    Only the parameters require grad, as in layer-wise training; the direct op calls use detached views of them,
    so they build no graph.
    """
    torch.manual_seed(seed)
    conv = nn.Conv2d(
        shape.c, shape.k, shape.kernel, shape.stride, shape.pad, bias=True, device=device, dtype=mode.dtype
    ).to(memory_format=torch.channels_last)
    ours = torch_convbias.ConvBias2d.from_conv(copy.deepcopy(conv))
    x = torch.randn(shape.n, shape.c, shape.h, shape.w, device=device, dtype=mode.dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    torch_out, ours_out = conv(x), ours(x)
    grad_output = torch.randn(torch_out.shape, device=device, dtype=mode.dtype)
    assert conv.bias is not None and ours.bias is not None  # built with bias=True; narrows Optional for mypy
    return Problem(
        x=x,
        w=conv.weight.detach(),
        grad_output=grad_output.contiguous(memory_format=torch.channels_last),
        stride=[shape.stride] * 2,
        padding=[shape.pad] * 2,
        dilation=[1, 1],
        torch_out=torch_out,
        torch_params=(conv.weight, conv.bias),
        ours_out=ours_out,
        ours_params=(ours.weight, ours.bias),
    )


# --------------------------------------------------------------------------------------------------------------
# Bandwidth


def grad_output_bytes(shape: harness.Shape, dtype: torch.dtype) -> int:
    """Bytes the bias gradient has to read: all of grad_output."""
    ho, wo = shape.out_hw
    return shape.n * shape.k * ho * wo * torch.empty((), dtype=dtype).element_size()


def _time_copy(nbytes: int, device: str, warmup: int, iters: int) -> dict[str, Any]:
    """Median time of copying ``nbytes`` (the tensors are freed on return)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return time_cuda(lambda: dst.copy_(src), warmup, iters, device)


def measure_copy_bandwidth(device: str, warmup: int, iters: int) -> dict[str, Any]:
    """The device's copy bandwidth, ``dst.copy_(src)``: (read + write bytes) / median time, in GB/s (1e9).

    The reference the bias gradient's read bandwidth is compared with. Failures (OOM) are recorded, not raised.
    """
    nbytes = COPY_BYTES[device]
    record: dict[str, Any] = {"bytes": nbytes, "definition": "dst.copy_(src), float32: 2 * bytes / median time"}
    try:
        timing = _time_copy(nbytes, device, warmup, iters)
        record.update(timing=timing, gbps=2 * nbytes / timing["median_ms"] / 1e6, error=None)
    except Exception as error:  # noqa: BLE001 - OOM included: fractions are then null, the rest still runs
        record.update(timing=None, gbps=None, error=short_error(error))
    free_memory(device)
    return record


def _gbps(nbytes: int, timing: dict[str, Any] | None) -> float | None:
    return nbytes / timing["median_ms"] / 1e6 if timing and timing["median_ms"] > 0 else None


def _fraction(gbps: float | None, copy_gbps: float | None) -> float | None:
    return gbps / copy_gbps if gbps is not None and copy_gbps else None


def bandwidth_fields(
    shape: harness.Shape,
    mode: Mode,
    timings: dict[str, dict[str, Any]],
    stream: dict[str, dict[str, Any]],
    copy_gbps: float | None,
) -> dict[str, Any]:
    """Bias-gradient read bandwidth as a fraction of copy bandwidth: from the per-call medians (``timings``) and
    from calls queued back to back (``stream``, ``common.time_back_to_back``: without launch latency)."""
    nbytes = grad_output_bytes(shape, mode.dtype)
    ours, theirs = _gbps(nbytes, timings.get("ours_bias_only")), _gbps(nbytes, timings.get("torch_bias_only"))
    return {
        "grad_output_bytes": nbytes,
        "bias_large": nbytes >= BIAS_LARGE_BYTES,
        "bias_gbps_ours": ours,
        "bias_gbps_torch": theirs,
        "bias_bw_fraction_ours": _fraction(ours, copy_gbps),
        "bias_bw_fraction_torch": _fraction(theirs, copy_gbps),
        "bias_stream_fraction_ours": _fraction(_gbps(nbytes, stream.get("ours_bias_only")), copy_gbps),
        "bias_stream_fraction_torch": _fraction(_gbps(nbytes, stream.get("torch_bias_only")), copy_gbps),
    }


# --------------------------------------------------------------------------------------------------------------
# Measurement of one shape


def check(problem: Problem, ours: tuple[torch.Tensor, torch.Tensor], mode: Mode) -> dict[str, Any]:
    """Every variant's gradients against float64 ones from the same (rounded) tensors: relative RMS error within
    the mode's bound (common.check_against_float64)."""
    args = (problem.stride, problem.padding, problem.dilation, False, [0, 0], 1, [False, True, True])
    go, x, w = problem.grad_output.double(), problem.x.double(), problem.w.double()
    _, ref_weight, ref_bias = torch.ops.aten.convolution_backward(go, x, w, [w.shape[0]], *args)
    terms = go.shape[0] * go.shape[2] * go.shape[3]  # the gradients sum over N * H_out * W_out positions
    outputs = {}
    for name, fn in problem.variants().items():
        if name == "ours":
            continue
        try:
            outputs[name] = fn()
        except Exception:  # noqa: BLE001 - a variant that fails to run is reported by the timing probe, not here
            continue
    checks = {"ours_grad_weight": check_against_float64(ours[0], ref_weight, mode, terms),
              "ours_grad_bias": check_against_float64(ours[1], ref_bias, mode, terms)}  # fmt: skip
    for name, result in outputs.items():
        if name.endswith("bias_only"):
            grad_bias = result[1] if isinstance(result, tuple) else result
            checks[f"{name}_grad_bias"] = check_against_float64(grad_bias, ref_bias, mode, terms)
        else:
            grad_weight, grad_bias = result[-2], result[-1]
            checks[f"{name}_grad_weight"] = check_against_float64(grad_weight, ref_weight, mode, terms)
            checks[f"{name}_grad_bias"] = check_against_float64(grad_bias, ref_bias, mode, terms)
    return harness.check_all(checks)


def explain(problem: Problem) -> dict[str, Any] | None:
    """torch_convbias.explain_param_grad() for the problem (weight-gradient path, engine, graph_ms / aten_ms, bias
    way and launch), None where the API is absent, {"error": ...} where it fails."""
    fn = getattr(torch_convbias, "explain_param_grad", None)
    if fn is None:
        return None
    try:
        return fn(problem.grad_output, problem.x, problem.w, problem.stride, problem.padding, problem.dilation)
    except Exception as error:  # noqa: BLE001 - recorded in the row, the timings still run
        return {"error": short_error(error)}


def display_explain(row: dict[str, Any]) -> dict[str, Any]:
    """The table's wgrad column (path, and graph / ATen ms where both were measured) and bias_way column."""
    info = row.get("explain") or {}
    weight_grad, bias_grad = info.get("weight_grad") or {}, info.get("bias_grad") or {}
    wgrad = weight_grad.get("path") or info.get("error")
    if weight_grad.get("graph_ms", -1) > 0 and weight_grad.get("aten_ms", -1) > 0:
        wgrad = f"{wgrad} ({weight_grad['graph_ms']:.3f} vs aten {weight_grad['aten_ms']:.3f})"
    launch = bias_grad.get("launch")
    bias_way = bias_grad.get("way")
    if launch:
        bands = "c" if launch.get("bands") == "contiguous" else ""
        bias_way = f"{bias_way} {launch['blocks_per_sm']}x{launch['loads_in_flight']}{bands}"
    return {"wgrad": wgrad, "bias_way": bias_way}


def measure(
    shape: harness.Shape, mode: Mode, device: str, warmup: int, iters: int, seed: int, copy_gbps: float | None
) -> dict[str, Any]:
    """Cold first call of ours, numerics, then all variants side by side."""
    problem = make_problem(shape, mode, device, seed)
    variants = problem.variants()
    cold, grads = harness.cold_call(variants["ours"], device)
    info = explain(problem)
    errors: dict[str, str] = {}
    numerics = None
    channels_last = None
    if grads is None:
        errors["ours"] = cold.get("error", "failed")
    else:
        channels_last = grads[0].is_contiguous(memory_format=torch.channels_last)
        numerics = harness.run_checks(lambda: check(problem, grads, mode), errors)
        del grads
    timings = harness.time_variants(variants, errors, warmup, iters, device)
    # Throughput: the two param-grad calls and the two bias-only ones, each queued back to back.
    back_to_back = {name: variants[name] for name in ("ours", "torch", "ours_bias_only", "torch_bias_only")}
    stream = harness.time_throughput(back_to_back, errors, device)
    return {
        "status": "partial" if errors else "ok",
        "variant_errors": errors,
        "timings": timings,
        **harness.ratios(SPEC, timings),
        "back_to_back": stream,
        "speedup_back_to_back": harness.ratio(stream, "torch", "ours"),
        # The weight gradient costs the forward's multiply-adds (Shape.gflop).
        "tflops_ours": harness.tflops(shape, timings.get("ours")),
        "tflops_torch": harness.tflops(shape, timings.get("torch")),
        **bandwidth_fields(shape, mode, timings, stream, copy_gbps),
        "grad_weight_channels_last": channels_last,
        "numerics": numerics,
        "first_call_ms": cold.get("first_call_ms"),
        "plan_cache": cold,
        "explain": info,
    }


# --------------------------------------------------------------------------------------------------------------
# Summary of the bias bandwidth


def _is_large(row: dict[str, Any]) -> bool:
    """Whether the row's grad_output is large enough for the bandwidth target, from its shape and dtype."""
    return grad_output_bytes(harness.Shape(**row["shape"]), getattr(torch, row["dtype"])) >= BIAS_LARGE_BYTES


def summarize_bias(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Bias-gradient bandwidth over the large grad_outputs (size from the shape, so failed rows count as missing)."""
    throughput = harness.ratio_summary(rows, "speedup_back_to_back")
    large = [r for r in rows if _is_large(r)]
    ours = [r["bias_bw_fraction_ours"] for r in large if r["bias_bw_fraction_ours"] is not None]
    theirs = [r["bias_bw_fraction_torch"] for r in large if r["bias_bw_fraction_torch"] is not None]
    stream = [r.get("bias_stream_fraction_ours") for r in large if r.get("bias_stream_fraction_ours") is not None]
    complete = bool(large) and len(ours) == len(large)
    return {
        **throughput,
        "bias_large_shapes": [r["label"] for r in large],
        "bias_bw_fraction_ours_min_large": min(ours, default=None),
        "bias_stream_fraction_ours_min_large": min(stream, default=None),
        "bias_bw_fraction_ours_geomean_large": geomean(ours),
        "bias_bw_fraction_torch_min_large": min(theirs, default=None),
        "geomean_speedup_bias_only_large": geomean(r["bias_only_speedup"] for r in large),
        "target_bias_bw_fraction": BIAS_BW_TARGET,
        # None: no large shape in this run (e.g. --device cpu) or one of them not measured.
        "target_bias_bw_pass": min(ours) >= BIAS_BW_TARGET if complete else None,
        # The same target on calls queued back to back (no launch latency in the figure).
        "target_bias_bw_stream_pass": min(stream) >= BIAS_BW_TARGET if bool(large) and len(stream) == len(large) else None,
    }


def describe_bias(summary: dict[str, Any]) -> str:
    throughput = harness.describe_ratio_summary(summary, "speedup_back_to_back", "calls back to back (torch / ours)")
    if not summary["bias_large_shapes"]:
        return f"{throughput}\n{'':>15}bias grad bandwidth: no grad_output >= {BIAS_LARGE_BYTES >> 20} MiB in this run, no verdict"
    return f"{throughput}\n{'':>15}" + (
        f"bias grad on {len(summary['bias_large_shapes'])} grad_outputs >= {BIAS_LARGE_BYTES >> 20} MiB: "
        f"ours min {fmt(summary['bias_bw_fraction_ours_min_large'])} of copy bandwidth "
        f"(target >= {BIAS_BW_TARGET} {verdict(summary['target_bias_bw_pass'])}), "
        f"torch min {fmt(summary['bias_bw_fraction_torch_min_large'])}; calls back to back: ours min "
        f"{fmt(summary['bias_stream_fraction_ours_min_large'])} ({verdict(summary['target_bias_bw_stream_pass'])})"
    )


SPEC = harness.Spec(
    name=NAME,
    schema=SCHEMA,
    description=__doc__ or "",
    variants=VARIANTS,
    ratios=RATIOS,
    headline="speedup",
    targets=TARGETS,
    row_fields=ROW_FIELDS,
    table=TABLE,
    display_extra=display_explain,
    legend=(
        "speedup: torch / ours; vs_autograd: torch_autograd / ours; autograd: torch_autograd / ours_autograd; "
        "bias/copy: bias-grad read bandwidth / copy bandwidth"
    ),
    config={
        "targets_bias": {"bw_fraction_of_copy": BIAS_BW_TARGET, "min_grad_output_bytes": BIAS_LARGE_BYTES},
        "copy_bytes": COPY_BYTES,
        "input_requires_grad": False,
    },
    summarize_extra=summarize_bias,
    describe_extra=describe_bias,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (0 also when targets are missed: that is a result)."""
    args = harness.parse_args(SPEC, argv)
    copy_bandwidth: dict[str, Any] = {}

    def measure_copy() -> dict[str, Any]:
        # Once per run, after the device warm-up; every row's bandwidth fraction refers to it.
        copy_bandwidth.update(measure_copy_bandwidth(args.device, args.warmup, args.iters))
        print(f"copy bandwidth: {fmt(copy_bandwidth['gbps'], '.0f')} GB/s ({copy_bandwidth['error'] or 'ok'})")
        return {"copy_bandwidth": copy_bandwidth}

    def measure_shape(
        shape: harness.Shape, mode: Mode, device: str, warmup: int, iters: int, seed: int
    ) -> dict[str, Any]:
        return measure(shape, mode, device, warmup, iters, seed, copy_bandwidth.get("gbps"))

    return harness.run(SPEC, args, measure_shape, before=measure_copy)


if __name__ == "__main__":
    sys.exit(main())
