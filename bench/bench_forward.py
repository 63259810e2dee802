"""Forward benchmark: ``convbias::forward`` (conv + bias) against ``nn.Conv2d``, side by side in one process.

For every numeric mode and shape, six variants run on the same tensors, interleaved in one timing loop:

==================  ============================================================================
ours_cl             ``ConvBias2d`` (the product, as a model calls it; ``from_conv`` of torch_cl's module, so the
                    same parameters), module and input channels_last
ours_nchw           the same on NCHW input and weight
ours_conv_only      the op without bias (channels_last): our conv-only graph
torch_cl            ``nn.Conv2d`` with bias, module and input channels_last (the main baseline)
torch_nchw          ``nn.Conv2d`` on NCHW
torch_conv_only     ``F.conv2d`` without bias, channels_last: PyTorch's cuDNN conv alone
==================  ============================================================================

With ``--activation NAME`` (relu, gelu, silu, ...; issue 13) the block is conv + bias + activation, channels_last,
and the sides are ``ours`` (``ConvBias2d(activation=NAME)``), ``ours_compiled`` (the same under ``torch.compile``),
``torch_eager`` (``nn.Sequential(nn.Conv2d, activation module)``), ``torch_compiled`` (the same under
``torch.compile``: Inductor fuses the bias add with the activation) and, for relu, ``torch_cudnn_relu``
(``torch.cudnn_convolution_relu``, PyTorch's forward-only fused op on the legacy cuDNN API, what an inference user
might pick). Every side is timed per call, back to back and CUDA-graphed (``graphed_*``: the GPU work alone); the
headline is ``graphed_vs_compiled`` = compiled nn / ours, CUDA-graphed (GPU time, as the targets are: ReLU >= 1.5
bf16, >= 1.3 tf32, >= 1.1 fp32), with the per-call ``speedup_vs_compiled`` beside it. Results go to
``forward_<activation>-<gpu>.json``.

Before timing, the first (cold) call of ``ours_cl`` is timed after clearing the plan cache, and its output is
checked against ``torch_cl``. Results go to JSON (and optionally a PNG). Run from the repository root:
``python -m bench.bench_forward``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import torch_convbias

from . import harness
from .common import ACTIVATION_MODULES, Mode, capture_replay, check_against_float64, fmt, gpu_kernels, short_error

# The suite lives in the shared driver; these names stay importable from here.
from .harness import CPU_BATCH, CPU_MAX_HW, QUICK_SUITE, SUITE, Shape  # noqa: F401

NAME = "forward"
SCHEMA = "torch_convbias.bench_forward/1"

VARIANTS: dict[str, str] = {
    "ours_cl": "ConvBias2d (from_conv of the nn.Conv2d below: same parameters), module and input channels_last",
    "ours_nchw": "the same module on NCHW x and weight",
    "ours_conv_only": "the same op without bias, channels_last: our conv-only graph",
    "torch_cl": "nn.Conv2d with bias, module and input channels_last (the main baseline)",
    "torch_nchw": "nn.Conv2d on NCHW",
    "torch_conv_only": "F.conv2d without bias, channels_last: PyTorch's cuDNN conv alone",
}

# ratio name -> (numerator, denominator): medians, so > 1 means the denominator is faster for speedups.
RATIOS: dict[str, tuple[str, str]] = {
    "speedup_cl": ("torch_cl", "ours_cl"),
    "speedup_nchw": ("torch_nchw", "ours_nchw"),
    "fused_over_conv_only": ("ours_cl", "ours_conv_only"),
    "vs_torch_conv_only": ("ours_cl", "torch_conv_only"),
}

# Geometric-mean speedup_cl goals per mode (fp16 has none); every mode also aims at no shape below 1.0x.
TARGETS: dict[str, float] = {"bf16": 1.9, "tf32": 1.7, "fp32": 1.15}

# Row keys besides ratios, in the order of schema /1 (numerics among them).
ROW_FIELDS = (
    "tflops_ours_cl",
    "tflops_torch_cl",
    "numerics",
    "out_channels_last",
    "first_call_ms",
    "plan_cache",
    "explain",
)

TABLE_COLUMNS: list[tuple[str, str, str]] = [
    ("shape", "label", ""),
    ("ours_cl", "ours_cl", ".3f"),
    ("torch_cl", "torch_cl", ".3f"),
    ("ours_nchw", "ours_nchw", ".3f"),
    ("torch_nchw", "torch_nchw", ".3f"),
    ("ours_conv", "ours_conv_only", ".3f"),
    ("torch_conv", "torch_conv_only", ".3f"),
    ("spd_cl", "speedup_cl", ".2f"),
    ("spd_nchw", "speedup_nchw", ".2f"),
    ("fused/conv", "fused_over_conv_only", ".2f"),
    ("vs_t_conv", "vs_torch_conv_only", ".2f"),
    ("1st_ms", "first_call_ms", ".1f"),
    *harness.VERDICT_COLUMNS,
    ("path", "path", ""),
    ("engine", "engine", ""),
]


# --------------------------------------------------------------------------------------------------------------
# One problem: its tensors and variants


@dataclass
class Problem:
    """All tensors of one (shape, mode), created once and shared by the variants."""

    x_cl: torch.Tensor
    x_nchw: torch.Tensor
    w_cl: torch.Tensor
    w_nchw: torch.Tensor
    bias: torch.Tensor
    conv_cl: nn.Conv2d
    conv_nchw: nn.Conv2d
    ours_cl_module: torch_convbias.ConvBias2d  # ConvBias2d.from_conv of conv_cl / conv_nchw: same parameters
    ours_nchw_module: torch_convbias.ConvBias2d
    stride: list[int]
    padding: list[int]
    dilation: list[int]

    def ours(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.convbias.forward(x, w, bias, self.stride, self.padding, self.dilation, 1)

    def variants(self) -> dict[str, Callable[[], torch.Tensor]]:
        return {
            "ours_cl": lambda: self.ours_cl_module(self.x_cl),
            "ours_nchw": lambda: self.ours_nchw_module(self.x_nchw),
            "ours_conv_only": lambda: self.ours(self.x_cl, self.w_cl, None),
            "torch_cl": lambda: self.conv_cl(self.x_cl),
            "torch_nchw": lambda: self.conv_nchw(self.x_nchw),
            "torch_conv_only": lambda: F.conv2d(
                self.x_cl, self.w_cl, None, self.stride, self.padding, self.dilation, 1
            ),
        }


def make_problem(shape: Shape, mode: Mode, device: str, seed: int) -> Problem:
    """Input ~ N(0, 1), weight from nn.Conv2d's own initialisation, bias ~ N(0, 1) (the output's magnitude, so that
    the numerics check sees a dropped bias: nn.Conv2d's init bound 1/sqrt(fan_in) hides under bf16's rounding), both
    layouts of each."""
    torch.manual_seed(seed)
    conv_nchw = nn.Conv2d(
        shape.c, shape.k, shape.kernel, shape.stride, shape.pad, bias=True, device=device, dtype=mode.dtype
    )
    # Plain tensors on both sides: under no_grad requires_grad changes nothing, but keep the inputs identical.
    conv_nchw.requires_grad_(False)
    assert conv_nchw.bias is not None  # built with bias=True; narrows the Optional for the type checker
    conv_nchw.bias.copy_(torch.randn(shape.k, device=device, dtype=mode.dtype))
    conv_cl = copy.deepcopy(conv_nchw).to(memory_format=torch.channels_last)
    x_nchw = torch.randn(shape.n, shape.c, shape.h, shape.w, device=device, dtype=mode.dtype)
    return Problem(
        x_cl=x_nchw.contiguous(memory_format=torch.channels_last),
        x_nchw=x_nchw,
        w_cl=conv_cl.weight,
        w_nchw=conv_nchw.weight,
        bias=conv_nchw.bias,
        conv_cl=conv_cl,
        conv_nchw=conv_nchw,
        ours_cl_module=torch_convbias.ConvBias2d.from_conv(conv_cl),
        ours_nchw_module=torch_convbias.ConvBias2d.from_conv(conv_nchw),
        stride=[shape.stride] * 2,
        padding=[shape.pad] * 2,
        dilation=[1, 1],
    )


# --------------------------------------------------------------------------------------------------------------
# Measurement of one shape


def explain(
    problem: Problem, activation: str = "identity", residual: torch.Tensor | None = None
) -> dict[str, Any] | None:
    """torch_convbias.explain() for ours_cl (path, engine, workspace, with an activation where it runs, with the
    residual how it is added, ...), None where the API is absent."""
    fn = getattr(torch_convbias, "explain", None)
    if fn is None:
        return None
    try:
        result = fn(
            problem.x_cl, problem.w_cl, problem.bias, problem.stride, problem.padding, problem.dilation, 1,
            activation=activation, **({} if residual is None else {"residual": residual}),
        )
        return dict(result) if isinstance(result, dict) else {"value": result}
    except Exception as error:  # noqa: BLE001
        return {"error": short_error(error)}


def references(problem: Problem) -> dict[str, torch.Tensor]:
    """float64 outputs from the problem's own (rounded) tensors: with the bias, and without it for the conv-only
    variants."""
    args = (problem.stride, problem.padding, problem.dilation, 1)
    x, w, b = problem.x_nchw.double(), problem.w_nchw.double(), problem.bias.double()
    return {"with_bias": F.conv2d(x, w, b, *args), "conv_only": F.conv2d(x, w, None, *args)}


def check_outputs(outputs: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], mode: Mode) -> dict[str, Any]:
    """Every variant's output against its float64 reference (common.check_against_float64)."""
    return harness.check_all(
        {
            name: check_against_float64(out, expected["conv_only" if name.endswith("conv_only") else "with_bias"], mode)
            for name, out in outputs.items()
        }
    )


