"""Cold-start benchmark: the latency of the FIRST forward and the FIRST param_grad call of a new problem, without
and with the persistent plan cache (``TORCH_CONVBIAS_PLAN_CACHE_DIR``).

A new shape's first call builds its plans: a precompiled cuDNN engine costs about a millisecond, a runtime-compiled
(NVRTC) one 0.05-5 s (the cuDNN bias-reduction graph of ``TORCH_CONVBIAS_BIAS_GRAD=cudnn`` 0.15-0.7 s), and timing
the candidates runs each a few times. The persistent cache lets a later process load those plans instead. Knobs
are read once per process, so every measurement is a fresh process (a worker: this module with ``--worker``):

==================  ================================================================================================
``cold``            no ``TORCH_CONVBIAS_PLAN_CACHE_DIR``: plans built in memory only (what every process paid before)
``cold_writing``    an empty directory as ``TORCH_CONVBIAS_PLAN_CACHE_DIR``: builds like ``cold`` and writes the plans
``warm_from_disk``  a new process on the directory ``cold_writing`` filled: plans loaded (and validated) from disk
==================  ================================================================================================

Only timed choices are written to the plan directory, so a problem without ``cudnn.benchmark`` runs its processes
with ``TORCH_CONVBIAS_AUTOTUNE=quick`` (its first three engine candidates timed) unless its own knobs say otherwise.
Each worker first initialises CUDA and then runs a warm-up problem of a shape no problem of the suite has (in the
problem's dtype, layout and flags), so that the process's one-off costs (CUDA context, cuDNN handle, the first
heuristics query: 110-160 ms, the first cuDNN execution: ~28 ms) are reported apart, as ``cuda_init_ms`` and
``process_first_call_ms``. Then, synchronised wall time (``torch.cuda.synchronize`` before and after) of the
problem's first ``convbias::forward`` and first ``convbias::param_grad(..., [True, True])``, and the median of
``--repeats`` later calls of each (the warm in-memory figure); ``cache_info()`` after the warm-up and at the end
(their difference: the problem's own plan builds, disk hits, writes, rejections). Each problem gets its own plan
directory (so ``cold_writing`` always starts empty and its warm-up plans are its own).

Run from the repository root::

    python -m bench.bench_cold_start --out bench/results                       # GPU: 8 problems x 3 processes, minutes
    python -m bench.bench_cold_start --problems cl_bf16_3x3 bias_grad_cudnn    # a subset by name
    python -m bench.bench_cold_start --device cpu --quick --out /tmp/cs        # smoke run (CPU: no plans, times
                                                                               # meaningless, disk counters 0)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import torch_convbias

from .common import (
    REPO_ROOT,
    environment,
    fmt,
    mode_flags,
    modes,
    print_table,
    short_error,
    synchronize,
    wall_ms,
    write_json,
)
from .harness import CPU_BATCH, Shape, cache_info

NAME = "cold_start"
SCHEMA = "torch_convbias.cold_start/1"
PLAN_CACHE_ENV = "TORCH_CONVBIAS_PLAN_CACHE_DIR"
SCENARIOS: dict[str, str] = {
    "cold": f"no {PLAN_CACHE_ENV}: plans built in memory only",
    "cold_writing": f"an empty directory as {PLAN_CACHE_ENV}: plans built and written",
    "warm_from_disk": "a new process on the directory cold_writing filled: plans loaded from disk",
}
# The disk counters the C++ side reports in cache_info() (read with .get: absent from older builds).
DISK_KEYS = ("disk_hits", "disk_misses", "disk_writes", "disk_rejected")
DEFAULT_WORKER_TIMEOUT_S = 600


# --------------------------------------------------------------------------------------------------------------
# The suite


@dataclass(frozen=True)
class Problem(Shape):
    """One convolution (harness.Shape) and the conditions of its first call: dtype mode, layout, knobs,
    cudnn.benchmark. Made with :func:`problem` (name first)."""

    name: str = ""
    mode: str = "fp32"  # a common.modes() name: fp32 is TF32 off
    channels_last: bool = True
    env: Mapping[str, str] = field(default_factory=dict)  # TORCH_CONVBIAS_* knobs of this problem's processes
    cudnn_benchmark: bool = False

    @property
    def geometry(self) -> tuple[int, ...]:
        return (self.n, self.c, self.h, self.w, self.k, self.kernel, self.stride, self.pad)

    @property
    def label(self) -> str:
        layout = "cl" if self.channels_last else "nchw"
        extra = "".join(f" {k.removeprefix('TORCH_CONVBIAS_').lower()}={v}" for k, v in self.env.items())
        bench = " cudnn.benchmark" if self.cudnn_benchmark else ""
        return f"{self.mode} {layout} {super().label}{extra}{bench}"

    def on(self, device: str) -> Problem:
        """The problem as run on ``device``: on the CPU the batch is capped (only the pipeline is exercised there)."""
        return self if device == "cuda" else dataclasses.replace(self, n=min(self.n, CPU_BATCH))


def problem(name: str, n: int, c: int, h: int, w: int, k: int, kernel: int, stride: int, pad: int, mode: str,
            **conditions: Any) -> Problem:
    """A named problem: the geometry in harness.Shape's order, then the mode and other conditions."""
    return Problem(n, c, h, w, k, kernel, stride, pad, name=name, mode=mode, **conditions)


