"""Forward benchmark: ``convbias::forward`` (conv + bias) against ``nn.Conv2d``, side by side in one process.

For every numeric mode and shape, six variants run on the same tensors, interleaved in one timing loop:

==================  ============================================================================
ours_cl             ``torch.ops.convbias.forward`` on channels_last input and weight (the product)
ours_nchw           the same op on NCHW input and weight
ours_conv_only      the op without bias (channels_last): our conv-only graph
torch_cl            ``nn.Conv2d`` with bias, module and input channels_last (the main baseline)
torch_nchw          ``nn.Conv2d`` on NCHW
torch_conv_only     ``F.conv2d`` without bias, channels_last: PyTorch's cuDNN conv alone
==================  ============================================================================

Before timing, the first (cold) call of ``ours_cl`` is timed after clearing the plan cache, and its output is
checked against ``torch_cl``. Results go to JSON (and optionally a PNG). Run from the repository root:
``python -m bench.bench_forward``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import torch_convbias

from .common import (
    Mode,
    environment,
    geomean,
    mode_flags,
    modes,
    print_table,
    result_path,
    synchronize,
    time_side_by_side,
    wall_ms,
    write_json,
)

NAME = "forward"
SCHEMA = "torch_convbias.bench_forward/1"


@dataclass(frozen=True)
class Shape:
    """A convolution: input N x C x H x W, K output channels, square kernel, stride and padding."""

    n: int
    c: int
    h: int
    w: int
    k: int
    kernel: int
    stride: int
    pad: int

    @property
    def label(self) -> str:
        return f"N{self.n} C{self.c} {self.h}x{self.w} K{self.k} k{self.kernel}s{self.stride}p{self.pad}"

    @property
    def out_hw(self) -> tuple[int, int]:
        def out(size: int) -> int:
            return (size + 2 * self.pad - self.kernel) // self.stride + 1

        return out(self.h), out(self.w)

    @property
    def gflop(self) -> float:
        """Multiply-adds counted as two flops; the bias add is negligible next to the convolution."""
        ho, wo = self.out_hw
        return 2 * self.n * self.k * ho * wo * self.c * self.kernel**2 / 1e9


SUITE: tuple[Shape, ...] = tuple(
    Shape(*dims)
    for dims in [
        (16, 16, 16, 16, 16, 3, 1, 1),
        (256, 64, 32, 32, 64, 3, 1, 1),
        (1024, 64, 32, 32, 64, 3, 1, 1),
        (1024, 3, 32, 32, 64, 3, 1, 1),
        (1024, 128, 16, 16, 128, 3, 1, 1),
        (1024, 256, 8, 8, 256, 3, 1, 1),
        (256, 3, 224, 224, 64, 7, 2, 3),
        (256, 64, 56, 56, 256, 1, 1, 0),
        (256, 64, 56, 56, 64, 3, 1, 1),
        (256, 1024, 14, 14, 256, 1, 1, 0),
        (256, 512, 7, 7, 512, 3, 1, 1),
    ]
)

# Smoke-test subset: a tiny problem, a common 3x3 and a 1x1; all small enough for the CPU path too.
QUICK_SUITE: tuple[Shape, ...] = (
    Shape(16, 16, 16, 16, 16, 3, 1, 1),
    Shape(128, 64, 32, 32, 64, 3, 1, 1),
    Shape(128, 1024, 14, 14, 256, 1, 1, 0),
)

# On the CPU the benchmark only exercises the script's logic (the op runs ATen's reference there).
CPU_BATCH = 2
CPU_MAX_HW = 1024

VARIANTS = ("ours_cl", "ours_nchw", "ours_conv_only", "torch_cl", "torch_nchw", "torch_conv_only")

# ratio name -> (numerator, denominator): medians, so > 1 means the denominator is faster for speedups.
RATIOS: dict[str, tuple[str, str]] = {
    "speedup_cl": ("torch_cl", "ours_cl"),
    "speedup_nchw": ("torch_nchw", "ours_nchw"),
    "fused_over_conv_only": ("ours_cl", "ours_conv_only"),
    "vs_torch_conv_only": ("ours_cl", "torch_conv_only"),
}

# Geometric-mean speedup_cl goals per mode (fp16 has none); every mode also aims at no shape below 1.0x.
TARGETS: dict[str, float] = {"bf16": 1.9, "tf32": 1.7, "fp32": 1.15}

DEFAULT_MODES = ("fp32", "tf32", "bf16")
# (warmup, iters) per variant. GPU: each variant runs ~111 times per shape; the heaviest shapes (~60-80 GFLOP) take
# ~1-3 ms per call in fp32, i.e. a few seconds per shape, so 3 modes x 11 shapes take a minute or two plus
# autotuning (cudnn.benchmark) and plan builds. CPU: only the logic is tested.
DEFAULT_COUNTS = {"cuda": (10, 100), "cpu": (1, 3)}


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
    stride: list[int]
    padding: list[int]
    dilation: list[int]

    def ours(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.convbias.forward(x, w, bias, self.stride, self.padding, self.dilation, 1)

    def variants(self) -> dict[str, Callable[[], torch.Tensor]]:
        return {
            "ours_cl": lambda: self.ours(self.x_cl, self.w_cl, self.bias),
            "ours_nchw": lambda: self.ours(self.x_nchw, self.w_nchw, self.bias),
            "ours_conv_only": lambda: self.ours(self.x_cl, self.w_cl, None),
            "torch_cl": lambda: self.conv_cl(self.x_cl),
            "torch_nchw": lambda: self.conv_nchw(self.x_nchw),
            "torch_conv_only": lambda: F.conv2d(
                self.x_cl, self.w_cl, None, self.stride, self.padding, self.dilation, 1
            ),
        }


def make_problem(shape: Shape, mode: Mode, device: str, seed: int) -> Problem:
    """Input ~ N(0, 1), weight and bias from nn.Conv2d's own initialisation, both layouts of each."""
    torch.manual_seed(seed)
    conv_nchw = nn.Conv2d(
        shape.c, shape.k, shape.kernel, shape.stride, shape.pad, bias=True, device=device, dtype=mode.dtype
    )
    # Plain tensors on both sides: under no_grad requires_grad changes nothing, but keep the inputs identical.
    conv_nchw.requires_grad_(False)
    conv_cl = copy.deepcopy(conv_nchw).to(memory_format=torch.channels_last)
    x_nchw = torch.randn(shape.n, shape.c, shape.h, shape.w, device=device, dtype=mode.dtype)
    assert conv_nchw.bias is not None  # built with bias=True; narrows the Optional for the type checker
    return Problem(
        x_cl=x_nchw.contiguous(memory_format=torch.channels_last),
        x_nchw=x_nchw,
        w_cl=conv_cl.weight,
        w_nchw=conv_nchw.weight,
        bias=conv_nchw.bias,
        conv_cl=conv_cl,
        conv_nchw=conv_nchw,
        stride=[shape.stride] * 2,
        padding=[shape.pad] * 2,
        dilation=[1, 1],
    )