def check_variants(problem: Problem, mode: Mode, errors: dict[str, str]) -> dict[str, Any] | None:
    """Each variant run once and checked; a variant that fails to run lands in ``errors`` (out of memory included)."""
    outputs: dict[str, torch.Tensor] = {}
    for name, fn in problem.variants().items():
        try:
            outputs[name] = fn()
        except Exception as error:  # noqa: BLE001
            errors[name] = short_error(error)
    if not outputs:
        return None
    return check_outputs(outputs, references(problem), mode)


def measure(shape: Shape, mode: Mode, device: str, warmup: int, iters: int, seed: int) -> dict[str, Any]:
    """Everything about one (shape, mode) under the current flags: cold call, explain, numerics, timings."""
    problem = make_problem(shape, mode, device, seed)
    variants = problem.variants()
    cold, ours_out = harness.cold_call(variants["ours_cl"], device)
    errors: dict[str, str] = {}
    numerics: dict[str, Any] | None = None
    out_channels_last: bool | None = None
    if ours_out is None:
        errors["ours_cl"] = cold.get("error", "failed")
    else:
        out_channels_last = ours_out.is_contiguous(memory_format=torch.channels_last)
        del ours_out
        numerics = harness.run_checks(lambda: check_variants(problem, mode, errors), errors)
    info = explain(problem)
    timings = harness.time_variants(variants, errors, warmup, iters, device, called=["ours_cl"])
    return {
        "status": "partial" if errors else "ok",
        "error": None,
        "variant_errors": errors,
        "timings": timings,
        **harness.ratios(SPEC, timings),
        "tflops_ours_cl": harness.tflops(shape, timings.get("ours_cl")),
        "tflops_torch_cl": harness.tflops(shape, timings.get("torch_cl")),
        "numerics": numerics,
        "out_channels_last": out_channels_last,
        "first_call_ms": cold.get("first_call_ms"),
        "plan_cache": cold,
        "explain": info,
    }


