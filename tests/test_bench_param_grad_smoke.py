"""Smoke tests of the parameter-gradient and layer-wise benchmarks on the CPU (tiny shapes; timings mean nothing)."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

# The benchmarks are a package at the repository root, which pytest does not put on sys.path by itself.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import bench_layerwise, bench_param_grad, common, harness  # noqa: E402

FAST = ["--device", "cpu", "--quick", "--iters", "2", "--warmup", "1"]
MODES = ["fp32", "tf32", "bf16"]
LABELS = [s.label for s in harness.QUICK_SUITE]
ENV_KEYS = {"commit", "dirty", "gpu", "torch", "cuda", "cudnn", "torch_convbias", "timestamp_utc"}
CONFIG_KEYS = {"device", "modes", "benchmark_cudnn", "quick", "warmup", "iters", "suite", "variants", "targets"}
COMMON_ROW_KEYS = {"mode", "dtype", "cudnn_benchmark", "label", "shape", "status", "error", "variant_errors"}
COMMON_ROW_KEYS |= {"timings", "numerics", "speedup"}
SUMMARY_KEYS = {
    "mode",
    "cudnn_benchmark",
    "measured",
    "missing",
    "geomean_speedup",
    "worst_shape",
    "worst_speedup",
    "below_1x",
    "numerics_failures",
    "target_geomean_speedup",
    "target_geomean_pass",
    "target_no_shape_below_1x_pass",
}
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run(main: Callable[[list[str]], int], name: str, out: Path, *extra: str) -> dict[str, Any]:
    """Run a benchmark's main and load its one JSON, found by the bench's prefix (the GPU's name follows it)."""
    assert main([*FAST, "--out", str(out), *extra]) == 0
    files = list(out.glob(f"{name}-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


@pytest.fixture(scope="module")
def param_grad_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("param_grad")
    return run(bench_param_grad.main, "param_grad", out, *(["--plot"] if HAS_MATPLOTLIB else [])), out


@pytest.fixture(scope="module")
def layerwise_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("layerwise")
    return run(bench_layerwise.main, "layerwise", out, *(["--plot"] if HAS_MATPLOTLIB else [])), out


def check_document(results: dict[str, Any], variants: dict[str, str], out: Path) -> None:
    """What both benchmarks' JSON share: environment, config, one ok row per (mode, shape), summaries, plot."""
    assert results["complete"] is True and results["wall_seconds"] > 0
    assert ENV_KEYS <= set(results["environment"])
    # The environment describes the machine (a GPU box still reports its GPU); the device used is in the config.
    assert CONFIG_KEYS <= set(results["config"]) and results["config"]["device"] == "cpu"
    assert results["config"]["variants"] == list(variants)
    assert [(r["mode"], r["label"]) for r in results["rows"]] == [(m, label) for m in MODES for label in LABELS]
    for row in results["rows"]:
        assert COMMON_ROW_KEYS <= set(row), row["label"]
        assert row["status"] == "ok", (row["label"], row["error"], row["variant_errors"])
        assert row["shape"]["n"] == harness.CPU_BATCH
        assert set(row["timings"]) == set(variants)
        assert all(t["median_ms"] > 0 and t["iters"] == 2 for t in row["timings"].values())
        assert row["speedup"] > 0
        assert row["numerics"]["passed"], row["numerics"]
    assert [s["mode"] for s in results["summaries"]] == MODES
    for summary in results["summaries"]:
        assert SUMMARY_KEYS <= set(summary)
        assert summary["measured"] == len(LABELS) and summary["geomean_speedup"] > 0
        assert summary["target_geomean_pass"] in (True, False, None)
    assert next(out.glob("*.json")).with_suffix(".png").exists() == HAS_MATPLOTLIB


def test_param_grad_quick_cpu_run(param_grad_run: tuple[dict[str, Any], Path]) -> None:
    results, out = param_grad_run
    check_document(results, bench_param_grad.VARIANTS, out)
    copy = results["copy_bandwidth"]
    assert copy["error"] is None and copy["gbps"] > 0 and copy["bytes"] == bench_param_grad.COPY_BYTES["cpu"]
    for row in results["rows"]:
        assert set(bench_param_grad.RATIOS) <= set(row) and set(bench_param_grad.ROW_FIELDS) <= set(row)
        # Every variant's gradients against float64.
        assert set(row["numerics"]["checks"]) == {
            f"{variant}_{grad}" for variant in ("ours", "torch", "torch_autograd", "ours_autograd")
            for grad in ("grad_weight", "grad_bias")
        } | {"ours_bias_only_grad_bias", "torch_bias_only_grad_bias"}
        assert row["grad_weight_channels_last"] is True
        assert row["bias_gbps_ours"] > 0 and row["bias_bw_fraction_ours"] > 0 and row["bias_large"] is False
        assert row["first_call_ms"] > 0
        assert set(row["back_to_back"]) == {"ours", "torch", "ours_bias_only", "torch_bias_only"}
        assert row["speedup_back_to_back"] == pytest.approx(
            row["back_to_back"]["torch"]["median_ms"] / row["back_to_back"]["ours"]["median_ms"]
        )
    for summary in results["summaries"]:
        assert summary["measured_speedup_back_to_back"] == len(LABELS) and summary["geomean_speedup_back_to_back"] > 0
        # N=2 on the CPU: no grad_output reaches the size the bandwidth target applies to, so no verdict.
        assert summary["bias_large_shapes"] == [] and summary["target_bias_bw_pass"] is None
        assert summary["target_geomean_speedup"] == bench_param_grad.TARGETS.get(summary["mode"])


def test_layerwise_quick_cpu_run(layerwise_run: tuple[dict[str, Any], Path]) -> None:
    results, out = layerwise_run
    check_document(results, bench_layerwise.VARIANTS, out)
    assert results["config"]["optimizer"]["momentum"] == 0.9
    for row in results["rows"]:
        assert set(bench_layerwise.RATIOS) <= set(row) and set(bench_layerwise.ROW_FIELDS) <= set(row)
        checks = row["numerics"]["checks"]
        assert set(checks) == {
            f"{side}_{what}"
            for side in ("ours", "torch")
            for what in ("output", "grad_weight", "grad_bias", "weight_after_step", "bias_after_step")
        }
        assert row["forward_speedup"] > 0 and row["step_ms_saved"] is not None
        # On the CPU no CUDA graph: eager steps back to back only, and no capture attempted (so no error).
        assert set(row["back_to_back"]) == {"ours_step", "torch_step"} and row["speedup_back_to_back"] > 0
        assert row["graphed_speedup"] is None and row["graph_error"] is None
    for summary in results["summaries"]:
        assert "geomean_backward_update_speedup" in summary
        assert summary["geomean_speedup_back_to_back"] > 0 and summary["geomean_graphed_speedup"] is None
        assert summary["graph_errors"] == []
        assert summary["target_geomean_speedup"] == bench_layerwise.TARGETS[summary["mode"]]


def test_failures_stay_per_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OOM, an error and a failing variant each cost only their own row or ratio; verdicts become None."""
    real_problem, real_layers = bench_param_grad.make_problem, bench_layerwise.make_layers

    def make_problem(shape: harness.Shape, *args: Any) -> bench_param_grad.Problem:
        if shape.c == 1024:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        problem = real_problem(shape, *args)
        if shape.c == 64:
            problem.ours_out = problem.ours_out.detach()  # autograd.grad now fails: one variant, not the row
        return problem

    def make_layers(shape: harness.Shape, *args: Any) -> tuple[bench_layerwise.Layer, bench_layerwise.Layer]:
        if shape.c == 1024:
            raise RuntimeError("broken (simulated)")
        return real_layers(shape, *args)

    monkeypatch.setattr(bench_param_grad, "make_problem", make_problem)
    monkeypatch.setattr(bench_layerwise, "make_layers", make_layers)
    grads = run(bench_param_grad.main, "param_grad", tmp_path / "pg", "--modes", "fp32")
    steps = run(bench_layerwise.main, "layerwise", tmp_path / "lw", "--modes", "fp32")

    ok, partial, oom = grads["rows"]
    assert ok["status"] == "ok"
    assert partial["status"] == "partial" and set(partial["variant_errors"]) == {"ours_autograd"}
    assert partial["speedup"] > 0 and partial["autograd_speedup"] is None
    assert oom["status"] == "oom" and "simulated" in oom["error"] and oom["speedup"] is None
    assert oom["bias_bw_fraction_ours"] is None and oom["timings"] == {}
    assert grads["summaries"][0]["missing"] == [oom["label"]] and grads["summaries"][0]["target_geomean_pass"] is None
    error = steps["rows"][2]
    assert error["status"] == "error" and "broken" in error["error"] and error["step_ms_saved"] is None
    assert steps["summaries"][0]["missing"] == [error["label"]]
    assert steps["summaries"][0]["target_no_shape_below_1x_pass"] is None


def test_bias_bandwidth_verdict() -> None:
    """The bandwidth target judges grad_outputs of >= 128 MiB only, and all of them must have been measured."""
    big = harness.Shape(256, 64, 56, 56, 256, 1, 1, 0)  # grad_output 784 MiB in fp32
    small = harness.Shape(16, 16, 16, 16, 16, 3, 1, 1)

    def row(shape: harness.Shape, fraction: float | None) -> dict[str, Any]:
        return {
            "label": shape.label,
            "shape": vars(shape),
            "dtype": "float32",
            "bias_bw_fraction_ours": fraction,
            "bias_bw_fraction_torch": 0.5 if fraction is not None else None,
            # Back to back: no launch latency, so a little higher than per call.
            "bias_stream_fraction_ours": fraction + 0.02 if fraction is not None else None,
            "bias_only_speedup": 2.0 if fraction is not None else None,
        }

    summarize = bench_param_grad.summarize_bias
    assert summarize([row(big, 0.85), row(small, 0.01)])["target_bias_bw_pass"] is True
    assert summarize([row(big, 0.85), row(small, 0.01)])["bias_large_shapes"] == [big.label]
    assert summarize([row(big, 0.79), row(small, 0.9)])["target_bias_bw_pass"] is False
    assert summarize([row(big, None), row(small, 0.9)])["target_bias_bw_pass"] is None
    assert summarize([row(big, 0.79), row(small, 0.9)])["target_bias_bw_stream_pass"] is True
    assert summarize([row(big, 0.77), row(small, 0.9)])["target_bias_bw_stream_pass"] is False
    assert summarize([row(big, None), row(small, 0.9)])["target_bias_bw_stream_pass"] is None
    assert summarize([row(big, 0.79)])["bias_stream_fraction_ours_min_large"] == pytest.approx(0.81)
    assert summarize([row(small, 0.9)])["target_bias_bw_pass"] is None
    assert bench_param_grad.grad_output_bytes(big, torch.bfloat16) == 256 * 256 * 56 * 56 * 2


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_layerwise_activation_block_with_compiled_sides(
    activation: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--activation: conv + bias + activation, the nn side a Sequential, both compiled sides timed, the headline
    against the faster nn side on GPU time, numerics against float64 (the activation included). One small shape: Inductor compiles
    each side on the CPU."""
    monkeypatch.setattr(harness, "QUICK_SUITE", harness.QUICK_SUITE[:1])
    assert bench_layerwise.main([*FAST, "--modes", "fp32", "--activation", activation, "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob(f"layerwise_{activation}-*.json")
    results = json.loads(path.read_text())
    assert results["config"]["activation"] == activation
    (row,) = results["rows"]
    assert row["status"] == "ok", (row["error"], row["variant_errors"])
    assert set(row["timings"]) == set(bench_layerwise.ACTIVATION_VARIANTS)
    assert row["numerics"]["passed"], row["numerics"]
    assert row["speedup_vs_compiled"] > 0 and row["speedup_vs_best"] > 0
    assert set(row["back_to_back"]) == {"ours_step", "torch_step", "ours_compiled_step", "torch_compiled_step"}
    assert row["step_kernels_ms"] is None  # the profiler's kernel breakdown: CUDA only
    (summary,) = results["summaries"]
    # The targets apply to GPU time (CUDA-graphed steps against the faster nn side): none on the CPU, so no verdict.
    expected_target = bench_layerwise.ACTIVATION_TARGETS["fp32"] if activation == "relu" else None
    assert summary["target_geomean_graphed_vs_best"] == expected_target
    assert row["graphed_vs_best"] is None and summary["target_geomean_pass"] is None
    assert summary["geomean_speedup_vs_compiled"] == pytest.approx(row["speedup_vs_compiled"])


def test_layerwise_relu_reference_takes_the_kink_side_from_the_checked_output() -> None:
    """Through ReLU the float64 gradient is taken on the side of the kink that the checked side's own output says
    (rounding may flip a pre-activation near zero): a side whose output flips there still matches, a backward that
    ignores ReLU's derivative does not."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 8, 3, padding=1).double()
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    seed = torch.randn(2, 8, 6, 6, dtype=torch.float64)
    mode = common.modes()["bf16"]
    z = conv(x).detach()
    flipped = torch.relu(z).clone()
    near_zero = z.abs() < 0.05
    assert near_zero.any()
    # The other side of the kink, within rounding.
    flipped[near_zero] = torch.where(z[near_zero] > 0, torch.zeros_like(z[near_zero]), torch.full_like(z[near_zero], 1e-3))
    reference = bench_layerwise._float64_grads(conv, x, seed, torch.nn.ReLU(), flipped)
    w = conv.weight.detach().requires_grad_()
    b = conv.bias.detach().requires_grad_()
    out = F.conv2d(x, w, b, padding=1)
    mask = (flipped > 0).double()
    right = torch.autograd.grad(out, [w, b], seed * mask, retain_graph=True)
    ignoring_relu = torch.autograd.grad(out, [w, b], seed)
    terms = 2 * 6 * 6
    for actual, expected in zip(right, (reference["weight"], reference["bias"])):
        assert common.check_against_float64(actual, expected, mode, terms)["passed"]
    for actual, expected in zip(ignoring_relu, (reference["weight"], reference["bias"])):
        assert not common.check_against_float64(actual, expected, mode, terms)["passed"]
    # Why the reference takes the side from the output: against the exact float64 mask, the flipped side (a
    # rounding, not an error) would fail.
    exact = torch.autograd.grad(F.relu(conv(x)), [conv.weight, conv.bias], seed)
    assert not all(
        common.check_against_float64(actual, expected, mode, terms)["passed"] for actual, expected in zip(right, exact)
    )