# --------------------------------------------------------------------------------------------------------------
# Plan cache and explain(): optional API of torch_convbias, recorded as null where absent


def _short(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:500]


def cache_info() -> dict[str, Any] | None:
    info = getattr(torch_convbias, "cache_info", None)
    if info is None:
        return None
    try:
        return dict(info())
    except Exception as error:  # noqa: BLE001 - diagnostics must not stop the benchmark
        return {"error": _short(error)}


def cache_clear() -> bool:
    """Empty the plan cache so the next call builds its plan; False where the API does not exist."""
    clear = getattr(torch_convbias, "cache_clear", None)
    if clear is None:
        return False
    clear()
    return True


def explain(problem: Problem) -> dict[str, Any] | None:
    """torch_convbias.explain() for ours_cl (path, engine, workspace, ...), None where the API is absent."""
    fn = getattr(torch_convbias, "explain", None)
    if fn is None:
        return None
    try:
        result = fn(problem.x_cl, problem.w_cl, problem.bias, problem.stride, problem.padding, problem.dilation, 1)
        return dict(result) if isinstance(result, dict) else {"value": result}
    except Exception as error:  # noqa: BLE001
        return {"error": _short(error)}


def _delta(after: dict[str, Any] | None, before: dict[str, Any] | None, key: str) -> float | None:
    try:
        return after[key] - before[key]  # type: ignore[index]
    except (TypeError, KeyError):
        return None