# --------------------------------------------------------------------------------------------------------------
# Output


def display_explain(row: dict[str, Any]) -> dict[str, Any]:
    """The table's path and engine columns, from the row's explain() record."""
    info = row["explain"] or {}
    return {"path": info.get("path") or info.get("error"), "engine": info.get("engine")}


def describe_ratios(summary: dict[str, Any]) -> str:
    """The summary line's part after the headline: the other ratios' geomeans."""
    return (
        f"speedup_nchw {fmt(summary['geomean_speedup_nchw'])}x; "
        f"fused/conv {fmt(summary['geomean_fused_over_conv_only'])}; "
        f"vs torch conv {fmt(summary['geomean_vs_torch_conv_only'])}"
    )


SPEC = harness.Spec(
    name=NAME,
    schema=SCHEMA,
    description=__doc__ or "",
    variants=VARIANTS,
    ratios=RATIOS,
    headline="speedup_cl",
    targets=TARGETS,
    row_fields=ROW_FIELDS,
    table=TABLE_COLUMNS,
    legend=(
        "spd_*: torch / ours (> 1: ours faster); fused/conv: ours_cl / ours_conv_only; vs_t_conv: ours_cl / F.conv2d"
    ),
    grad_mode=False,
    record_definitions=False,
    name_in_titles=False,
    headline_definition="speedup = nn.Conv2d time / ours",
    ylabel="speedup vs nn.Conv2d (channels_last)",
    display_extra=display_explain,
    describe_ratios=describe_ratios,
)