BIAS_GRAD_CUDNN = {"TORCH_CONVBIAS_BIAS_GRAD": "cudnn"}

# Every problem a distinct geometry (and distinct from the warm-up's): whatever the plan keys hold besides the
# shape, no problem's plans can serve another's first call.
SUITE: tuple[Problem, ...] = (
    problem("cl_fp32_3x3", 64, 128, 28, 28, 128, 3, 1, 1, "fp32"),
    problem("cl_bf16_3x3", 128, 64, 56, 56, 64, 3, 1, 1, "bf16"),
    problem("cl_fp32_1x1", 32, 64, 56, 56, 256, 1, 1, 0, "fp32"),
    problem("cl_bf16_1x1", 256, 256, 14, 14, 64, 1, 1, 0, "bf16"),
    problem("cl_bf16_3x3_s2", 128, 128, 28, 28, 256, 3, 2, 1, "bf16"),
    problem("nchw_fp32_3x3", 32, 64, 32, 32, 128, 3, 1, 1, "fp32", channels_last=False),
    # The bias gradient on a cuDNN reduction graph: runtime-compiled, 0.15-0.7 s per shape, where a disk cache pays.
    problem("bias_grad_cudnn", 64, 128, 32, 32, 128, 3, 1, 1, "bf16", env=BIAS_GRAD_CUDNN),
    # The exhaustive engine search: every engine that builds is timed on the first call.
    problem("cudnn_benchmark", 64, 256, 14, 14, 256, 3, 1, 1, "bf16", cudnn_benchmark=True),
)

# The same names on tiny shapes, for the smoke test (the CPU runs ATen's reference kernels).
QUICK_SUITE: tuple[Problem, ...] = (
    problem("cl_fp32_3x3", 2, 8, 8, 8, 8, 3, 1, 1, "fp32"),
    problem("cl_bf16_3x3", 2, 8, 12, 12, 8, 3, 1, 1, "bf16"),
    problem("cl_fp32_1x1", 2, 8, 8, 8, 16, 1, 1, 0, "fp32"),
    problem("cl_bf16_1x1", 2, 16, 6, 6, 8, 1, 1, 0, "bf16"),
    problem("cl_bf16_3x3_s2", 2, 16, 8, 8, 16, 3, 2, 1, "bf16"),
    problem("nchw_fp32_3x3", 2, 8, 10, 10, 8, 3, 1, 1, "fp32", channels_last=False),
    problem("bias_grad_cudnn", 2, 16, 8, 8, 16, 3, 1, 1, "bf16", env=BIAS_GRAD_CUDNN),
    problem("cudnn_benchmark", 2, 16, 10, 10, 16, 3, 1, 1, "bf16", cudnn_benchmark=True),
)

# The warm-up's geometry (run in each problem's dtype, layout, knobs and flags): tiny, and unlike every problem's.
WARMUP = (1, 24, 9, 9, 24, 3, 1, 1)


def suite(quick: bool) -> tuple[Problem, ...]:
    return QUICK_SUITE if quick else SUITE


