"""The driver shared by every benchmark (``bench_forward``, ``bench_param_grad``, ``bench_layerwise``).

Per (cudnn.benchmark setting, mode, shape) one row, variants timed side by side, the JSON rewritten after every
shape, a failing or out-of-memory shape recorded as that row's status, then per-mode summaries (geomeans, worst
shape, shapes below 1.0x, PASS/MISS against the targets). Each benchmark describes itself in a :class:`Spec` and
supplies a ``measure`` function for one shape; everything around it lives here: the suite of shapes, the command
line, the plan-cache probes, rows, summaries, tables and the plot.

Not named ``bench_*.py``: ``./dev.sh gpu`` runs every such file as a benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import torch_convbias

from .common import (
    Mode,
    bench_name,
    environment,
    fmt,
    free_memory,
    geomean,
    mode_flags,
    modes,
    print_table,
    result_path,
    short_error,
    synchronize,
    time_back_to_back,
    time_side_by_side,
    verdict,
    wall_ms,
    write_json,
)

# --------------------------------------------------------------------------------------------------------------
# The suite


# The last columns of every benchmark's table: the row's numerics verdict (float64 checks) and its status.
VERDICT_COLUMNS: tuple[tuple[str, str, str], ...] = (("num", "numerics", ""), ("status", "status", ""))


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

# The conv + bias + activation blocks (issue 13): the suite with N >= 1024 wherever the output is 32x32 or smaller, so
# that every row is GPU-bound (the epilogue saves one pointwise pass, which a host-bound row would hide).
ACTIVATION_SUITE: tuple[Shape, ...] = tuple(
    dict.fromkeys(
        dataclasses.replace(shape, n=max(shape.n, 1024)) if shape.h * shape.w <= 32 * 32 else shape for shape in SUITE
    )
)

# Smoke-test subset: a tiny problem, a common 3x3 and a 1x1; all small enough for the CPU path too.
QUICK_SUITE: tuple[Shape, ...] = (
    Shape(16, 16, 16, 16, 16, 3, 1, 1),
    Shape(128, 64, 32, 32, 64, 3, 1, 1),
    Shape(128, 1024, 14, 14, 256, 1, 1, 0),
)

# On the CPU the benchmarks only exercise the scripts' logic (the ops run ATen's reference there).
CPU_BATCH = 2
CPU_MAX_HW = 1024

DEFAULT_MODES = ("fp32", "tf32", "bf16")
# (warmup, iters) per variant. GPU: each variant runs ~111 times per shape; the heaviest shapes (~60-80 GFLOP) take
# ~1-3 ms per call in fp32, i.e. a few seconds per shape, so 3 modes x 11 shapes take a minute or two plus
# autotuning (cudnn.benchmark) and plan builds. CPU: only the logic is tested.
DEFAULT_COUNTS = {"cuda": (10, 100), "cpu": (1, 3)}

# measure(shape, mode, device, warmup, iters, seed) -> the row's measured fields (timings, ratios, numerics, ...).
Measure = Callable[[Shape, Mode, str, int, int, int], dict[str, Any]]


@dataclass(frozen=True)
class Spec:
    """What distinguishes one benchmark: its names, variants, ratios, targets, table and extra summary.

    The fields after ``config`` have defaults that suit the backward benchmarks; bench_forward, whose output
    format came first, sets them to keep that format.
    """

    name: str  # result-file prefix: <name>-<gpu>-<UTC time>.json
    schema: str
    description: str  # the script's docstring, shown by --help
    variants: Mapping[str, str]  # variant -> what exactly it runs
    ratios: Mapping[str, tuple[str, str]]  # ratio -> (numerator, denominator) variant medians
    headline: str  # the ratio the targets apply to
    targets: Mapping[str, float]  # mode -> goal for the geometric mean of the headline ratio
    # Measured row keys besides ratios, in JSON order, null in rows that failed; "numerics" follows them unless
    # named here.
    row_fields: Sequence[str]
    table: Sequence[tuple[str, str, str]]  # (header, key, format) of the per-mode table
    legend: str  # one line above each table
    config: Mapping[str, Any] = field(default_factory=dict)  # more to record in the config
    suite: tuple[Shape, ...] = SUITE  # the shapes of a full run (--quick: QUICK_SUITE)
    # Extra summary fields from one mode's rows (skipped ones left out) and a line printing them; both optional.
    summarize_extra: Callable[[Sequence[dict[str, Any]]], dict[str, Any]] | None = None
    describe_extra: Callable[[dict[str, Any]], str] | None = None
    # Rows measured in grad mode, backward kernels warmed up; False: under torch.no_grad(), forward only.
    grad_mode: bool = True
    # The config also records the variants' definitions and the TORCH_CONVBIAS_* knobs in effect.
    record_definitions: bool = True
    name_in_titles: bool = True  # table and summary titles start with the benchmark's name
    headline_definition: str | None = None  # in the summary title; default "<headline> = <num> / <den>"
    ylabel: str | None = None  # the plot's y axis; default "<headline> = <num> / <den>"
    # More table cells from a row, and the other ratios' part of the summary line (default "name geomean; ...").
    display_extra: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    describe_ratios: Callable[[dict[str, Any]], str] | None = None

    @property
    def headline_ratio(self) -> str:
        """The headline ratio spelled out: '<headline> = <numerator> / <denominator>'."""
        num, den = self.ratios[self.headline]
        return f"{self.headline} = {num} / {den}"


# --------------------------------------------------------------------------------------------------------------
# Command line


def mode_list(values: Sequence[str]) -> list[str]:
    """--modes as given (space- or comma-separated), checked and without repeats."""
    names = [name for value in values for name in value.split(",") if name]
    unknown = sorted(set(names) - set(modes()))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; choose from {sorted(modes())}")
    return list(dict.fromkeys(names))


def parse_args(spec: Spec, argv: Sequence[str] | None) -> argparse.Namespace:
    """The benchmarks' command line: --modes, --benchmark-cudnn, --quick, --device, --out, --warmup, --iters, ..."""
    parser = argparse.ArgumentParser(
        prog=f"python -m bench.bench_{spec.name}",
        description=spec.description,
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
        "--shapes",
        nargs="+",
        type=int,
        default=None,
        metavar="I",
        help="only these shapes of the suite, by index from 0 (to finish a run cut short; bench.merge_results joins it)",
    )
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
    add("--plot", action="store_true", help=f"also write a PNG of {spec.headline} next to the JSON")
    args = parser.parse_args(argv)
    try:
        args.modes = mode_list(args.modes)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    warmup, iters = DEFAULT_COUNTS[args.device]
    args.warmup = warmup if args.warmup is None else args.warmup
    args.iters = iters if args.iters is None else args.iters
    if args.warmup < 0 or args.iters < 1:
        parser.error("--warmup must be >= 0 and --iters >= 1")
    size = len(QUICK_SUITE if args.quick else spec.suite)
    if args.shapes is not None and not all(0 <= i < size for i in args.shapes):
        parser.error(f"--shapes: expected indices from 0 to {size - 1} (the suite has {size} shapes), got {args.shapes}")
    return args