# --------------------------------------------------------------------------------------------------------------
# conv + bias + activation (--activation)

ACTIVATION_TARGETS: dict[str, float] = {"bf16": 1.5, "tf32": 1.3, "fp32": 1.1}  # ReLU, vs compiled nn

ACTIVATION_VARIANTS: dict[str, str] = {
    "ours": "ConvBias2d(activation=...), module and input channels_last",
    "ours_compiled": "torch.compile of the same module (default mode)",
    "torch_eager": "nn.Sequential(nn.Conv2d, activation module), channels_last (same parameters)",
    "torch_compiled": "torch.compile of the same Sequential (default mode: bias add and activation fused by Inductor)",
    "torch_cudnn_relu": "relu only: torch.cudnn_convolution_relu(x, w, b, ...), PyTorch's legacy fused cuDNN op",
}

ACTIVATION_RATIOS: dict[str, tuple[str, str]] = {
    "speedup_vs_compiled": ("torch_compiled", "ours"),
    "speedup": ("torch_eager", "ours"),
    "vs_cudnn_relu": ("torch_cudnn_relu", "ours"),
    "ours_compiled_vs_compiled": ("torch_compiled", "ours_compiled"),
}

# --residual: the block ending act(conv + bias + residual).
RESIDUAL_VARIANTS: dict[str, str] = {
    "ours": "conv_bias2d(..., activation=NAME, residual=r): convbias.forward_residual, the whole ending in one op",
    "ours_unfused": "ConvBias2d, then out += residual and the activation module (torchvision's ResNet block ending)",
    "ours_compiled": "torch.compile of ours_unfused (default mode: Inductor fuses the add with the activation)",
    "torch_eager": "the same with nn.Conv2d (same parameters)",
    "torch_compiled": "torch.compile of the nn.Conv2d ending (Inductor fuses bias add, residual add and activation)",
    "torch_cudnn_add_relu": "relu only: torch.cudnn_convolution_add_relu(x, w, residual, 1, b, ...): the whole ending in "
    "one legacy cuDNN call (what a residual add in our graph could give)",
}

