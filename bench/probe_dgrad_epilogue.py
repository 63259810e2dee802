"""Probe (issue 14): the input gradient with the previous layer's ReLU derivative as a cuDNN epilogue.

In a stack conv -> bias -> ReLU -> conv -> ..., the backward of a layer computes dx = conv_dgrad(dy, w); the layer
below then needs dz = dx * (y > 0) (y its ReLU output) and its bias gradient sum(dz). Today that is the dgrad (ATen's
cuDNN call) followed by our fused derivative + bias-gradient pass (reads dx and y, writes dz: 6 bytes per bf16
element). With the derivative in the dgrad graph's epilogue the graph writes dz directly and the bias gradient is a
plain reduction of dz (2 bytes per element); or the reduction in the graph too. This measures, per shape and dtype:

================  ==================================================================================================
aten_dgrad        ``aten.convolution_backward(..., output_mask=[True, False, False])``: the dgrad alone
today             aten_dgrad, then ``convbias._activation_backward(dx, y, "relu", 0, True)`` (dz and db)
graph_dgrad       the best plan of a cuDNN graph of the dgrad alone (the same graph machinery, no epilogue)
epilogue          the best plan of conv_dgrad -> RELU_BWD(y) (writes dz), then ``convbias._bias_grad(dz, "kernel")``
epilogue_reduce   the best plan of conv_dgrad -> RELU_BWD(y) -> ADD reduction (writes dz and db), where one builds
================  ==================================================================================================

Every plan the heuristics offer (A, FALLBACK; runtime-compiled ones included) is built and timed once; the best is
then timed against the others interleaved (``common.time_side_by_side``) and back to back. dz and db of each route
are checked against float64. Run on a GPU: ``python -m bench.probe_dgrad_epilogue [--out DIR]``; needs the cuDNN
frontend headers (``CUDNN_FRONTEND_INCLUDE_DIR`` or the ``nvidia-cudnn-frontend`` package) and compiles the probe
(``bench/probe_dgrad_epilogue.cpp``, ~100 s) unless ``--prebuilt`` names one compiled by ``--build-only``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .common import add_timing_arguments, environment, geomean, short_error, time_back_to_back, time_side_by_side, write_json

NAME = "dgrad_epilogue"
HERE = Path(__file__).resolve().parent
# (N, C, H, W, K, kernel, stride, padding): C is the lower layer's channels (dz's), K the upper layer's (dy's).
SHAPES = [
    (1024, 64, 32, 32, 64, 3, 1, 1),
    (1024, 128, 16, 16, 128, 3, 1, 1),
    (256, 64, 56, 56, 64, 3, 1, 1),
    (128, 128, 112, 112, 128, 3, 1, 1),  # VGG-11's second block at batch 128 (C=K=128 for the probe)
    (128, 256, 56, 56, 256, 3, 1, 1),
    (256, 512, 7, 7, 512, 3, 1, 1),
]
MODES = {"bf16": (torch.bfloat16, False), "fp16": (torch.float16, False), "tf32": (torch.float32, True),
         "fp32": (torch.float32, False)}


def load_prebuilt(path: Path) -> Any:
    """Import a probe module compiled earlier (``--build-only``) for this Python and torch."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dgrad_epilogue_probe", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"probe_dgrad_epilogue: {path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_probe(build_directory: str | None = None) -> Any:
    """Compile the C++ probe (into `build_directory`, else a new temporary one) and import it. The compile takes
    ~100 s of one core on the H200's host: ``--build-only`` beforehand (elsewhere, same Python and torch) and
    ``--prebuilt`` save that device time."""
    from torch.utils.cpp_extension import load

    import nvidia.cudnn

    cudnn_root = Path(list(nvidia.cudnn.__path__)[0])
    frontend = os.environ.get("CUDNN_FRONTEND_INCLUDE_DIR")
    if not frontend:
        import importlib.metadata

        frontend = str(importlib.metadata.distribution("nvidia-cudnn-frontend").locate_file("include"))
    # The frontend's runtime-compiled engines call NVRTC: its header and library, from torch's CUDA wheels (as
    # setup.py finds them) or the toolkit.
    from torch.utils.cpp_extension import CUDA_HOME

    major = (torch.version.cuda or "13").split(".")[0]
    roots = [cudnn_root.parent / f"cu{major}", cudnn_root.parent / "cuda_nvrtc", Path(CUDA_HOME or "/usr/local/cuda")]
    includes = [str(r / "include") for r in roots if (r / "include" / "nvrtc.h").is_file()]
    nvrtc = [d for r in roots for d in (r / "lib", r / "lib64") if (d / f"libnvrtc.so.{major}").exists()]
    links = [f"-L{nvrtc[0]}", f"-l:libnvrtc.so.{major}", f"-Wl,-rpath,{nvrtc[0]}"] if nvrtc else []
    return load(
        name="dgrad_epilogue_probe",
        sources=[str(HERE / "probe_dgrad_epilogue.cpp")],
        extra_include_paths=[str(cudnn_root / "include"), frontend, *includes],
        extra_ldflags=[f"-L{cudnn_root / 'lib'}", "-l:libcudnn.so.9", *links],
        extra_cflags=["-O2"],
        with_cuda=True,
        build_directory=build_directory or tempfile.mkdtemp(prefix="dgrad_probe_"),
        verbose=False,
    )