def cold_first_call(problem: Problem, device: str) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Wall time of the first ours_cl call after clearing the plan cache (plan build included)."""
    cleared = cache_clear()
    before = cache_info()
    record: dict[str, Any] = {"cache_cleared": cleared}
    try:
        ms, out = wall_ms(problem.variants()["ours_cl"], device)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as error:  # noqa: BLE001
        record.update(first_call_ms=None, error=_short(error))
        return record, None
    after = cache_info()
    record.update(
        first_call_ms=ms,
        cache_before=before,
        cache_after=after,
        plan_build_seconds=_delta(after, before, "build_seconds"),
        plan_cache_misses=_delta(after, before, "misses"),
    )
    return record, out  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------------------
# Numerics and timing of one problem


def check_numerics(actual: torch.Tensor, expected: torch.Tensor, mode: Mode) -> dict[str, Any]:
    """ours_cl against torch_cl, atol scaled by the output's magnitude; records, never raises."""
    scale = max(1.0, expected.abs().amax().item()) if expected.numel() else 1.0
    result: dict[str, Any] = {"rtol": mode.rtol, "atol": mode.atol * scale, "scale": scale}
    if actual.shape != expected.shape:
        return {**result, "passed": False, "message": f"shape {list(actual.shape)} != {list(expected.shape)}"}
    error = (actual.float() - expected.float()).abs().amax().item() if actual.numel() else 0.0
    result.update(max_abs_err=error, max_err_over_scale=error / scale)
    try:
        torch.testing.assert_close(actual, expected, rtol=mode.rtol, atol=mode.atol * scale)
    except AssertionError as failure:
        return {**result, "passed": False, "message": " ".join(str(failure).split())[:500]}
    return {**result, "passed": True, "message": None}


def probe(variants: dict[str, Callable[[], torch.Tensor]], skip: Iterable[str]) -> dict[str, str]:
    """Call each variant once (cudnn.benchmark autotunes here); errors by variant instead of raising."""
    errors: dict[str, str] = {}
    for name, fn in variants.items():
        if name in skip:
            continue
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - OOM included: one variant failing leaves the others
            errors[name] = _short(error)
    return errors