RESIDUAL_RATIOS: dict[str, tuple[str, str]] = {
    "speedup_vs_compiled": ("torch_compiled", "ours"),
    "speedup": ("torch_eager", "ours"),
    "ours_compiled_vs_compiled": ("torch_compiled", "ours_compiled"),
    # > 1: the residual in our graph beats our conv + bias graph followed by Inductor's add and activation.
    "fused_vs_ours_compiled": ("ours_compiled", "ours"),
    "vs_cudnn_add_relu": ("torch_cudnn_add_relu", "ours"),
    # > 1: one legacy fused cuDNN call beats our graph + Inductor's add and activation.
    "fused_ending_vs_ours_compiled": ("ours_compiled", "torch_cudnn_add_relu"),
}

GRAPHED_RATIOS: dict[str, tuple[str, str]] = {
    "graphed_vs_compiled": ("torch_compiled", "ours"),
    "graphed_speedup": ("torch_eager", "ours"),
    "graphed_vs_cudnn_relu": ("torch_cudnn_relu", "ours"),
    "graphed_fused_ending_vs_ours_compiled": ("ours_compiled", "torch_cudnn_add_relu"),
    "graphed_fused_vs_ours_compiled": ("ours_compiled", "ours"),
    "graphed_vs_cudnn_add_relu": ("torch_cudnn_add_relu", "ours"),
}


class ResidualEnding(nn.Module):
    """conv -> += residual -> activation: how torchvision's ResNet blocks end (``out += identity; out = relu(out)``),
    with the convolution's own bias standing in for the folded batch norm's."""

    def __init__(self, conv: nn.Module, activation: nn.Module) -> None:
        super().__init__()
        self.conv, self.activation = conv, activation

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        out += residual
        return self.activation(out)


# The sides of the residual ending whose kernels a row records.
KERNEL_SIDES = ("ours", "torch_cudnn_add_relu", "torch_compiled")


def ending_kernels(fn: Callable[[], Any], device: str) -> dict[str, float] | None:
    """GPU ms per kernel of one call of `fn` (names cut to 200 characters: cuDNN's carry long template lists)."""
    kernels = gpu_kernels([fn], device)
    return None if kernels is None else {name[:200]: ms for name, ms in kernels.items()}


def activation_variants(
    problem: Problem, activation: str, residual: torch.Tensor | None = None
) -> dict[str, Callable[[], torch.Tensor]]:
    """The sides of the conv + bias + activation block, on the problem's channels_last tensors and parameters. With
    a ``residual`` the block is act(conv + bias + residual) (``--residual``): ours is ConvBias2d then the add and the
    activation (fused by Inductor when compiled), and PyTorch's ``torch.cudnn_convolution_add_relu`` is the side that
    runs the whole ending in one cuDNN call, i.e. what a residual add inside our graph could give."""
    x = problem.x_cl
    args = (problem.stride, problem.padding, problem.dilation, 1)
    if residual is None:
        ours: nn.Module = torch_convbias.ConvBias2d.from_conv(problem.conv_cl, activation=activation)
        theirs: nn.Module = nn.Sequential(problem.conv_cl, ACTIVATION_MODULES[activation]())
        inputs: tuple[torch.Tensor, ...] = (x,)
    else:
        ours = ResidualEnding(torch_convbias.ConvBias2d.from_conv(problem.conv_cl), ACTIVATION_MODULES[activation]())
        theirs = ResidualEnding(problem.conv_cl, ACTIVATION_MODULES[activation]())
        inputs = (x, residual)
    ours_compiled, theirs_compiled = torch.compile(ours), torch.compile(theirs)
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "ours": lambda: ours(*inputs),
        "ours_compiled": lambda: ours_compiled(*inputs),
        "torch_eager": lambda: theirs(*inputs),
        "torch_compiled": lambda: theirs_compiled(*inputs),
    }
    if residual is not None:
        # The op of the whole ending (convbias.forward_residual): the product; "ours" above is then its unfused form.
        variants["ours_unfused"] = variants.pop("ours")
        variants["ours"] = lambda: torch_convbias.conv_bias2d(
            x, problem.w_cl, problem.bias, problem.stride, problem.padding, problem.dilation, 1, activation,
            residual=residual,
        )
    if activation == "relu" and x.is_cuda and residual is None:
        variants["torch_cudnn_relu"] = lambda: torch.cudnn_convolution_relu(x, problem.w_cl, problem.bias, *args)
    if activation == "relu" and x.is_cuda and residual is not None:
        variants["torch_cudnn_add_relu"] = lambda: torch.cudnn_convolution_add_relu(
            x, problem.w_cl, residual, 1.0, problem.bias, *args
        )
    return variants