def say(*parts: object) -> None:
    """Progress on stderr, flushed: a crash inside cuDNN leaves the last step it reached."""
    print("probe:", *parts, file=sys.stderr, flush=True)


def best_plan(probe: Any, pid: int, run: Callable[[int], None], tries: int = 5) -> tuple[int | None, list[dict]]:
    """Each built plan of probe `pid` run once (a failure recorded), then timed: the fastest plan's index."""
    timings = []
    for index in probe.built_plans(pid):
        say("running plan", index)
        try:
            run(index)
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - recorded per plan
            timings.append({"index": index, "error": short_error(error)})
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(tries):
            run(index)
        end.record()
        end.synchronize()
        timings.append({"index": index, "ms": start.elapsed_time(end) / tries})
    ran = [t for t in timings if "ms" in t]
    return (min(ran, key=lambda t: t["ms"])["index"] if ran else None), timings


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def measure_row(probe: Any, shape: tuple[int, ...], mode: str, args: argparse.Namespace) -> dict[str, Any]:
    n, c, h, w_, k, r, stride, pad = shape
    dtype, tf32 = MODES[mode]
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    g = torch.Generator(device="cuda").manual_seed(0)
    cl = torch.channels_last
    y = torch.relu(torch.randn(n, c, h, w_, device="cuda", generator=g)).to(dtype).contiguous(memory_format=cl)
    weight = (torch.randn(k, c, r, r, device="cuda", generator=g) / (c * r * r) ** 0.5).to(dtype).contiguous(memory_format=cl)
    ho = (h + 2 * pad - r) // stride + 1
    wo = (w_ + 2 * pad - r) // stride + 1
    dy = torch.randn(n, k, ho, wo, device="cuda", generator=g).to(dtype).contiguous(memory_format=cl)
    row: dict[str, Any] = {"mode": mode, "shape": dict(zip("n c h w k kernel stride padding".split(), shape)),
                           "label": f"N{n} C{c} {h}x{w_} K{k} k{r}s{stride}p{pad}", "graphs": {}, "errors": {}}

    def aten_dgrad() -> torch.Tensor:
        return torch.ops.aten.convolution_backward(
            dy, y, weight, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1, [True, False, False])[0]

    def today() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.convbias._activation_backward(aten_dgrad(), y, "relu", 0.0, True)

    fns: dict[str, Callable[[], Any]] = {"aten_dgrad": aten_dgrad, "today": today}
    outputs: dict[str, torch.Tensor] = {}
    db = torch.empty(1, c, 1, 1, device="cuda", dtype=torch.float32)
    for variant, name in ((0, "graph_dgrad"), (1, "epilogue"), (2, "epilogue_reduce")):
        start = time.perf_counter()
        say(row["label"], mode, "building", name)
        try:
            pid, info = probe.build(dy, weight, y, stride, pad, variant, tf32)
        except Exception as error:  # noqa: BLE001 - recorded per graph
            row["errors"][name] = short_error(error)
            continue
        info = json.loads(info)
        info["build_seconds"] = time.perf_counter() - start
        row["graphs"][name] = info
        if pid < 0:
            continue
        out = torch.empty_like(y)
        outputs[name] = out

        def run(index: int, pid: int = pid, out: torch.Tensor = out) -> None:
            probe.execute(pid, index, dy, weight, y, out, db)

        index, timings = best_plan(probe, pid, run)
        info["plan_timings"] = timings
        info["best_index"] = index
        if index is None:
            continue
        if variant == 0:
            fns[name] = lambda run=run, index=index: run(index)
        elif variant == 1:
            fns[name] = lambda run=run, index=index, out=out: (run(index), torch.ops.convbias._bias_grad(out, "kernel"))
        else:
            fns[name] = lambda run=run, index=index: run(index)
    # Numerics against float64: dz and db (dgrad alone: dx).
    dx64 = torch.nn.grad.conv2d_input(tuple(y.shape), weight.double(), dy.double(), stride=stride, padding=pad)
    dz64 = dx64 * (y.double() > 0)
    db64 = dz64.sum((0, 2, 3))
    checks: dict[str, Any] = {}
    dz_today, db_today = today()
    checks["today"] = {"dz": rel_error(dz_today, dz64), "db": rel_error(db_today.flatten(), db64)}
    for name in ("graph_dgrad", "epilogue", "epilogue_reduce"):
        if name not in fns:
            continue
        result = fns[name]()
        torch.cuda.synchronize()
        want = dx64 if name == "graph_dgrad" else dz64
        checks[name] = {"dz": rel_error(outputs[name], want)}
        if name == "epilogue":
            checks[name]["db"] = rel_error(result[1].flatten(), db64)
        if name == "epilogue_reduce":
            checks[name]["db"] = rel_error(db.flatten(), db64)
    row["rel_errors"] = checks
    del dx64, dz64
    per_call = time_side_by_side(fns, args.warmup, args.iters, "cuda")
    stream = time_back_to_back(fns, args.calls, args.repeats, "cuda")
    for name in fns:
        row[f"{name}_ms"] = stream[name]["median_ms"]
        row[f"{name}_call_ms"] = per_call[name]["median_ms"]
    for name in ("epilogue", "epilogue_reduce"):
        if name in fns:
            row[f"today_over_{name}"] = row["today_ms"] / row[f"{name}_ms"]
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["bf16", "tf32"], choices=list(MODES))
    parser.add_argument("--shapes", type=int, nargs="*", default=None, help="indices into SHAPES (default all)")
    add_timing_arguments(parser, warmup=3, iters=20, calls=10, repeats=5)
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; rows stop once exceeded")
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    parser.add_argument("--build-only", metavar="DIR", help="compile the probe into DIR and stop (no GPU needed; set "
                        "TORCH_CUDA_ARCH_LIST without one)")
    parser.add_argument("--prebuilt", metavar="SO", help="the module --build-only compiled (DIR/dgrad_epilogue_probe.so)")
    args = parser.parse_args(argv)
    if args.build_only:
        Path(args.build_only).mkdir(parents=True, exist_ok=True)
        load_probe(args.build_only)
        print(f"probe_dgrad_epilogue: built {Path(args.build_only) / 'dgrad_epilogue_probe.so'}")
        return 0
    if not torch.cuda.is_available():
        print("probe_dgrad_epilogue: needs a CUDA GPU")
        return 2
    import torch_convbias  # noqa: F401 - registers torch.ops.convbias

    begin = time.perf_counter()
    say("loading" if args.prebuilt else "compiling")
    probe = load_prebuilt(Path(args.prebuilt)) if args.prebuilt else load_probe()
    say("compiled in", round(time.perf_counter() - begin, 1), "s")
    compiled = time.perf_counter() - begin
    rows = []
    shapes = [SHAPES[i] for i in args.shapes] if args.shapes else SHAPES
    results = {"environment": environment(), "config": {**vars(args), "shapes": shapes}, "compile_seconds": compiled,
               "rows": rows}
    for mode in args.modes:
        for shape in shapes:
            if time.perf_counter() - begin > args.budget:
                break
            try:
                row = measure_row(probe, shape, mode, args)
            except Exception as error:  # noqa: BLE001 - a row's failure is a result
                row = {"mode": mode, "shape": list(shape), "error": short_error(error)}
            rows.append(row)
            print(mode, row.get("label", shape), {k: round(v, 3) for k, v in row.items() if k.endswith("_ms") or k.startswith("today_over")},
                  {g: (i.get("failure") or f"{sum(p['built'] for p in i.get('plans', []))}/{i.get('offered')} built")
                   for g, i in row.get("graphs", {}).items()}, row.get("errors") or "", flush=True)
            results["summary"] = {
                m: {f"geomean_today_over_{v}": geomean(r.get(f"today_over_{v}") for r in rows if r["mode"] == m)
                    for v in ("epilogue", "epilogue_reduce")}
                for m in args.modes
            }
            write_json(results, args.out, NAME)
    print("summary", results.get("summary"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
