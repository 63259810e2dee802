"""The driver shared by the backward benchmarks (``bench_param_grad``, ``bench_layerwise``).

Same conventions as ``bench_forward``, whose suite, CPU limits, default counts and helpers are imported rather than
copied: per (cudnn.benchmark setting, mode, shape) one row, variants timed side by side, the JSON rewritten after
every shape, a failing or out-of-memory shape recorded as that row's status, then per-mode summaries (geomeans,
worst shape, shapes below 1.0x, PASS/MISS against the targets). Each benchmark describes itself in a
:class:`Spec` and supplies a ``measure`` function for one shape; everything around it lives here.

Not named ``bench_*.py``: ``./dev.sh gpu`` runs every such file as a benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import torch_convbias

from .bench_forward import (
    CPU_BATCH,
    CPU_MAX_HW,
    DEFAULT_COUNTS,
    DEFAULT_MODES,
    QUICK_SUITE,
    SUITE,
    Shape,
    _bench_name,
    _delta,
    _fmt,
    _mode_list,
    _short,
    _verdict,
    cache_clear,
    cache_info,
    free_memory,
    probe,
    warm_up_device,
)
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

# Re-exported for the benchmarks, so that they name one module for the shared pieces.
__all__ = [
    "CPU_BATCH",
    "CPU_MAX_HW",
    "QUICK_SUITE",
    "SUITE",
    "Shape",
    "Spec",
    "check_all",
    "cold_call",
    "fmt",
    "parse_args",
    "ratios",
    "run",
    "run_checks",
    "short_error",
    "time_variants",
]

short_error = _short
fmt = _fmt

# measure(shape, mode, device, warmup, iters, seed) -> the row's measured fields (timings, ratios, numerics, ...).
Measure = Callable[[Shape, Mode, str, int, int, int], dict[str, Any]]


@dataclass(frozen=True)
class Spec:
    """What distinguishes one benchmark: its names, variants, ratios, targets, table and extra summary."""

    name: str  # result-file prefix: <name>-<gpu>-<UTC time>.json
    schema: str
    description: str  # the script's docstring, shown by --help
    variants: Mapping[str, str]  # variant -> what exactly it runs (recorded in the config)
    ratios: Mapping[str, tuple[str, str]]  # ratio -> (numerator, denominator) variant medians
    headline: str  # the ratio the targets apply to
    targets: Mapping[str, float]  # mode -> goal for the geometric mean of the headline ratio
    row_fields: Sequence[str]  # measured row keys besides ratios, null in rows that failed
    table: Sequence[tuple[str, str, str]]  # (header, key, format) of the per-mode table
    legend: str  # one line above each table
    config: Mapping[str, Any] = field(default_factory=dict)  # more to record in the config
    # Extra summary fields from one mode's rows (skipped ones left out) and a line printing them; both optional.
    summarize_extra: Callable[[Sequence[dict[str, Any]]], dict[str, Any]] | None = None
    describe_extra: Callable[[dict[str, Any]], str] | None = None


# --------------------------------------------------------------------------------------------------------------
# Command line


def parse_args(spec: Spec, argv: Sequence[str] | None) -> argparse.Namespace:
    """bench_forward's command line: --modes, --benchmark-cudnn, --quick, --device, --out, --warmup, --iters, ..."""
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
        args.modes = _mode_list(args.modes)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    warmup, iters = DEFAULT_COUNTS[args.device]
    args.warmup = warmup if args.warmup is None else args.warmup
    args.iters = iters if args.iters is None else args.iters
    if args.warmup < 0 or args.iters < 1:
        parser.error("--warmup must be >= 0 and --iters >= 1")
    return args


# --------------------------------------------------------------------------------------------------------------
# Pieces of a measurement


def cold_call(fn: Callable[[], Any], device: str) -> tuple[dict[str, Any], Any]:
    """Wall time of ``fn``'s first call after clearing the plan cache, with the cache statistics around it.

    Returns (record, fn's result), the result None where the call failed (the record then holds the error).
    Out-of-memory propagates: the row becomes ``oom``, as in bench_forward.
    """
    record: dict[str, Any] = {"cache_cleared": cache_clear()}
    before = cache_info()
    try:
        ms, result = wall_ms(fn, device)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as error:  # noqa: BLE001 - recorded; the other variants still run
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
    return record, result