def ratios(timings: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, (num, den) in RATIOS.items():
        a, b = timings.get(num), timings.get(den)
        out[name] = a["median_ms"] / b["median_ms"] if a and b and b["median_ms"] > 0 else None
    return out


def _tflops(shape: Shape, timing: dict[str, Any] | None) -> float | None:
    return shape.gflop / timing["median_ms"] if timing and timing["median_ms"] > 0 else None


def measure(shape: Shape, mode: Mode, device: str, warmup: int, iters: int, seed: int) -> dict[str, Any]:
    """Everything about one (shape, mode) under the current flags: cold call, explain, numerics, timings."""
    problem = make_problem(shape, mode, device, seed)
    variants = problem.variants()
    cold, ours_out = cold_first_call(problem, device)
    errors: dict[str, str] = {}
    numerics: dict[str, Any] | None = None
    out_channels_last: bool | None = None
    if ours_out is None:
        errors["ours_cl"] = cold.get("error", "failed")
    else:
        out_channels_last = ours_out.is_contiguous(memory_format=torch.channels_last)
        try:
            numerics = check_numerics(ours_out, variants["torch_cl"](), mode)
        except Exception as error:  # noqa: BLE001
            errors["torch_cl"] = _short(error)
        del ours_out
    info = explain(problem)
    errors.update(probe(variants, skip=["ours_cl", *errors]))
    runnable = {name: fn for name, fn in variants.items() if name not in errors}
    timings = time_side_by_side(runnable, warmup, iters, device) if runnable else {}
    return {
        "status": "partial" if errors else "ok",
        "error": None,
        "variant_errors": errors,
        "timings": timings,
        **ratios(timings),
        "tflops_ours_cl": _tflops(shape, timings.get("ours_cl")),
        "tflops_torch_cl": _tflops(shape, timings.get("torch_cl")),
        "numerics": numerics,
        "out_channels_last": out_channels_last,
        "first_call_ms": cold.get("first_call_ms"),
        "plan_cache": cold,
        "explain": info,
    }


def free_memory(device: str) -> None:
    """Return cached blocks between shapes so one large shape's leftovers cannot push the next into OOM."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def empty_row() -> dict[str, Any]:
    return {
        "status": None,
        "error": None,
        "variant_errors": {},
        "timings": {},
        **{name: None for name in RATIOS},
        "tflops_ours_cl": None,
        "tflops_torch_cl": None,
        "numerics": None,
        "out_channels_last": None,
        "first_call_ms": None,
        "plan_cache": None,
        "explain": None,
    }


def run_case(
    requested: Shape, mode: Mode, benchmark: bool, device: str, warmup: int, iters: int, seed: int
) -> dict[str, Any]:
    """One row of the results: a shape under a mode and cudnn.benchmark setting; failures become the status."""
    shape = dataclasses.replace(requested, n=CPU_BATCH) if device == "cpu" else requested
    row: dict[str, Any] = {
        "mode": mode.name,
        "dtype": str(mode.dtype).removeprefix("torch."),
        "cudnn_benchmark": benchmark,
        "label": requested.label,
        "shape": dataclasses.asdict(shape),
        "requested_n": requested.n,
        "gflop": shape.gflop,
        **empty_row(),
    }
    if device == "cpu" and shape.h * shape.w > CPU_MAX_HW:
        row.update(status="skipped", error=f"cpu mode skips H*W > {CPU_MAX_HW}")
        return row
    try:
        with mode_flags(mode, cudnn_benchmark=benchmark), torch.no_grad():
            row.update(measure(shape, mode, device, warmup, iters, seed))
    except torch.cuda.OutOfMemoryError as error:
        row.update(status="oom", error=_short(error))
    except Exception as error:  # noqa: BLE001 - one broken shape must not lose the rest of the run
        row.update(status="error", error=_short(error))
    free_memory(device)
    return row


def warm_up_device(selected: Sequence[Mode], device: str) -> None:
    """Create cuDNN/cuBLAS handles and load kernels once, so the first shape's cold call measures plan building."""
    x = torch.randn(2, 8, 8, 8, device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 8, 3, 3, device=device).contiguous(memory_format=torch.channels_last)
    for mode in selected:
        with mode_flags(mode), torch.no_grad():
            try:
                xm, wm = x.to(mode.dtype), w.to(mode.dtype)
                F.conv2d(xm, wm, None, 1, 1)
                torch.ops.convbias.forward(xm, wm, None, [1, 1], [1, 1], [1, 1], 1)
            except Exception as error:  # noqa: BLE001 - the per-shape runs will record the failure properly
                print(f"warm-up in {mode.name} failed: {_short(error)}", file=sys.stderr)
    synchronize(device)


# --------------------------------------------------------------------------------------------------------------
# Summaries, printing, plot


def summarize_rows(rows: Sequence[dict[str, Any]], mode: str, benchmark: bool) -> dict[str, Any]:
    """Geomeans, worst shape, shapes below 1.0x and target verdicts for one mode and cudnn.benchmark setting."""
    mine = [r for r in rows if r["mode"] == mode and r["cudnn_benchmark"] == benchmark and r["status"] != "skipped"]
    measured = [r for r in mine if r["speedup_cl"] is not None]
    missing = [r["label"] for r in mine if r["speedup_cl"] is None]
    below = [r["label"] for r in measured if r["speedup_cl"] < 1.0]
    worst = min(measured, key=lambda r: r["speedup_cl"], default=None)
    geo_cl = geomean(r["speedup_cl"] for r in measured)
    target = TARGETS.get(mode)
    # A missing shape makes a verdict impossible (None), not a pass.
    geomean_pass = None if target is None or missing or geo_cl is None else geo_cl >= target
    return {
        "mode": mode,
        "cudnn_benchmark": benchmark,
        "shapes": len(mine),
        "measured": len(measured),
        "missing": missing,
        **{f"geomean_{name}": geomean(r[name] for r in measured) for name in RATIOS},
        "worst_shape": worst["label"] if worst else None,
        "worst_speedup_cl": worst["speedup_cl"] if worst else None,
        "below_1x": len(below),
        "below_1x_shapes": below,
        "numerics_failures": [r["label"] for r in mine if r["numerics"] and not r["numerics"]["passed"]],
        "target_geomean_speedup_cl": target,
        "target_geomean_pass": geomean_pass,
        "target_no_shape_below_1x_pass": None if missing or not mine else not below,
    }


def _verdict(passed: bool | None) -> str:
    return {True: "PASS", False: "MISS", None: "INCOMPLETE"}[passed]


def _bench_name(benchmark: bool) -> str:
    return "on" if benchmark else "off"


def display_row(row: dict[str, Any]) -> dict[str, Any]:
    """Flatten a result row for the table."""
    flat = {key: row[key] for key in ("label", "status", "first_call_ms", *RATIOS)}
    flat.update({name: row["timings"].get(name, {}).get("median_ms") for name in VARIANTS})
    numerics = row["numerics"]
    flat["numerics"] = None if numerics is None else ("ok" if numerics["passed"] else "FAIL")
    info = row["explain"] or {}
    flat["path"] = info.get("path") or info.get("error")
    flat["engine"] = info.get("engine")
    return flat


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
    ("num", "numerics", ""),
    ("status", "status", ""),
    ("path", "path", ""),
    ("engine", "engine", ""),
]