def measure_activation(
    shape: Shape, mode: Mode, device: str, warmup: int, iters: int, seed: int, activation: str, residual: bool = False
) -> dict[str, Any]:
    """One (shape, mode) of the activation block: numerics of every side against float64, then per-call timings
    side by side, back to back, and CUDA-graphed."""
    torch._dynamo.reset()  # every row compiles the same module classes: a fresh recompile budget
    problem = make_problem(shape, mode, device, seed)
    args = (problem.stride, problem.padding, problem.dilation, 1)
    conv64 = F.conv2d(problem.x_nchw.double(), problem.w_nchw.double(), problem.bias.double(), *args)
    added: torch.Tensor | None = None
    if residual:
        # Of the output's magnitude (as an identity branch is), channels_last like the output.
        added = torch.randn(conv64.shape, device=device, dtype=mode.dtype).contiguous(memory_format=torch.channels_last)
        conv64 = conv64 + added.double()
    variants = activation_variants(problem, activation, added)
    errors: dict[str, str] = {}
    reference = ACTIVATION_MODULES[activation]()(conv64)
    outputs: dict[str, torch.Tensor] = {}
    for name, fn in variants.items():
        try:
            outputs[name] = fn()
        except Exception as error:  # noqa: BLE001 - recorded; the other sides still run
            errors[name] = short_error(error)
    numerics = harness.check_all({n: check_against_float64(out, reference, mode) for n, out in outputs.items()})
    del outputs
    # Which route ours took for the block (the activation in the graph's epilogue or a pass after it, the residual in
    # the graph or in that pass, with or without the bias, and why).
    route = explain(problem, activation, added) if "ours" not in errors else None
    timings = harness.time_variants(variants, errors, warmup, iters, device, called=list(variants))
    rates = harness.time_throughput(variants, errors, device)
    # With a residual, the kernels of one call of each side that runs the whole ending (profiler; None on the CPU):
    # which engine ours and PyTorch's fused op each took where their times differ.
    kernels = (
        {name: ending_kernels(variants[name], device) for name in KERNEL_SIDES if name in variants and name not in errors}
        if residual
        else None
    )
    graphed: dict[str, Callable[[], Any]] = {}
    graph_errors: dict[str, str] = {}
    if torch.device(device).type == "cuda":
        for name, fn in variants.items():
            if name in errors:
                continue
            try:
                graphed[name] = capture_replay(fn)
            except Exception as error:  # noqa: BLE001 - recorded: the eager figures still stand
                graph_errors[name] = short_error(error)
                torch.cuda.synchronize()
    graphed_timings = harness.time_throughput(graphed, {}, device) if graphed else {}
    spec = forward_activation_spec(activation, residual)
    return {
        "status": "partial" if errors else "ok",
        "error": None,
        "variant_errors": errors,
        "timings": timings,
        **harness.ratios(spec, timings),
        "back_to_back": rates,
        "vs_compiled_back_to_back": harness.ratio(rates, "torch_compiled", "ours"),
        "graphed": graphed_timings,
        **{name: harness.ratio(graphed_timings, num, den) for name, (num, den) in GRAPHED_RATIOS.items()},
        "graph_error": "; ".join(f"{k}: {v}" for k, v in graph_errors.items()) or None,
        "numerics": numerics,
        "explain": route,
        "kernels": kernels,
    }


