"""Helpers shared by the benchmarks: environment record, timing, numeric modes, numerics checks, JSON output,
tables and the small formatting helpers of their printed output.

Timings are medians of per-iteration measurements after warm-up (CUDA events on the GPU, ``perf_counter`` on
the CPU). Variants that are compared with each other are timed side by side, interleaved in one loop, so that
clock or thermal drift during a run affects all of them alike.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import hashlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------------------------------------------
# Environment


def _git(*args: str) -> str | None:
    """Output of a read-only git command in the repository, or None where git or .git is unavailable."""
    try:
        # GIT_OPTIONAL_LOCKS=0: `git status` must not take index.lock while someone else commits.
        done = subprocess.run(
            ["git", *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def git_commit() -> dict[str, Any]:
    """The commit being measured.

    The GPU machine receives the tree without .git, so the commit can be handed over in the environment
    variable ``TORCH_CONVBIAS_COMMIT``; ``dirty`` is then unknown (None).
    """
    # The variable first: a run builds from a tree handed over with its commit named (the GPU machine gets no .git,
    # and a stale .git copied along would name another commit).
    from_env = os.environ.get("TORCH_CONVBIAS_COMMIT")
    if from_env:
        return {"commit": from_env, "dirty": None, "commit_source": "env:TORCH_CONVBIAS_COMMIT"}
    # Only this repository's own .git: a tree copied inside some other checkout must not report that one's commit.
    commit = _git("rev-parse", "HEAD") if (REPO_ROOT / ".git").exists() else None
    if commit:
        status = _git("status", "--porcelain")
        return {"commit": commit, "dirty": bool(status) if status is not None else None, "commit_source": "git"}
    return {"commit": "unknown", "dirty": None, "commit_source": "unknown"}


def source_digest(root: Path = REPO_ROOT) -> str | None:
    """The sources a build of this tree compiles (csrc/ and setup.py), hashed as dev.sh's build stamp hashes them
    (``sources=`` in a prebuild's stamp.txt; tests/test_dev_prebuilt.py checks the two agree). Names what ran even
    where the commit cannot be known or was handed over wrong; None without csrc/."""
    if not (root / "csrc").is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted([*(root / "csrc").rglob("*"), root / "setup.py"], key=lambda p: p.relative_to(root)):
        if path.is_file():
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _extension_versions() -> dict[str, Any] | str:
    """torch_convbias.versions() (cuDNN compiled against / loaded, frontend), or the error that prevented it."""
    try:
        import torch_convbias

        return dict(torch_convbias.versions())
    except Exception as error:  # noqa: BLE001 - an environment record must not fail the benchmark
        return f"unavailable: {type(error).__name__}: {error}"


def _gpu() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"gpu": "cpu", "gpu_capability": None, "gpu_memory_gib": None, "gpu_count": 0}
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_capability": f"{props.major}.{props.minor}",
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "gpu_count": torch.cuda.device_count(),
    }


def environment() -> dict[str, Any]:
    """What a result depends on: commit, GPU, torch/CUDA/cuDNN versions, extension versions, UTC time.

    Deliberately without the host name: results are committed to the repository.
    """
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        **git_commit(),
        "sources": source_digest(),
        **_gpu(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "torch_convbias": _extension_versions(),
        # The extension's knobs change what "ours" measures (which path, how choices are made).
        "knobs": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCH_CONVBIAS_") and k != "TORCH_CONVBIAS_COMMIT"},
        "python": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "cpu_threads": torch.get_num_threads(),
        "timestamp_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


# --------------------------------------------------------------------------------------------------------------
# Numeric modes


# The activation modules of the baseline, by the op's activation names.
ACTIVATION_MODULES: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "leaky_relu": lambda: nn.LeakyReLU(0.01),
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
}


@dataclass(frozen=True)
class Mode:
    """A dtype plus the math flags it runs under; ``tf32`` is float32 with TF32 tensor cores allowed."""

    name: str
    dtype: torch.dtype
    tf32: bool
    # Largest relative RMS error, ||actual - reference||_2 / ||reference||_2, against a float64 reference computed
    # from the same (rounded) inputs: the dtype's output rounding (bf16 ~1e-3, fp16 ~1.4e-4) and TF32's input
    # rounding (~5e-4) with room. A dropped bias (the benchmarks draw it from N(0, 1), like the input) moves it by
    # ~0.5-1, a missing term of the sum by far more than these.
    rel_rms: float


_MODES: dict[str, Mode] = {
    "fp32": Mode("fp32", torch.float32, tf32=False, rel_rms=1e-5),
    "tf32": Mode("tf32", torch.float32, tf32=True, rel_rms=4e-3),
    "bf16": Mode("bf16", torch.bfloat16, tf32=False, rel_rms=1.2e-2),
    "fp16": Mode("fp16", torch.float16, tf32=False, rel_rms=2e-3),
}


def modes() -> dict[str, Mode]:
    """The numeric modes by name: fp32 (TF32 off), tf32, bf16, fp16."""
    return dict(_MODES)


@contextlib.contextmanager
def mode_flags(mode: Mode, cudnn_benchmark: bool | None = None) -> Iterator[None]:
    """Set TF32 (cuDNN and matmul) for ``mode`` and optionally cudnn.benchmark; restore all on exit."""
    saved = (
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.benchmark,
    )
    torch.backends.cudnn.allow_tf32 = mode.tf32
    torch.backends.cuda.matmul.allow_tf32 = mode.tf32
    if cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = cudnn_benchmark
    try:
        yield
    finally:
        (
            torch.backends.cudnn.allow_tf32,
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.benchmark,
        ) = saved


def rel_rms_tolerance(mode: Mode, terms: int = 1) -> float:
    """The bound on the relative RMS error of a result that sums `terms` products: the mode's, or FP32 accumulation's
    random-walk error (4 * 2^-24 * sqrt(terms)) where that is larger. Only strict fp32 weight and bias gradients of
    long reductions reach it: measured on the H200, both nn.Conv2d's and ours at 1.3e-5 - 5e-5 for 65k-1M terms."""
    return max(mode.rel_rms, 4 * 2.0**-24 * terms**0.5)


def check_against_float64(actual: torch.Tensor, reference: torch.Tensor, mode: Mode, terms: int = 1) -> dict[str, Any]:
    """``actual`` against a float64 ``reference`` (computed from the same rounded inputs): relative RMS error within
    ``rel_rms_tolerance(mode, terms)``. Unlike an atol scaled by max|reference|, this fails a forward that dropped a
    bias of the output's magnitude (tests/test_bench_smoke.py checks that it does). Records the outcome, never
    raises."""
    tolerance = rel_rms_tolerance(mode, terms)
    result: dict[str, Any] = {"rel_rms_tolerance": tolerance, "reference": "float64", "terms": terms}
    if actual.shape != reference.shape:
        return {**result, "passed": False, "message": f"shape {list(actual.shape)} != {list(reference.shape)}"}
    difference = actual.detach().double() - reference.detach().double().to(actual.device)
    norm = reference.detach().double().norm().item()
    rel_rms = difference.norm().item() / norm if norm > 0 else difference.norm().item()
    result["rel_rms_error"] = rel_rms
    if not rel_rms <= tolerance:  # NaN fails too
        return {**result, "passed": False, "message": f"relative RMS error {rel_rms:.3g} > {tolerance:.3g}"}
    return {**result, "passed": True, "message": None}


# --------------------------------------------------------------------------------------------------------------
# Timing


def summarize(samples_ms: Sequence[float]) -> dict[str, float | int]:
    """Median (the reported figure), min, max, mean, quartiles and IQR of per-iteration times."""
    ordered = sorted(samples_ms)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {
        "median_ms": statistics.median(ordered),
        "min_ms": ordered[0],
        "max_ms": ordered[-1],
        "mean_ms": statistics.fmean(ordered),
        "q1_ms": q1,
        "q3_ms": q3,
        "iqr_ms": q3 - q1,
        "iters": len(ordered),
    }


def _rotations(names: Sequence[str], iters: int) -> Iterator[tuple[int, list[str]]]:
    """Per iteration, the variants in a rotated order, so none always runs right after the same other one."""
    for i in range(iters):
        k = i % len(names)
        yield i, list(names[k:]) + list(names[:k])


def _use_cuda(device: str | torch.device | None) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def time_side_by_side(
    fns: Mapping[str, Callable[[], object]],
    warmup: int,
    iters: int,
    device: str | torch.device | None = None,
) -> dict[str, dict[str, float | int]]:
    """Time several variants interleaved: per iteration each runs once, its time measured on its own.

    On CUDA each call sits between two events and the host synchronizes once at the end, so the queue stays
    full and the events measure GPU time (plus launch gaps where the host cannot keep up, which is real cost
    for small problems). On the CPU the calls are synchronous and timed with ``perf_counter``.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    names = list(fns)
    cuda = _use_cuda(device)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    if cuda:
        torch.cuda.synchronize()
        events = {
            name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
            for name in names
        }
        for i, order in _rotations(names, iters):
            for name in order:
                start, end = events[name][i]
                start.record()
                fns[name]()
                end.record()
        torch.cuda.synchronize()
        samples = {name: [start.elapsed_time(end) for start, end in events[name]] for name in names}
    else:
        samples = {name: [] for name in names}
        for _, order in _rotations(names, iters):
            for name in order:
                begin = time.perf_counter()
                fns[name]()
                samples[name].append((time.perf_counter() - begin) * 1e3)
    return {name: summarize(samples[name]) for name in names}


def time_back_to_back(
    fns: Mapping[str, Callable[[], object]],
    calls: int,
    repeats: int,
    device: str | torch.device | None = None,
) -> dict[str, dict[str, float | int]]:
    """Throughput: the time per call of ``calls`` calls queued back to back, one sample per repeat (variants
    interleaved per repeat), summarized like :func:`time_side_by_side`.

    One untimed call runs ahead of the start event, so the GPU is busy while the timed calls are enqueued: the
    figure is the GPU's time per call (or the host's, where the host cannot keep up), without the launch latency
    that a per-call event pair on an idle GPU also measures. The right figure for bandwidth; per-call events are
    the right one for the cost of one call among others.
    """
    if calls < 1 or repeats < 1:
        raise ValueError(f"calls and repeats must be >= 1, got {calls} and {repeats}")
    names = list(fns)
    cuda = _use_cuda(device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _, order in _rotations(names, repeats):
        for name in order:
            fn = fns[name]
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                fn()
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) / calls)
            else:
                begin = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples[name].append((time.perf_counter() - begin) * 1e3 / calls)
    return {name: summarize(samples[name]) for name in names}


def gpu_kernels(steps: Sequence[Callable[[], Any]], device: str) -> dict[str, float] | None:
    """GPU time (ms) per kernel name of running each of `steps` once, from the profiler, largest first; None on the
    CPU. Tells where a step's GPU time goes (which kernels a side runs, and what each costs)."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for step in steps:
            step()
        synchronize(device)
    per_kernel: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.self_device_time_total / 1e3
    return dict(sorted(per_kernel.items(), key=lambda item: -item[1]))