def print_mode_table(rows: Sequence[dict[str, Any]], mode: str, benchmark: bool) -> None:
    print(f"\n== {mode}, cudnn.benchmark={_bench_name(benchmark)}: median ms ==")
    print("spd_*: torch / ours (> 1: ours faster); fused/conv: ours_cl / ours_conv_only; vs_t_conv: ours_cl / F.conv2d")
    mine = [r for r in rows if r["mode"] == mode and r["cudnn_benchmark"] == benchmark]
    print_table([display_row(r) for r in mine], TABLE_COLUMNS)
    for r in mine:
        if r["status"] == "skipped":
            continue
        problems = {**r["variant_errors"], **({"row": r["error"]} if r["error"] else {})}
        for what, message in problems.items():
            print(f"  {r['label']}: {what}: {message}")
        if r["numerics"] and not r["numerics"]["passed"]:
            print(f"  {r['label']}: numerics: {r['numerics']['message']}")


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_summary(summary: dict[str, Any]) -> None:
    target = summary["target_geomean_speedup_cl"]
    goal = f"target >= {target:.2f}x {_verdict(summary['target_geomean_pass'])}" if target else "no target"
    print(
        f"{summary['mode']:>5} bench={_bench_name(summary['cudnn_benchmark']):<3} "
        f"geomean speedup_cl {_fmt(summary['geomean_speedup_cl'])}x ({goal}); "
        f"speedup_nchw {_fmt(summary['geomean_speedup_nchw'])}x; "
        f"fused/conv {_fmt(summary['geomean_fused_over_conv_only'])}; "
        f"vs torch conv {_fmt(summary['geomean_vs_torch_conv_only'])}"
    )
    print(
        f"{'':>15}worst {summary['worst_shape']} {_fmt(summary['worst_speedup_cl'])}x; "
        f"below 1.0x: {summary['below_1x']}/{summary['measured']} "
        f"(target 0 {_verdict(summary['target_no_shape_below_1x_pass'])}); "
        f"missing {len(summary['missing'])}; numerics failures {len(summary['numerics_failures'])}"
    )