@functools.cache
def forward_activation_spec(activation: str, residual: bool = False) -> harness.Spec:
    block = f"conv + bias + residual, {activation}" if residual else f"conv + bias + {activation}"
    return dataclasses.replace(
        SPEC,
        name=f"{NAME}_residual_{activation}" if residual else f"{NAME}_{activation}",
        schema="torch_convbias.bench_forward_activation/1",
        variants=RESIDUAL_VARIANTS if residual else ACTIVATION_VARIANTS,
        suite=harness.ACTIVATION_SUITE,
        ratios=RESIDUAL_RATIOS if residual else ACTIVATION_RATIOS,
        # GPU time, as the targets are: CUDA-graphed calls (per call, rows under ~0.3 ms measure the host).
        headline="graphed_vs_compiled",
        targets=ACTIVATION_TARGETS if activation == "relu" and not residual else {},
        row_fields=(
            "back_to_back", "vs_compiled_back_to_back", "graphed", *GRAPHED_RATIOS, "graph_error", "numerics", "explain",
        ),
        table=[
            ("shape", "label", ""),
            ("ours", "ours", ".3f"),
            ("torch_comp", "torch_compiled", ".3f"),
            ("vs_comp", "speedup_vs_compiled", ".2f"),
            ("speedup", "speedup", ".2f"),
            *(
                [("fused/ours_c", "fused_vs_ours_compiled", ".2f"), ("vs_add_relu", "vs_cudnn_add_relu", ".2f")]
                if residual
                else [("vs_cudnn_relu", "vs_cudnn_relu", ".2f")]
            ),
            ("b2b_vs_comp", "vs_compiled_back_to_back", ".2f"),
            ("graphed_vs_comp", "graphed_vs_compiled", ".2f"),
            *harness.VERDICT_COLUMNS,
        ],
        legend=f"{block}, channels_last; vs_comp: torch_compiled / ours (> 1: ours faster)",
        config={"activation": activation, "residual": residual, "compiled": "torch.compile default mode"},
        headline_definition=f"graphed_vs_compiled = compiled nn.Conv2d block ({block}) / ours, CUDA-graphed (GPU time)",
        ylabel=f"CUDA-graphed: compiled nn.Conv2d ({block}) / ours",
        display_extra=None,
        describe_ratios=None,
        summarize_extra=lambda rows: {
            **harness.ratio_summary(rows, "vs_compiled_back_to_back"),
            **harness.ratio_summary(rows, "speedup_vs_compiled"),
            **(harness.ratio_summary(rows, "graphed_fused_ending_vs_ours_compiled") if residual else {}),
            **(harness.ratio_summary(rows, "graphed_fused_vs_ours_compiled") if residual else {}),
        },
        describe_extra=lambda summary: (
            harness.describe_ratio_summary(summary, "vs_compiled_back_to_back", "back to back, vs compiled nn")
            + f"\n{'':>15}"
            + harness.describe_ratio_summary(summary, "speedup_vs_compiled", "per call, vs compiled nn")
            + (
                f"\n{'':>15}"
                + harness.describe_ratio_summary(
                    summary,
                    "graphed_fused_vs_ours_compiled",
                    "CUDA-graphed, ours compiled (graph + Inductor's add) / ours (the residual in the graph)",
                )
                + f"\n{'':>15}"
                + harness.describe_ratio_summary(
                    summary,
                    "graphed_fused_ending_vs_ours_compiled",
                    "CUDA-graphed, ours compiled / cudnn_convolution_add_relu",
                )
                if residual
                else ""
            )
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (0 also when targets are missed: that is a result). ``--residual``
    (with ``--activation``) times the residual block ending act(conv + bias + residual) instead."""
    return harness.run_with_activation(
        argv,
        lambda activation, residual: SPEC if activation == "identity" else forward_activation_spec(activation, residual),
        lambda activation, residual: measure
        if activation == "identity"
        else functools.partial(measure_activation, activation=activation, residual=residual),
        ACTIVATION_MODULES,
        {"residual": "time the residual block ending act(conv + bias + residual) instead (needs --activation)"},
    )


if __name__ == "__main__":
    sys.exit(main())