def select(quick: bool, names: Sequence[str] | None) -> list[Problem]:
    """The problems named (in the suite's order), or all; an unknown name raises ValueError."""
    problems = suite(quick)
    if not names:
        return list(problems)
    known = {p.name for p in problems}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown problem(s) {unknown}; known: {sorted(known)}")
    return [p for p in problems if p.name in set(names)]


# --------------------------------------------------------------------------------------------------------------
# The worker: one process, one problem, one scenario


def make_tensors(
    geometry: Sequence[int], problem: Problem, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input, weight (scaled by 1/sqrt(fan-in): bf16 outputs stay in range) and bias in the problem's layout."""
    n, c, h, w, k, r = geometry[:6]
    dtype = modes()[problem.mode].dtype
    layout = torch.channels_last if problem.channels_last else torch.contiguous_format
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g).to(device=device, dtype=dtype).contiguous(memory_format=layout)
    weight = (torch.randn(k, c, r, r, generator=g) / math.sqrt(c * r * r)).to(device=device, dtype=dtype)
    bias = torch.randn(k, generator=g).to(device=device, dtype=dtype)
    return x, weight.contiguous(memory_format=layout), bias


def conv_args(geometry: Sequence[int]) -> tuple[list[int], list[int], list[int], int]:
    """stride, padding, dilation, groups as the ops take them."""
    stride, pad = geometry[6], geometry[7]
    return [stride, stride], [pad, pad], [1, 1], 1