def plot(results: dict[str, Any], path: Path) -> Path | None:
    """Bar chart of speedup_cl per shape, one bar per mode, a panel per cudnn.benchmark setting."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed; no PNG written")
        return None
    rows = [r for r in results["rows"] if r["status"] != "skipped"]
    settings = sorted({r["cudnn_benchmark"] for r in rows}, reverse=True)
    mode_names = list(dict.fromkeys(r["mode"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    if not rows:
        print("--plot: no measured rows; no PNG written")
        return None
    size = (max(8.0, 1.1 * len(labels)), 4.5 * len(settings))
    fig, axes = plt.subplots(len(settings), 1, figsize=size, squeeze=False)
    width = 0.8 / len(mode_names)
    for ax, benchmark in zip(axes[:, 0], settings, strict=True):
        for m, mode in enumerate(mode_names):
            mine = [r for r in rows if r["mode"] == mode and r["cudnn_benchmark"] == benchmark]
            by_label = {r["label"]: r["speedup_cl"] for r in mine}
            values = [by_label.get(label) or 0.0 for label in labels]  # 0: not measured (error, OOM)
            offset = (m - (len(mode_names) - 1) / 2) * width
            bars = ax.bar([i + offset for i in range(len(labels))], values, width, label=mode)
            if mode in TARGETS:
                ax.axhline(TARGETS[mode], color=bars.patches[0].get_facecolor(), linestyle=":", linewidth=1)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("speedup vs nn.Conv2d (channels_last)")
        ax.set_title(f"cudnn.benchmark={_bench_name(benchmark)}; dotted: geomean targets; 0: not measured", fontsize=9)
        ax.legend(fontsize=8)
    env = results["environment"]
    title = f"convbias forward, {env['gpu']}, torch {env['torch']}, commit {str(env['commit'])[:10]}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------------------
# Command line


def _mode_list(values: Sequence[str]) -> list[str]:
    names = [name for value in values for name in value.split(",") if name]
    unknown = sorted(set(names) - set(modes()))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; choose from {sorted(modes())}")
    return list(dict.fromkeys(names))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_forward",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--modes", nargs="+", default=list(DEFAULT_MODES), help="fp32 tf32 bf16 fp16 (default: fp32 tf32 bf16)")
    add(
        "--benchmark-cudnn",
        choices=["on", "off", "both"],
        default="on",
        help="torch.backends.cudnn.benchmark for both sides; 'both' runs the suite twice (default: on)",
    )
    add("--quick", action="store_true", help=f"{len(QUICK_SUITE)}-shape subset with smaller N (smoke test)")
    add(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help=f"cpu only tests the script's logic: N={CPU_BATCH}, shapes with H*W > {CPU_MAX_HW} skipped",
    )
    add("--out", type=Path, default=None, help="output folder (default: bench/results)")
    add("--warmup", type=int, default=None, help="warm-up calls per variant (default: cuda 10, cpu 1)")
    add("--iters", type=int, default=None, help="timed calls per variant (default: cuda 100, cpu 3)")
    add("--seed", type=int, default=0)
    add("--plot", action="store_true", help="also write a PNG of speedup_cl next to the JSON")
    args = parser.parse_args(argv)
    try:
        args.modes = _mode_list(args.modes)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    warmup, iters = DEFAULT_COUNTS[args.device]
    args.warmup = warmup if args.warmup is None else args.warmup
    args.iters = iters if args.iters is None else args.iters
    if args.warmup < 0 or args.iters < 1:
        parser.error("--warmup must be >= 0 and --iters >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (0 also when targets are missed: that is a result)."""
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_forward: no CUDA device; use --device cpu to smoke-test the script", file=sys.stderr)
        return 2
    selected = [modes()[name] for name in args.modes]
    settings = {"on": [True], "off": [False], "both": [True, False]}[args.benchmark_cudnn]
    suite = QUICK_SUITE if args.quick else SUITE
    started = time.perf_counter()
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "environment": environment(),
        "config": {
            "device": args.device,
            "modes": args.modes,
            "benchmark_cudnn": args.benchmark_cudnn,
            "quick": args.quick,
            "warmup": args.warmup,
            "iters": args.iters,
            "seed": args.seed,
            "suite": [dataclasses.asdict(s) for s in suite],
            "variants": list(VARIANTS),
            "ratios": {name: f"{a} / {b}" for name, (a, b) in RATIOS.items()},
            "targets": {"geomean_speedup_cl": TARGETS, "max_shapes_below_1x": 0},
            "optional_api": {n: hasattr(torch_convbias, n) for n in ("cache_clear", "cache_info", "explain")},
        },
        "complete": False,
        "rows": [],
        "summaries": [],
    }
    env = results["environment"]
    print(
        f"bench_forward: {env['gpu']}, torch {env['torch']}, cuDNN {env['cudnn']}, commit {env['commit']} "
        f"(dirty={env['dirty']}); warmup {args.warmup}, iters {args.iters}"
    )
    path = result_path(results, args.out, NAME)
    warm_up_device(selected, args.device)
    for benchmark in settings:
        for mode in selected:
            for i, shape in enumerate(suite):
                begin = time.perf_counter()
                row = run_case(shape, mode, benchmark, args.device, args.warmup, args.iters, args.seed)
                results["rows"].append(row)
                print(
                    f"[{mode.name} bench={_bench_name(benchmark)}] {i + 1}/{len(suite)} {shape.label}: "
                    f"{row['status']}, speedup_cl {_fmt(row['speedup_cl'])} ({time.perf_counter() - begin:.1f}s)",
                    flush=True,
                )
                # Rewritten after every shape so that a run killed half-way still leaves its results.
                write_json(results, args.out, NAME, path)
            print_mode_table(results["rows"], mode.name, benchmark)
    results["summaries"] = [summarize_rows(results["rows"], m.name, b) for b in settings for m in selected]
    results["complete"] = True
    results["wall_seconds"] = time.perf_counter() - started
    write_json(results, args.out, NAME, path)
    print("\n== summary (speedup = nn.Conv2d time / ours) ==")
    for summary in results["summaries"]:
        print_summary(summary)
    if args.plot:
        png = plot(results, path.with_suffix(".png"))
        if png:
            print(f"plot: {png}")
    print(f"results: {path} ({results['wall_seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