def gpu_kernel_ms(steps: Sequence[Callable[[], Any]], device: str) -> float | None:
    """GPU kernel time (ms) of running each of `steps` once, from the profiler; None on the CPU."""
    kernels = gpu_kernels(steps, device)
    return None if kernels is None else sum(kernels.values())


def back_to_back_ms(step: Callable[[], Any], repeat: int, device: str) -> float:
    """ms per step of `repeat` steps queued back to back after one warm step."""
    step()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeat
    begin = time.perf_counter()
    for _ in range(repeat):
        step()
    return (time.perf_counter() - begin) * 1e3 / repeat


def capture_replay(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured once in a CUDA graph (after three calls on a side stream, PyTorch's capture recipe); returns
    the graph's replay: the GPU work of ``fn`` alone, without the host time of launching it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_cuda(
    fn: Callable[[], object], warmup: int, iters: int, device: str | torch.device | None = None
) -> dict[str, float | int]:
    """Median and spread of ``fn``'s time per call (CUDA events; ``perf_counter`` on the CPU)."""
    return time_side_by_side({"fn": fn}, warmup, iters, device)["fn"]


def synchronize(device: str | torch.device | None = None) -> None:
    if _use_cuda(device):
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    """Return cached blocks between shapes so one large shape's leftovers cannot push the next into OOM."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def wall_ms(fn: Callable[[], object], device: str | torch.device | None = None) -> tuple[float, object]:
    """Wall time of one synchronized call (for cold first calls, where events would miss host work)."""
    synchronize(device)
    begin = time.perf_counter()
    result = fn()
    synchronize(device)
    return (time.perf_counter() - begin) * 1e3, result


# --------------------------------------------------------------------------------------------------------------
# Statistics, output


def geomean(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the positive finite values; None when there are none (missing ratios are skipped)."""
    logs = [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    return math.exp(statistics.fmean(logs)) if logs else None


def to_jsonable(value: Any) -> Any:
    """Recursively turn torch objects, tuples and non-finite floats into plain JSON (NaN/inf become None)."""
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, torch.Size)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return to_jsonable(value.item())
    return str(value)


def slug(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def result_path(results: Mapping[str, Any], out_dir: str | Path | None, name: str) -> Path:
    """``<out_dir or bench/results>/<name>-<gpu-slug>.json``: one current file per benchmark and GPU, which a new run
    replaces (the run's commit, date and versions are inside; older runs live in git history)."""
    env = results.get("environment", {})
    gpu = env.get("gpu") or ("cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(0))
    return Path(out_dir or RESULTS_DIR) / f"{name}-{slug(gpu)}.json"


def write_json(results: Mapping[str, Any], out_dir: str | Path | None, name: str, path: Path | None = None) -> Path:
    """Write ``results`` as JSON (see :func:`result_path` for the name); rewrite ``path`` when given.

    Writing to a temporary file first keeps the previous complete version if the process dies mid-write.
    """
    target = path or result_path(results, out_dir, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(to_jsonable(results), indent=1) + "\n")
    tmp.replace(target)
    return target


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, fmt)
    return str(value)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> None:
    """Print ``rows`` as an aligned text table; ``columns`` are (header, key, format spec such as '.3f')."""
    cells = [[header for header, _, _ in columns]]
    cells += [[_cell(row.get(key), fmt) for _, key, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for n, line in enumerate(cells):
        # Text left-aligned (first column), numbers right-aligned.
        print(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        )
        if n == 0:
            print("  ".join("-" * w for w in widths))


def short_error(error: BaseException) -> str:
    """An exception as one line for the JSON and the log: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:500]


def fmt(value: float | None, spec: str = ".2f") -> str:
    """A number for a printed line, ``-`` where it was not measured."""
    return "-" if value is None else format(value, spec)


def verdict(passed: bool | None) -> str:
    """A target's outcome as printed: PASS, MISS, or INCOMPLETE where a missing shape leaves no verdict."""
    return {True: "PASS", False: "MISS", None: "INCOMPLETE"}[passed]


def bench_name(benchmark: bool) -> str:
    """A cudnn.benchmark setting as printed: on or off."""
    return "on" if benchmark else "off"


def add_timing_arguments(parser: argparse.ArgumentParser, warmup: int, iters: int, calls: int, repeats: int) -> None:
    """The options of benchmarks timing variants per call (:func:`time_side_by_side`: --warmup, --iters) and back
    to back (:func:`time_back_to_back`: --calls, --repeats), with a benchmark's defaults."""
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--iters", type=int, default=iters, help="per-call samples per variant, interleaved")
    parser.add_argument("--calls", type=int, default=calls, help="calls queued back to back per throughput sample")
    parser.add_argument("--repeats", type=int, default=repeats, help="throughput samples per variant")


def add_probe_arguments(
    parser: argparse.ArgumentParser, modes: Sequence[str], warmup: int, iters: int, calls: int, repeats: int
) -> None:
    """The options every probe takes: --modes (default ``modes``), --device, the timing options, --budget and --out."""
    parser.add_argument("--modes", nargs="+", default=list(modes), choices=list(_MODES))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    add_timing_arguments(parser, warmup=warmup, iters=iters, calls=calls, repeats=repeats)
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; rows stop once exceeded")
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")


def say(*parts: object) -> None:
    """A probe's progress, time-stamped and flushed (a device run cut short still shows the last step it reached)."""
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def probe_can_run(args: argparse.Namespace, prog: str) -> bool:
    """Whether a probe can run on ``args.device`` (saying why not), torch.ops.convbias registered when it can."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA GPU (or --device cpu)")
        return False
    import torch_convbias  # noqa: F401 - registers torch.ops.convbias

    return True


def run_probe_rows(
    args: argparse.Namespace,
    results: dict[str, Any],
    stem: str,
    items: Iterable[Any],
    label: Callable[[Any], Sequence[object]],
    measure: Callable[[Any, Mode], dict[str, Any]],
    failed_row: Callable[[Any], dict[str, Any]],
    report: Callable[[str, dict[str, Any]], None],
    summarize: Callable[[list[dict[str, Any]]], dict[str, Any]],
) -> str | None:
    """A probe's rows: each of ``args.modes`` over ``items`` under the mode's flags and cudnn.benchmark, until
    ``args.budget`` seconds are spent. ``measure(item, mode)`` gives a row, appended to ``results["rows"]``; one that
    raises is a result too (``failed_row(item)`` with the mode and the error). After each row: ``report(mode_name,
    row)`` prints it, ``results["summary"] = summarize(rows)``, and the JSON is written (``stem``-<gpu>.json under
    ``args.out``), so a run cut short keeps what it measured. Prints the summary and the path; returns the path."""
    rows: list[dict[str, Any]] = results["rows"]
    path = None
    items = list(items)
    begin = time.perf_counter()
    for name in args.modes:
        mode = modes()[name]
        for item in items:
            if time.perf_counter() - begin > args.budget:
                say("budget spent: stopping")
                break
            say(name, *label(item))
            try:
                with mode_flags(mode, cudnn_benchmark=True):
                    row = measure(item, mode)
            except Exception as error:  # noqa: BLE001 - an item's failure is a result
                row = {**failed_row(item), "mode": name, "error": short_error(error)}
            rows.append(row)
            free_memory(args.device)
            report(name, row)
            results["summary"] = summarize(rows)
            path = write_json(results, args.out, stem)
    print("summary", results.get("summary"))
    print("results:", path or "none")
    return path