def selected_suite(spec: Spec, args: argparse.Namespace) -> list[Shape]:
    """The shapes this run measures: the suite (or the quick one), narrowed to --shapes when given."""
    suite = list(QUICK_SUITE if args.quick else spec.suite)
    shapes = getattr(args, "shapes", None)
    return suite if shapes is None else [suite[i] for i in dict.fromkeys(shapes)]


# --------------------------------------------------------------------------------------------------------------
# Plan cache: optional API of torch_convbias, recorded as null where absent


def cache_info() -> dict[str, Any] | None:
    """torch_convbias.cache_info() (hits, misses, build_seconds, ...), None where the API is absent."""
    info = getattr(torch_convbias, "cache_info", None)
    if info is None:
        return None
    try:
        return dict(info())
    except Exception as error:  # noqa: BLE001 - diagnostics must not stop the benchmark
        return {"error": short_error(error)}


def cache_clear() -> bool:
    """Empty the plan cache so the next call builds its plan; False where the API does not exist."""
    clear = getattr(torch_convbias, "cache_clear", None)
    if clear is None:
        return False
    clear()
    return True


def _delta(after: dict[str, Any] | None, before: dict[str, Any] | None, key: str) -> float | None:
    """after[key] - before[key], None where either statistic is missing."""
    try:
        return after[key] - before[key]  # type: ignore[index]
    except (TypeError, KeyError):
        return None