def _counter(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numeric_delta(after: Mapping[str, Any] | None, before: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """after - before of every counter both have (settings such as capacity and disk_enabled left out)."""
    if not after or not before:
        return None
    return {
        key: value - before[key]
        for key, value in after.items()
        if key != "capacity" and _counter(value) and _counter(before.get(key))
    }


def engine_summary(engine: Any) -> Any:
    """The part of an explain() engine record that says what the first call paid for (None / as is otherwise)."""
    if not isinstance(engine, Mapping):
        return engine
    keys = ("name", "runtime_compiled", "from_disk", "build_seconds", "workspace_bytes")
    return {key: engine.get(key) for key in keys}


def explain_summary(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, grad: torch.Tensor, geometry: Sequence[int]
) -> dict[str, Any]:
    """Which path and engines the problem ran, and whether they came from disk (explain / explain_param_grad).

    Called after the measurements: the plans are cached by then, so this builds nothing.
    """
    stride, pad = geometry[6], geometry[7]
    record: dict[str, Any] = {}
    try:
        fwd = torch_convbias.explain(x, weight, bias, stride, pad)
        record["forward"] = {
            "path": fwd.get("path"),
            "layout": fwd.get("layout"),
            "engine": engine_summary(fwd.get("engine")),
        }
    except Exception as error:  # noqa: BLE001 - diagnostics must not lose the measurement
        record["forward"] = {"error": short_error(error)}
    try:
        grads = torch_convbias.explain_param_grad(grad, x, weight, stride, pad)
        wgrad, bgrad = grads.get("weight_grad") or {}, grads.get("bias_grad") or {}
        record["weight_grad"] = {"path": wgrad.get("path"), "engine": engine_summary(wgrad.get("engine"))}
        record["bias_grad"] = {"way": bgrad.get("way"), "engine": engine_summary(bgrad.get("engine"))}
    except Exception as error:  # noqa: BLE001
        record["param_grad"] = {"error": short_error(error)}
    return record


def worker(problem: Problem, device: str, repeats: int, seed: int) -> dict[str, Any]:
    """Measure one problem's first and warm calls in this (fresh) process; see the module docstring."""
    forward, param_grad = torch.ops.convbias.forward, torch.ops.convbias.param_grad
    mask = [True, True]
    record: dict[str, Any] = {
        "knobs": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCH_CONVBIAS_")},
    }
    with mode_flags(modes()[problem.mode], cudnn_benchmark=problem.cudnn_benchmark), torch.no_grad():
        record["cudnn_benchmark"] = torch.backends.cudnn.benchmark
        record["allow_tf32"] = torch.backends.cudnn.allow_tf32
        # The CUDA context (and the caching allocator's first block): nothing of the extension yet. Not wall_ms:
        # its synchronize ahead of the clock would create the context untimed.
        began = time.perf_counter()
        torch.ones(1, device=device).add_(1)
        synchronize(device)
        record["cuda_init_ms"] = (time.perf_counter() - began) * 1e3

        # The warm-up, in the problem's dtype, layout and flags, so its library loading is not the problem's.
        # A failing warm-up is recorded, not fatal: the problem is still measured, one-off costs included.
        record.update(warmup_forward_ms=None, warmup_param_grad_ms=None, process_first_call_ms=None, warmup_error=None)
        try:
            wx, ww, wb = make_tensors(WARMUP, problem, device, seed + 1)
            wargs = conv_args(WARMUP)
            record["warmup_forward_ms"], wout = wall_ms(lambda: forward(wx, ww, wb, *wargs), device)
            wgrad = torch.empty_like(wout).normal_()  # the output's layout, as autograd hands it over
            record["warmup_param_grad_ms"], _ = wall_ms(lambda: param_grad(wgrad, wx, ww, *wargs, mask), device)
            record["process_first_call_ms"] = record["warmup_forward_ms"] + record["warmup_param_grad_ms"]
        except Exception as error:  # noqa: BLE001 - see above
            record["warmup_error"] = short_error(error)
        after_warmup = cache_info()

        x, weight, bias = make_tensors(problem.geometry, problem, device, seed)
        args = conv_args(problem.geometry)
        record["forward_first_ms"], out = wall_ms(lambda: forward(x, weight, bias, *args), device)
        grad = torch.empty_like(out).normal_()
        record["param_grad_first_ms"], _ = wall_ms(lambda: param_grad(grad, x, weight, *args, mask), device)
        after_first = cache_info()

        # Warm: the plans are in memory now; interleaved so drift affects both alike.
        forward_ms, param_grad_ms = [], []
        for _ in range(repeats):
            forward_ms.append(wall_ms(lambda: forward(x, weight, bias, *args), device)[0])
            param_grad_ms.append(wall_ms(lambda: param_grad(grad, x, weight, *args, mask), device)[0])
        final = cache_info()
        record.update(
            forward_warm_ms=statistics.median(forward_ms),
            param_grad_warm_ms=statistics.median(param_grad_ms),
            forward_warm_samples_ms=forward_ms,
            param_grad_warm_samples_ms=param_grad_ms,
            cache_info=final,
            cache_info_after_warmup=after_warmup,
            # The problem's own plans: built, loaded from disk, written or rejected by its first calls.
            problem_cache=numeric_delta(after_first, after_warmup),
            # Calls after the first must not build anything (all zero but hits).
            warm_calls_cache=numeric_delta(final, after_first),
            explain=explain_summary(x, weight, bias, grad, problem.geometry),
        )
    record["build_seconds"] = (final or {}).get("build_seconds")
    # The whole process's disk counters (warm-up included), None each where the extension does not report it.
    record["disk_counters"] = {key: (final or {}).get(key) for key in DISK_KEYS}
    record["problem_build_seconds"] = (record["problem_cache"] or {}).get("build_seconds")
    return record


# --------------------------------------------------------------------------------------------------------------
# The driver: one worker process per (problem, scenario)


def worker_command(problem: Problem, args: argparse.Namespace, out_file: Path) -> list[str]:
    """The command line of one worker (this module, in a fresh interpreter)."""
    command = [sys.executable, "-m", "bench.bench_cold_start", "--worker", problem.name, "--worker-out", str(out_file)]
    command += ["--device", args.device, "--repeats", str(args.repeats), "--seed", str(args.seed)]
    return command + (["--quick"] if args.quick else [])


def worker_env(problem: Problem, plan_dir: Path | None) -> dict[str, str]:
    """This process's environment, the problem's knobs, and the plan directory of the scenario (none for cold:
    a directory set by whoever started the benchmark must not turn the cold scenario warm)."""
    env = {k: v for k, v in os.environ.items() if k != PLAN_CACHE_ENV}
    # Only timed choices are stored on disk (README, "Persistent plan cache"): a problem without cudnn.benchmark
    # times its first three candidates (TORCH_CONVBIAS_AUTOTUNE=quick) unless it names its own tuning.
    if not problem.cudnn_benchmark:
        env.setdefault("TORCH_CONVBIAS_AUTOTUNE", "quick")
    env.update(problem.env)
    if plan_dir is not None:
        env[PLAN_CACHE_ENV] = str(plan_dir)
    # The worker imports this checkout's torch_convbias and bench, wherever the interpreter was started.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def directory_contents(path: Path | None) -> dict[str, int] | None:
    """Files and bytes under a plan directory (what cold_writing left for warm_from_disk)."""
    if path is None or not path.is_dir():
        return None
    files = [p for p in path.rglob("*") if p.is_file()]
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def tail(text: str, chars: int = 2000) -> str | None:
    text = text.strip()
    return text[-chars:] if text else None


def run_worker(
    problem: Problem, scenario: str, plan_dir: Path | None, args: argparse.Namespace, scratch: Path
) -> dict[str, Any]:
    """One scenario of one problem in a fresh process; failures (exit status, timeout) are recorded, not raised."""
    out_file = scratch / f"{problem.name}-{scenario}.json"
    command = worker_command(problem, args, out_file)
    began = time.perf_counter()
    record: dict[str, Any] = {"status": "ok", "plan_cache_dir": None if plan_dir is None else str(plan_dir)}
    try:
        done = subprocess.run(
            command,
            cwd=REPO_ROOT,
            env=worker_env(problem, plan_dir),
            capture_output=True,
            text=True,
            timeout=args.worker_timeout,
        )
    except subprocess.TimeoutExpired as expired:
        stderr = expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) else expired.stderr
        record.update(status="timeout", error=f"worker ran over {args.worker_timeout}s", stderr=tail(stderr or ""))
    else:
        if done.returncode != 0 or not out_file.exists():
            record.update(status="error", error=f"worker exit status {done.returncode}", stderr=tail(done.stderr))
        else:
            record.update(json.loads(out_file.read_text()))
            # Warnings (an unwritable directory, a rejected file) go to stderr: kept with the measurement.
            record["stderr"] = tail(done.stderr)
    record["process_wall_s"] = time.perf_counter() - began
    record["plan_cache_dir_contents"] = directory_contents(plan_dir)
    if record["status"] == "ok":
        record["first_call_ms"] = record["forward_first_ms"] + record["param_grad_first_ms"]
        record["warm_ms"] = record["forward_warm_ms"] + record["param_grad_warm_ms"]
    return record


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def measure_problem(
    problem: Problem, args: argparse.Namespace, root: Path, progress: Callable[[str], None]
) -> dict[str, Any]:
    """The three scenarios of one problem, in order (cold_writing fills the directory warm_from_disk reads)."""
    plan_dir = root / "plans" / problem.name
    plan_dir.mkdir(parents=True, exist_ok=False)  # new and empty: cold_writing must start with nothing on disk
    scratch = root / "workers"
    scratch.mkdir(exist_ok=True)
    dirs = {"cold": None, "cold_writing": plan_dir, "warm_from_disk": plan_dir}
    scenarios: dict[str, dict[str, Any]] = {}
    for scenario in SCENARIOS:
        scenarios[scenario] = result = run_worker(problem, scenario, dirs[scenario], args, scratch)
        progress(
            f"{problem.name} {scenario}: {result['status']}, "
            f"first forward {fmt(result.get('forward_first_ms'), '.1f')} ms, "
            f"first param_grad {fmt(result.get('param_grad_first_ms'), '.1f')} ms, "
            f"disk hits {fmt((result.get('problem_cache') or {}).get('disk_hits'), 'd')} "
            f"({result['process_wall_s']:.1f}s)"
        )
        if result["status"] != "ok" and result.get("stderr"):
            progress(f"  {result['error']}: ...{result['stderr'][-600:]}")
    first = {name: s.get("first_call_ms") for name, s in scenarios.items()}
    return {
        "problem": problem.name,
        "label": problem.on(args.device).label,
        "definition": {**dataclasses.asdict(problem.on(args.device)), "env": dict(problem.env)},
        "scenarios": scenarios,
        "first_call_ratio_cold_over_disk": ratio(first["cold"], first["warm_from_disk"]),
        "first_call_ratio_writing_over_cold": ratio(first["cold_writing"], first["cold"]),
    }


# --------------------------------------------------------------------------------------------------------------
# Summary, table


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(present) if present else None


def _disk(scenario: Mapping[str, Any], key: str) -> int | None:
    """A disk counter of the problem's own first calls; None where the extension does not report it."""
    return (scenario.get("problem_cache") or {}).get(key)


def _total(values: Sequence[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians over the problems every scenario of which was measured, and the disk counters over them."""
    complete = [r for r in rows if all(r["scenarios"].get(s, {}).get("status") == "ok" for s in SCENARIOS)]

    def per_scenario(key: str) -> dict[str, float | None]:
        return {s: _median([r["scenarios"][s].get(key) for r in complete]) for s in SCENARIOS}

    first = per_scenario("first_call_ms")
    disk = [r["scenarios"]["warm_from_disk"] for r in complete]
    writing = [r["scenarios"]["cold_writing"] for r in complete]
    hits = [_disk(s, "disk_hits") for s in disk]
    return {
        "problems": len(rows),
        "measured": len(complete),
        "missing": [r["problem"] for r in rows if r not in complete],
        "cold_first_call_ms": first["cold"],
        "cold_writing_first_call_ms": first["cold_writing"],
        "warm_from_disk_first_call_ms": first["warm_from_disk"],
        "first_call_ratio_cold_over_disk": ratio(first["cold"], first["warm_from_disk"]),
        "median_problem_ratio_cold_over_disk": _median([r["first_call_ratio_cold_over_disk"] for r in complete]),
        "median_first_call_ms": first,
        "median_forward_first_ms": per_scenario("forward_first_ms"),
        "median_param_grad_first_ms": per_scenario("param_grad_first_ms"),
        "median_warm_ms": per_scenario("warm_ms"),
        "median_process_first_call_ms": per_scenario("process_first_call_ms"),
        "median_problem_build_seconds": per_scenario("problem_build_seconds"),
        "disk_hits_warm_from_disk": _total(hits),
        "problems_with_disk_hits": sum(1 for h in hits if h),
        "disk_writes_cold_writing": _total([_disk(s, "disk_writes") for s in writing]),
        "disk_rejected": _total([_disk(s, "disk_rejected") for s in [*writing, *disk]]),
    }


TABLE: tuple[tuple[str, str, str], ...] = (
    ("problem", "problem", ""),
    ("cold_ms", "cold", ".1f"),
    ("writing_ms", "cold_writing", ".1f"),
    ("disk_ms", "warm_from_disk", ".1f"),
    ("cold/disk", "ratio", ".2f"),
    ("warm_ms", "warm", ".2f"),
    ("proc_1st_ms", "process", ".1f"),
    ("build_s", "build", ".3f"),
    ("writes", "writes", "d"),
    ("hits", "hits", "d"),
    ("rejected", "rejected", "d"),
)
LEGEND = (
    "first forward + first param_grad, synchronised wall ms, per scenario; warm_ms: median later call (cold "
    "process); proc_1st_ms: the warm-up's first calls (cold); build_s: the problem's plan building (cold); "
    "writes (cold_writing), hits and rejected (warm_from_disk): the problem's disk counters"
)


def display_row(row: Mapping[str, Any]) -> dict[str, Any]:
    s = row["scenarios"]
    return {
        "problem": row["problem"],
        **{name: s[name].get("first_call_ms") for name in SCENARIOS},
        "ratio": row["first_call_ratio_cold_over_disk"],
        "warm": s["cold"].get("warm_ms"),
        "process": s["cold"].get("process_first_call_ms"),
        "build": s["cold"].get("problem_build_seconds"),
        "writes": _disk(s["cold_writing"], "disk_writes"),
        "hits": _disk(s["warm_from_disk"], "disk_hits"),
        "rejected": _disk(s["warm_from_disk"], "disk_rejected"),
    }


def print_report(results: Mapping[str, Any]) -> None:
    print(f"\n== cold start: {results['config']['device']} ==")
    print(LEGEND)
    print_table([display_row(r) for r in results["rows"]], TABLE)
    for row in results["rows"]:
        for name, s in row["scenarios"].items():
            if s["status"] != "ok":
                print(f"  {row['problem']} {name}: {s['status']}: {s.get('error')}")
            elif s.get("warmup_error"):
                print(f"  {row['problem']} {name}: warm-up failed (one-offs in the first calls): {s['warmup_error']}")
    m = results["summary"]
    firsts = ", ".join(f"{name} {fmt(m['median_first_call_ms'][name], '.1f')} ms" for name in SCENARIOS)
    print(
        f"\nmedian over {m['measured']}/{m['problems']} problems: first calls {firsts} "
        f"(cold/disk {fmt(m['first_call_ratio_cold_over_disk'])}x); "
        f"disk hits {fmt(m['disk_hits_warm_from_disk'], 'd')} ({m['problems_with_disk_hits']} problems), "
        f"writes {fmt(m['disk_writes_cold_writing'], 'd')}, rejected {fmt(m['disk_rejected'], 'd')}"
    )


# --------------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="directory for the JSON (default: bench/results)")
    parser.add_argument("--repeats", type=int, default=10, help="warm calls per op after the first (median)")
    parser.add_argument(
        "--problems", nargs="+", default=None, metavar="NAME",
        help=f"a subset by name (space- or comma-separated): {', '.join(p.name for p in SUITE)}",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test; CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--worker-timeout", type=float, default=DEFAULT_WORKER_TIMEOUT_S, help="seconds per worker process"
    )
    parser.add_argument("--keep-plans", action="store_true", help="keep the plan directories (path in the JSON)")
    parser.add_argument("--worker", default=None, metavar="NAME", help=argparse.SUPPRESS)  # internal: one process
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.problems:
        args.problems = [name for item in args.problems for name in item.split(",") if name]
    try:
        select(args.quick, args.problems)
    except ValueError as error:
        parser.error(str(error))
    if args.worker is not None and (args.worker_out is None or args.worker not in {p.name for p in suite(args.quick)}):
        parser.error("--worker needs a problem name of the suite and --worker-out")
    return args


def worker_main(args: argparse.Namespace) -> int:
    (problem,) = select(args.quick, [args.worker])
    record = worker(problem.on(args.device), args.device, args.repeats, args.seed)
    Path(args.worker_out).write_text(json.dumps(record))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0 when at least one problem was measured in every scenario, else 1."""
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_cold_start: no CUDA device; use --device cpu to smoke-test the script", file=sys.stderr)
        return 2
    problems = select(args.quick, args.problems)
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="convbias-cold-start-"))
    knobs = {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCH_CONVBIAS_")}
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "environment": environment(),
        "config": {
            "device": args.device,
            "quick": args.quick,
            "repeats": args.repeats,
            "seed": args.seed,
            "worker_timeout_s": args.worker_timeout,
            "problems": [p.name for p in problems],
            "scenarios": dict(SCENARIOS),
            "warmup_geometry": dict(zip(("n", "c", "h", "w", "k", "kernel", "stride", "pad"), WARMUP, strict=True)),
            # The knobs every worker inherits (the cold scenario without the plan directory).
            "knobs": knobs,
            "plan_root": str(root),
            "plans_kept": args.keep_plans,
        },
        "complete": False,
        "rows": [],
    }
    env = results["environment"]
    print(
        f"bench_cold_start: {env['gpu']}, torch {env['torch']}, cuDNN {env['cudnn']}, commit {env['commit']} "
        f"(dirty={env['dirty']}); device {args.device}, {len(problems)} problems x {len(SCENARIOS)} scenarios",
        flush=True,
    )
    path = None
    try:
        for i, problem in enumerate(problems):
            row = measure_problem(
                problem, args, root, lambda line, i=i: print(f"[{i + 1}/{len(problems)}] {line}", flush=True)
            )
            results["rows"].append(row)
            # Rewritten after every problem so that a run killed half-way still leaves its results.
            path = write_json(results, args.out, NAME, path)
    finally:
        if not args.keep_plans:
            shutil.rmtree(root, ignore_errors=True)
    results["summary"] = summarize(results["rows"])
    results["complete"] = True
    results["wall_seconds"] = time.perf_counter() - started
    path = write_json(results, args.out, NAME, path)
    print_report(results)
    print(f"results: {path} ({results['wall_seconds']:.0f}s)")
    return 0 if results["summary"]["measured"] else 1


if __name__ == "__main__":
    sys.exit(main())