def check_all(checks: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """Several ``bench_forward.check_numerics`` results as one: passed if all passed, the failures named."""
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
        errors["numerics"] = _short(error)
        return None


def time_variants(
    variants: Mapping[str, Callable[[], Any]], errors: dict[str, str], warmup: int, iters: int, device: str
) -> dict[str, dict[str, Any]]:
    """Call every variant once (cudnn.benchmark autotunes here), then time the ones that worked side by side.

    Variants already in ``errors`` are left out; new failures are added to it.
    """
    errors.update(probe(dict(variants), skip=list(errors)))
    runnable = {name: fn for name, fn in variants.items() if name not in errors}
    return time_side_by_side(runnable, warmup, iters, device) if runnable else {}


def ratios(spec: Spec, timings: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """The spec's ratios of median times; None where a side was not measured."""
    out: dict[str, float | None] = {}
    for name, (num, den) in spec.ratios.items():
        a, b = timings.get(num), timings.get(den)
        out[name] = a["median_ms"] / b["median_ms"] if a and b and b["median_ms"] > 0 else None
    return out


# --------------------------------------------------------------------------------------------------------------
# One row


def empty_row(spec: Spec) -> dict[str, Any]:
    """Every key a row can have, null: failed rows keep the same keys as measured ones."""
    return {
        "status": None,
        "error": None,
        "variant_errors": {},
        "timings": {},
        **{name: None for name in spec.ratios},
        **{name: None for name in spec.row_fields},
        "numerics": None,
    }


def run_case(
    spec: Spec, measure: Measure, requested: Shape, mode: Mode, benchmark: bool, args: argparse.Namespace
) -> dict[str, Any]:
    """One row: a shape under a mode and cudnn.benchmark setting; failures become the status, never an exception.

    Grad mode stays on (unlike the forward benchmark): these benchmarks build autograd graphs.
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
        with mode_flags(mode, cudnn_benchmark=benchmark):
            row.update(measure(shape, mode, args.device, args.warmup, args.iters, args.seed))
    except torch.cuda.OutOfMemoryError as error:
        row.update(status="oom", error=_short(error))
    except Exception as error:  # noqa: BLE001 - one broken shape must not lose the rest of the run
        row.update(status="error", error=_short(error))
    free_memory(args.device)
    return row


# --------------------------------------------------------------------------------------------------------------
# Summaries, printing, plot


def summarize_rows(spec: Spec, rows: Sequence[dict[str, Any]], mode: str, benchmark: bool) -> dict[str, Any]:
    """Geomeans of every ratio, worst shape, shapes below 1.0x and the target verdicts for one mode and setting.

    A missing shape (error, OOM) makes a verdict impossible (None, printed INCOMPLETE), never a pass.
    """
    key = spec.headline
    mine = [r for r in rows if r["mode"] == mode and r["cudnn_benchmark"] == benchmark and r["status"] != "skipped"]
    measured = [r for r in mine if r[key] is not None]
    missing = [r["label"] for r in mine if r[key] is None]
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
        "worst_shape": worst["label"] if worst else None,
        f"worst_{key}": worst[key] if worst else None,
        "below_1x": len(below),
        "below_1x_shapes": below,
        "numerics_failures": [r["label"] for r in mine if r["numerics"] and not r["numerics"]["passed"]],
        f"target_geomean_{key}": target,
        "target_geomean_pass": None if target is None or missing or geo is None else geo >= target,
        "target_no_shape_below_1x_pass": None if missing or not mine else not below,
    }
    if spec.summarize_extra is not None:
        summary.update(spec.summarize_extra(mine))
    return summary


def print_summary(spec: Spec, summary: dict[str, Any]) -> None:
    key = spec.headline
    target = summary[f"target_geomean_{key}"]
    goal = f"target >= {target:.2f}x {_verdict(summary['target_geomean_pass'])}" if target else "no target"
    others = "; ".join(f"{name} {_fmt(summary[f'geomean_{name}'])}" for name in spec.ratios if name != key)
    print(
        f"{summary['mode']:>5} bench={_bench_name(summary['cudnn_benchmark']):<3} "
        f"geomean {key} {_fmt(summary[f'geomean_{key}'])}x ({goal}); {others}"
    )
    print(
        f"{'':>15}worst {summary['worst_shape']} {_fmt(summary[f'worst_{key}'])}x; "
        f"below 1.0x: {summary['below_1x']}/{summary['measured']} "
        f"(target 0 {_verdict(summary['target_no_shape_below_1x_pass'])}); "
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
    return flat


def print_mode_table(spec: Spec, rows: Sequence[dict[str, Any]], mode: str, benchmark: bool) -> None:
    print(f"\n== {spec.name}: {mode}, cudnn.benchmark={_bench_name(benchmark)}: median ms ==")
    print(spec.legend)
    mine = [r for r in rows if r["mode"] == mode and r["cudnn_benchmark"] == benchmark]
    print_table([display_row(spec, r) for r in mine], spec.table)
    for r in mine:
        if r["status"] == "skipped":
            continue
        problems = {**r["variant_errors"], **({"row": r["error"]} if r["error"] else {})}
        for what, message in problems.items():
            print(f"  {r['label']}: {what}: {message}")
        if r["numerics"] and not r["numerics"]["passed"]:
            print(f"  {r['label']}: numerics: {r['numerics']['message']}")


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
        num, den = spec.ratios[spec.headline]
        ax.set_ylabel(f"{spec.headline} = {num} / {den}", fontsize=8)
        ax.set_title(f"cudnn.benchmark={_bench_name(benchmark)}; dotted: geomean targets; 0: not measured", fontsize=9)
        ax.legend(fontsize=8)
    env = results["environment"]
    fig.suptitle(f"convbias {spec.name}, {env['gpu']}, torch {env['torch']}, commit {str(env['commit'])[:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------------------
# The whole run


def warm_up_backward(selected: Sequence[Mode], device: str) -> None:
    """Load the backward kernels once (bench_forward's warm-up covers the forward), so that the first shape's
    cold call measures plan building rather than library loading."""
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
                print(f"backward warm-up in {mode.name} failed: {_short(error)}", file=sys.stderr)
    synchronize(device)


def new_results(spec: Spec, args: argparse.Namespace, suite: Sequence[Shape]) -> dict[str, Any]:
    """The JSON document's head: schema, environment, config (what was asked and how it is defined)."""
    return {
        "schema": spec.schema,
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
            "variants": list(spec.variants),
            "variant_definitions": dict(spec.variants),
            "ratios": {name: f"{a} / {b}" for name, (a, b) in spec.ratios.items()},
            "targets": {f"geomean_{spec.headline}": dict(spec.targets), "max_shapes_below_1x": 0},
            "optional_api": {n: hasattr(torch_convbias, n) for n in ("cache_clear", "cache_info", "explain")},
            # The extension's knobs (e.g. which param_grad path runs) change what "ours" measures.
            "knobs": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCH_CONVBIAS_")},
            **spec.config,
        },
        "complete": False,
    }


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
    settings = {"on": [True], "off": [False], "both": [True, False]}[args.benchmark_cudnn]
    suite = QUICK_SUITE if args.quick else SUITE
    started = time.perf_counter()
    results = new_results(spec, args, suite)
    env = results["environment"]
    print(
        f"bench_{spec.name}: {env['gpu']}, torch {env['torch']}, cuDNN {env['cudnn']}, commit {env['commit']} "
        f"(dirty={env['dirty']}); device {args.device}, warmup {args.warmup}, iters {args.iters}"
    )
    path = result_path(results, args.out, spec.name)
    warm_up_device(selected, args.device)
    warm_up_backward(selected, args.device)
    if before is not None:
        results.update(before())
    results.update(rows=[], summaries=[])
    for benchmark in settings:
        for mode in selected:
            for i, shape in enumerate(suite):
                begin = time.perf_counter()
                row = run_case(spec, measure, shape, mode, benchmark, args)
                results["rows"].append(row)
                print(
                    f"[{mode.name} bench={_bench_name(benchmark)}] {i + 1}/{len(suite)} {shape.label}: "
                    f"{row['status']}, {spec.headline} {_fmt(row[spec.headline])} "
                    f"({time.perf_counter() - begin:.1f}s)",
                    flush=True,
                )
                # Rewritten after every shape so that a run killed half-way still leaves its results.
                write_json(results, args.out, spec.name, path)
            print_mode_table(spec, results["rows"], mode.name, benchmark)
    results["summaries"] = [summarize_rows(spec, results["rows"], m.name, b) for b in settings for m in selected]
    results["complete"] = True
    results["wall_seconds"] = time.perf_counter() - started
    write_json(results, args.out, spec.name, path)
    num, den = spec.ratios[spec.headline]
    print(f"\n== {spec.name} summary ({spec.headline} = {num} / {den}) ==")
    for summary in results["summaries"]:
        print_summary(spec, summary)
    if args.plot:
        png = plot(spec, results, path.with_suffix(".png"))
        if png:
            print(f"plot: {png}")
    print(f"results: {path} ({results['wall_seconds']:.0f}s)")
    return 0