# --------------------------------------------------------------------------------------------------------------
# Pieces of a measurement


def cold_call(fn: Callable[[], Any], device: str) -> tuple[dict[str, Any], Any]:
    """Wall time of ``fn``'s first call after clearing the plan cache, with the cache statistics around it.

    Returns (record, fn's result), the result None where the call failed (the record then holds the error).
    Out-of-memory propagates: the row becomes ``oom``.
    """
    record: dict[str, Any] = {"cache_cleared": cache_clear()}
    before = cache_info()
    try:
        ms, result = wall_ms(fn, device)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as error:  # noqa: BLE001 - recorded; the other variants still run
        record.update(first_call_ms=None, error=short_error(error))
        return record, None
    after = cache_info()
    record.update(
        first_call_ms=ms,
        cache_before=before,
        cache_after=after,
        plan_build_seconds=_delta(after, before, "build_seconds"),
        plan_cache_misses=_delta(after, before, "misses"),
    )
    return record, result


def check_all(checks: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """Several ``common.check_against_float64`` results as one: passed if all passed, the failures named."""
    failed = [name for name, check in checks.items() if not check["passed"]]
    message = "; ".join(f"{name}: {checks[name]['message']}" for name in failed)[:1000] or None
    return {"passed": not failed, "message": message, "checks": dict(checks)}


def run_checks(check: Callable[[], dict[str, Any]], errors: dict[str, str]) -> dict[str, Any] | None:
    """Run the numerics check; a failure to *run* it lands in ``errors['numerics']`` (the probe then names the
    variant at fault). Out-of-memory propagates."""
    try:
        return check()
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as error:  # noqa: BLE001 - recorded, not fatal
        errors["numerics"] = short_error(error)
        return None


def probe(variants: Mapping[str, Callable[[], Any]], skip: Iterable[str]) -> dict[str, str]:
    """Call each variant once (cudnn.benchmark autotunes here); errors by variant instead of raising."""
    errors: dict[str, str] = {}
    for name, fn in variants.items():
        if name in skip:
            continue
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - OOM included: one variant failing leaves the others
            errors[name] = short_error(error)
    return errors


def time_variants(
    variants: Mapping[str, Callable[[], Any]],
    errors: dict[str, str],
    warmup: int,
    iters: int,
    device: str,
    called: Iterable[str] = (),
) -> dict[str, dict[str, Any]]:
    """Call every variant once (cudnn.benchmark autotunes here), then time the ones that worked side by side.

    Variants already in ``errors`` are left out, those in ``called`` (already run once, e.g. by the cold call) are
    not probed again; new failures are added to ``errors``.
    """
    errors.update(probe(variants, skip=[*called, *errors]))
    runnable = {name: fn for name, fn in variants.items() if name not in errors}
    return time_side_by_side(runnable, warmup, iters, device) if runnable else {}


def ratios(spec: Spec, timings: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """The spec's ratios of median times; None where a side was not measured."""
    return {name: ratio(timings, num, den) for name, (num, den) in spec.ratios.items()}


# Throughput figures (common.time_back_to_back): calls queued per sample, samples per variant.
BACK_TO_BACK_CALLS, BACK_TO_BACK_REPEATS = 20, 10


def time_throughput(
    variants: Mapping[str, Callable[[], Any]], errors: Mapping[str, str], device: str
) -> dict[str, dict[str, Any]]:
    """The variants that worked, each timed as calls queued back to back (the rate a training loop runs them at:
    GPU time, or host time where the host cannot keep up). Per-call events with the variants interleaved (the
    side-by-side figure) also count the launch latency after a host-heavy neighbour left the GPU idle, which on
    problems of a few tenths of a millisecond swings the ratio by 20% from run to run; this figure does not."""
    runnable = {name: fn for name, fn in variants.items() if name not in errors}
    if not runnable:
        return {}
    return time_back_to_back(runnable, BACK_TO_BACK_CALLS, BACK_TO_BACK_REPEATS, device)


def ratio(timings: Mapping[str, Mapping[str, Any]], num: str, den: str) -> float | None:
    """timings[num] / timings[den] (medians); None where a side was not measured."""
    a, b = timings.get(num), timings.get(den)
    return a["median_ms"] / b["median_ms"] if a and b and b["median_ms"] > 0 else None


def ratio_summary(rows: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """Geomean, worst shape and shapes below 1.0x of a per-row ratio that is not the headline."""
    measured = [r for r in rows if r.get(key) is not None]
    worst = min(measured, key=lambda r: r[key], default=None)
    return {
        f"geomean_{key}": geomean(r[key] for r in measured),
        f"worst_{key}": worst[key] if worst else None,
        f"worst_shape_{key}": worst["label"] if worst else None,
        f"below_1x_shapes_{key}": [r["label"] for r in measured if r[key] < 1.0],
        f"measured_{key}": len(measured),
    }


def describe_ratio_summary(summary: Mapping[str, Any], key: str, what: str) -> str:
    """One line for :func:`ratio_summary`'s fields."""
    below = summary[f"below_1x_shapes_{key}"]
    return (
        f"{what}: geomean {fmt(summary[f'geomean_{key}'])}x, worst {summary[f'worst_shape_{key}']} "
        f"{fmt(summary[f'worst_{key}'])}x, below 1.0x: {len(below)}/{summary[f'measured_{key}']}"
    )


def tflops(shape: Shape, timing: Mapping[str, Any] | None) -> float | None:
    """The shape's convolution flops (:attr:`Shape.gflop`) per median time, in TFLOP/s; None if not measured."""
    return shape.gflop / timing["median_ms"] if timing and timing["median_ms"] > 0 else None


# --------------------------------------------------------------------------------------------------------------
# One row


def empty_row(spec: Spec) -> dict[str, Any]:
    """Every key a row can have, null: failed rows keep the same keys as measured ones."""
    fields = spec.row_fields if "numerics" in spec.row_fields else (*spec.row_fields, "numerics")
    return {
        "status": None,
        "error": None,
        "variant_errors": {},
        "timings": {},
        **{name: None for name in spec.ratios},
        **{name: None for name in fields},
    }


def run_case(
    spec: Spec, measure: Measure, requested: Shape, mode: Mode, benchmark: bool, args: argparse.Namespace
) -> dict[str, Any]:
    """One row: a shape under a mode and cudnn.benchmark setting; failures become the status, never an exception.

    Grad mode is on for the backward benchmarks (they build autograd graphs), off for a forward-only spec.
    """
    shape = dataclasses.replace(requested, n=CPU_BATCH) if args.device == "cpu" else requested
    row: dict[str, Any] = {
        "mode": mode.name,
        "dtype": str(mode.dtype).removeprefix("torch."),
        "cudnn_benchmark": benchmark,
        "label": requested.label,
        "shape": dataclasses.asdict(shape),
        "requested_n": requested.n,
        "gflop": shape.gflop,
        **empty_row(spec),
    }
    if args.device == "cpu" and shape.h * shape.w > CPU_MAX_HW:
        row.update(status="skipped", error=f"cpu mode skips H*W > {CPU_MAX_HW}")
        return row
    try:
        with mode_flags(mode, cudnn_benchmark=benchmark), torch.set_grad_enabled(spec.grad_mode):
            row.update(measure(shape, mode, args.device, args.warmup, args.iters, args.seed))
    except torch.cuda.OutOfMemoryError as error:
        row.update(status="oom", error=short_error(error))
    except Exception as error:  # noqa: BLE001 - one broken shape must not lose the rest of the run
        row.update(status="error", error=short_error(error))
    free_memory(args.device)
    return row


# --------------------------------------------------------------------------------------------------------------
# Summaries, printing, plot


def summarize_rows(
    spec: Spec,
    rows: Sequence[dict[str, Any]],
    mode: str,
    benchmark: bool,
    suite: Sequence[Mapping[str, int]] | None = None,
) -> dict[str, Any]:
    """Geomeans of every ratio, worst shape, shapes below 1.0x and the target verdicts for one mode and setting.

    A missing shape (error, OOM, or, given the run's ``suite``, a shape with no row: a run cut short) makes a verdict
    impossible (None, printed INCOMPLETE), never a pass.
    """
    key = spec.headline
    mine = [r for r in rows if r["mode"] == mode and r["cudnn_benchmark"] == benchmark and r["status"] != "skipped"]
    # A row whose numbers are wrong measures nothing worth comparing: out of every geomean, named below.
    failed_numerics = [r["label"] for r in mine if r["numerics"] and not r["numerics"]["passed"]]
    right = [r for r in mine if r["label"] not in failed_numerics]
    measured = [r for r in right if r[key] is not None]
    missing = [r["label"] for r in mine if r[key] is None]
    present = {r["label"] for r in mine}
    missing += [label for label in (Shape(**shape).label for shape in suite or ()) if label not in present]
    below = [r["label"] for r in measured if r[key] < 1.0]
    worst = min(measured, key=lambda r: r[key], default=None)
    geo = geomean(r[key] for r in measured)
    target = spec.targets.get(mode)
    summary = {
        "mode": mode,
        "cudnn_benchmark": benchmark,
        "shapes": len(mine),
        "measured": len(measured),
        "missing": missing,
        **{f"geomean_{name}": geomean(r[name] for r in measured) for name in spec.ratios},
        f"geomean_{key}": geo,  # the headline may be a row field outside spec.ratios (e.g. a CUDA-graphed ratio)
        "worst_shape": worst["label"] if worst else None,
        f"worst_{key}": worst[key] if worst else None,
        "below_1x": len(below),
        "below_1x_shapes": below,
        "numerics_failures": failed_numerics,
        f"target_geomean_{key}": target,
        "target_geomean_pass": (
            None if target is None or missing or failed_numerics or geo is None else geo >= target
        ),
        "target_no_shape_below_1x_pass": None if missing or failed_numerics or not mine else not below,
    }
    if spec.summarize_extra is not None:
        summary.update(spec.summarize_extra(right))
    return summary


def describe_ratios(spec: Spec, summary: dict[str, Any]) -> str:
    """The geomeans of the ratios besides the headline, for the summary line."""
    if spec.describe_ratios is not None:
        return spec.describe_ratios(summary)
    return "; ".join(f"{name} {fmt(summary[f'geomean_{name}'])}" for name in spec.ratios if name != spec.headline)


def print_summary(spec: Spec, summary: dict[str, Any]) -> None:
    """One mode's summary: headline geomean against its target, the other ratios, worst shape, misses."""
    key = spec.headline
    target = summary[f"target_geomean_{key}"]
    goal = f"target >= {target:.2f}x {verdict(summary['target_geomean_pass'])}" if target else "no target"
    print(
        f"{summary['mode']:>5} bench={bench_name(summary['cudnn_benchmark']):<3} "
        f"geomean {key} {fmt(summary[f'geomean_{key}'])}x ({goal}); {describe_ratios(spec, summary)}"
    )
    print(
        f"{'':>15}worst {summary['worst_shape']} {fmt(summary[f'worst_{key}'])}x; "
        f"below 1.0x: {summary['below_1x']}/{summary['measured']} "
        f"(target 0 {verdict(summary['target_no_shape_below_1x_pass'])}); "
        f"missing {len(summary['missing'])}; numerics failures {len(summary['numerics_failures'])}"
    )
    if spec.describe_extra is not None:
        print(f"{'':>15}{spec.describe_extra(summary)}")


def display_row(spec: Spec, row: dict[str, Any]) -> dict[str, Any]:
    """A row flattened for the table: its own keys plus each variant's median and the numerics verdict."""
    flat = {key: value for key, value in row.items() if not isinstance(value, (dict, list))}
    flat.update({name: row["timings"].get(name, {}).get("median_ms") for name in spec.variants})
    numerics = row["numerics"]
    flat["numerics"] = None if numerics is None else ("ok" if numerics["passed"] else "FAIL")
    if spec.display_extra is not None:
        flat.update(spec.display_extra(row))
    return flat


def print_problems(rows: Sequence[dict[str, Any]]) -> None:
    """Below a table: each measured row's variant errors, row error and failed numerics, one line each."""
    for r in rows:
        if r["status"] == "skipped":
            continue
        problems = {**r["variant_errors"], **({"row": r["error"]} if r["error"] else {})}
        for what, message in problems.items():
            print(f"  {r['label']}: {what}: {message}")
        if r["numerics"] and not r["numerics"]["passed"]:
            print(f"  {r['label']}: numerics: {r['numerics']['message']}")


def print_mode_table(spec: Spec, rows: Sequence[dict[str, Any]], mode: str, benchmark: bool) -> None:
    """The table of one mode and cudnn.benchmark setting: median ms per variant, ratios, status, problems."""
    prefix = f"{spec.name}: " if spec.name_in_titles else ""
    print(f"\n== {prefix}{mode}, cudnn.benchmark={bench_name(benchmark)}: median ms ==")
    print(spec.legend)
    mine = [r for r in rows if r["mode"] == mode and r["cudnn_benchmark"] == benchmark]
    print_table([display_row(spec, r) for r in mine], spec.table)
    print_problems(mine)


def plot(spec: Spec, results: dict[str, Any], path: Path) -> Path | None:
    """Bar chart of the headline ratio per shape, one bar per mode, a panel per cudnn.benchmark setting."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed; no PNG written")
        return None
    rows = [r for r in results["rows"] if r["status"] != "skipped"]
    if not rows:
        print("--plot: no measured rows; no PNG written")
        return None
    settings = sorted({r["cudnn_benchmark"] for r in rows}, reverse=True)
    mode_names = list(dict.fromkeys(r["mode"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, axes = plt.subplots(
        len(settings), 1, figsize=(max(8.0, 1.1 * len(labels)), 4.5 * len(settings)), squeeze=False
    )
    width = 0.8 / len(mode_names)
    for ax, benchmark in zip(axes[:, 0], settings, strict=True):
        for m, mode in enumerate(mode_names):
            by_label = {
                r["label"]: r[spec.headline] for r in rows if r["mode"] == mode and r["cudnn_benchmark"] == benchmark
            }
            values = [by_label.get(label) or 0.0 for label in labels]  # 0: not measured (error, OOM)
            offset = (m - (len(mode_names) - 1) / 2) * width
            bars = ax.bar([i + offset for i in range(len(labels))], values, width, label=mode)
            if mode in spec.targets:
                ax.axhline(spec.targets[mode], color=bars.patches[0].get_facecolor(), linestyle=":", linewidth=1)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(spec.ylabel or spec.headline_ratio, fontsize=8)
        ax.set_title(f"cudnn.benchmark={bench_name(benchmark)}; dotted: geomean targets; 0: not measured", fontsize=9)
        ax.legend(fontsize=8)
    env = results["environment"]
    fig.suptitle(f"convbias {spec.name}, {env['gpu']}, torch {env['torch']}, commit {str(env['commit'])[:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------------------
# Warm-up


def warm_up_device(selected: Sequence[Mode], device: str) -> None:
    """Create cuDNN/cuBLAS handles and load the forward kernels once, so the first shape's cold call measures
    plan building rather than library loading."""
    x = torch.randn(2, 8, 8, 8, device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 8, 3, 3, device=device).contiguous(memory_format=torch.channels_last)
    for mode in selected:
        with mode_flags(mode), torch.no_grad():
            try:
                xm, wm = x.to(mode.dtype), w.to(mode.dtype)
                F.conv2d(xm, wm, None, 1, 1)
                torch.ops.convbias.forward(xm, wm, None, [1, 1], [1, 1], [1, 1], 1)
            except Exception as error:  # noqa: BLE001 - the per-shape runs will record the failure properly
                print(f"warm-up in {mode.name} failed: {short_error(error)}", file=sys.stderr)
    synchronize(device)


def warm_up_backward(selected: Sequence[Mode], device: str) -> None:
    """Load the backward kernels once (after :func:`warm_up_device`), for the same reason."""
    x = torch.randn(2, 8, 8, 8, device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 8, 3, 3, device=device).contiguous(memory_format=torch.channels_last)
    grad = torch.randn(2, 8, 8, 8, device=device).contiguous(memory_format=torch.channels_last)
    for mode in selected:
        with mode_flags(mode):
            try:
                xm, wm, gm = x.to(mode.dtype), w.to(mode.dtype), grad.to(mode.dtype)
                torch.ops.aten.convolution_backward(
                    gm, xm, wm, [8], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, True]
                )
                torch.ops.convbias.param_grad(gm, xm, wm, [1, 1], [1, 1], [1, 1], 1, [True, True])
            except Exception as error:  # noqa: BLE001 - the per-shape runs will record the failure properly
                print(f"backward warm-up in {mode.name} failed: {short_error(error)}", file=sys.stderr)
    synchronize(device)


# --------------------------------------------------------------------------------------------------------------
# The whole run


def new_config(spec: Spec, args: argparse.Namespace, suite: Sequence[Shape]) -> dict[str, Any]:
    """What was asked and how it is defined: options, suite, variants, ratios, targets, optional API, ..."""
    definitions = {"variant_definitions": dict(spec.variants)} if spec.record_definitions else {}
    # The extension's knobs (e.g. which param_grad path runs) change what "ours" measures.
    knobs = {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCH_CONVBIAS_")}
    return {
        "device": args.device,
        "modes": args.modes,
        "benchmark_cudnn": args.benchmark_cudnn,
        "quick": args.quick,
        "warmup": args.warmup,
        "iters": args.iters,
        "seed": args.seed,
        "suite": [dataclasses.asdict(s) for s in suite],
        "variants": list(spec.variants),
        **definitions,
        "ratios": {name: f"{a} / {b}" for name, (a, b) in spec.ratios.items()},
        "targets": {f"geomean_{spec.headline}": dict(spec.targets), "max_shapes_below_1x": 0},
        "optional_api": {n: hasattr(torch_convbias, n) for n in ("cache_clear", "cache_info", "explain")},
        **({"knobs": knobs} if spec.record_definitions else {}),
        **spec.config,
    }


def new_results(spec: Spec, args: argparse.Namespace, suite: Sequence[Shape]) -> dict[str, Any]:
    """The JSON document's head: schema, environment, config."""
    return {
        "schema": spec.schema,
        "environment": environment(),
        "config": new_config(spec, args, suite),
        "complete": False,
    }


def run_suite(
    spec: Spec, args: argparse.Namespace, measure: Measure, results: dict[str, Any], path: Path
) -> list[bool]:
    """Every (cudnn.benchmark setting, mode, shape) row into ``results``, the JSON rewritten after each; a table
    per mode. Returns the cudnn.benchmark settings run."""
    selected = [modes()[name] for name in args.modes]
    settings = {"on": [True], "off": [False], "both": [True, False]}[args.benchmark_cudnn]
    suite = selected_suite(spec, args)
    for benchmark in settings:
        for mode in selected:
            for i, shape in enumerate(suite):
                begin = time.perf_counter()
                row = run_case(spec, measure, shape, mode, benchmark, args)
                results["rows"].append(row)
                print(
                    f"[{mode.name} bench={bench_name(benchmark)}] {i + 1}/{len(suite)} {shape.label}: "
                    f"{row['status']}, {spec.headline} {fmt(row[spec.headline])} "
                    f"({time.perf_counter() - begin:.1f}s)",
                    flush=True,
                )
                # Rewritten after every shape so that a run killed half-way still leaves its results.
                write_json(results, args.out, spec.name, path)
            print_mode_table(spec, results["rows"], mode.name, benchmark)
    return settings


def report(spec: Spec, args: argparse.Namespace, results: dict[str, Any], path: Path) -> None:
    """The per-mode summaries, the optional plot and where the results are."""
    prefix = f"{spec.name} " if spec.name_in_titles else ""
    print(f"\n== {prefix}summary ({spec.headline_definition or spec.headline_ratio}) ==")
    for summary in results["summaries"]:
        print_summary(spec, summary)
    if args.plot:
        png = plot(spec, results, path.with_suffix(".png"))
        if png:
            print(f"plot: {png}")
    print(f"results: {path} ({results['wall_seconds']:.0f}s)")


def run(
    spec: Spec,
    args: argparse.Namespace,
    measure: Measure,
    before: Callable[[], dict[str, Any]] | None = None,
) -> int:
    """Run the suite and write the results; ``before`` measures run-level facts (stored at the JSON's top level)
    after the device warm-up and before the first shape. Returns the exit status (a missed target is a result)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench_{spec.name}: no CUDA device; use --device cpu to smoke-test the script", file=sys.stderr)
        return 2
    selected = [modes()[name] for name in args.modes]
    started = time.perf_counter()
    results = new_results(spec, args, selected_suite(spec, args))
    env = results["environment"]
    print(
        f"bench_{spec.name}: {env['gpu']}, torch {env['torch']}, cuDNN {env['cudnn']}, commit {env['commit']} "
        f"(dirty={env['dirty']}); device {args.device}, warmup {args.warmup}, iters {args.iters}"
    )
    path = result_path(results, args.out, spec.name)
    warm_up_device(selected, args.device)
    if spec.grad_mode:
        warm_up_backward(selected, args.device)
    if before is not None:
        results.update(before())
    results.update(rows=[], summaries=[])
    settings = run_suite(spec, args, measure, results, path)
    suite = results["config"]["suite"]
    results["summaries"] = [summarize_rows(spec, results["rows"], m.name, b, suite) for b in settings for m in selected]
    results["complete"] = True
    results["wall_seconds"] = time.perf_counter() - started
    write_json(results, args.out, spec.name, path)
    report(spec, args, results, path)
    return 0


def run_with_activation(
    argv: Sequence[str] | None,
    spec_for: Callable[..., Spec],
    measure_for: Callable[..., Measure],
    activations: Iterable[str],
    activation_flags: Mapping[str, str] | None = None,
) -> int:
    """``run`` for a benchmark that also takes ``--activation NAME`` (identity by default): the spec and measure of
    that activation, the rest of the command line as usual. ``activation_flags`` (name -> help) are boolean options
    of the activation block (e.g. ``residual``), valid only with an activation; they reach ``spec_for`` and
    ``measure_for`` as keyword arguments. A flag given without an activation: a message and exit status 2."""
    flags = dict(activation_flags or {})
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--activation", choices=["identity", *activations], default="identity")
    for name, text in flags.items():
        pre.add_argument(f"--{name.replace('_', '-')}", dest=name, action="store_true", help=text)
    known, rest = pre.parse_known_args(argv)
    chosen = {name: getattr(known, name) for name in flags}
    if known.activation == "identity" and any(chosen.values()):
        given = ", ".join(f"--{name.replace('_', '-')}" for name, on in chosen.items() if on)
        print(f"bench: {given} needs --activation NAME", file=sys.stderr)
        return 2
    spec = spec_for(known.activation, **chosen)
    return run(spec, parse_args(spec, rest), measure_for(known.activation, **chosen))
