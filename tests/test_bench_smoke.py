"""Smoke tests of the forward benchmark's logic on the CPU (tiny shapes; the timings themselves mean nothing)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# The benchmarks are a package at the repository root, which pytest does not put on sys.path by itself.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch_convbias  # noqa: E402
from conftest import HAS_CUDA  # noqa: E402
from bench import bench_forward, common  # noqa: E402

ENV_KEYS = {"commit", "dirty", "gpu", "torch", "cuda", "cudnn", "torch_convbias", "timestamp_utc"}
ROW_KEYS = {
    "mode",
    "cudnn_benchmark",
    "label",
    "shape",
    "status",
    "timings",
    "speedup_cl",
    "speedup_nchw",
    "fused_over_conv_only",
    "vs_torch_conv_only",
    "numerics",
    "first_call_ms",
    "explain",
    "plan_cache",
}
SUMMARY_KEYS = {
    "mode",
    "cudnn_benchmark",
    "geomean_speedup_cl",
    "geomean_speedup_nchw",
    "worst_shape",
    "worst_speedup_cl",
    "below_1x",
    "target_geomean_pass",
    "target_no_shape_below_1x_pass",
}
FAST = ["--device", "cpu", "--quick", "--iters", "2", "--warmup", "1"]


def run(tmp_path: Path, *extra: str) -> dict[str, Any]:
    assert bench_forward.main([*FAST, "--out", str(tmp_path), *extra]) == 0
    files = list(tmp_path.glob("forward-*.json"))  # named after the GPU when one is visible
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_quick_cpu_run_writes_complete_json(tmp_path: Path) -> None:
    plot = importlib.util.find_spec("matplotlib") is not None
    results = run(tmp_path, *(["--plot"] if plot else []))

    assert results["complete"] is True
    assert ENV_KEYS <= set(results["environment"])
    # The environment describes the machine (its GPU, if any); the device the run used is in the config.
    machine_gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    assert results["environment"]["gpu"] == machine_gpu
    assert results["config"]["device"] == "cpu"
    modes = ["fp32", "tf32", "bf16"]
    labels = [s.label for s in bench_forward.QUICK_SUITE]
    assert [(r["mode"], r["label"]) for r in results["rows"]] == [(m, label) for m in modes for label in labels]
    for row in results["rows"]:
        assert ROW_KEYS <= set(row), row["label"]
        assert row["status"] == "ok", (row["label"], row["error"], row["variant_errors"])
        assert row["shape"]["n"] == bench_forward.CPU_BATCH
        assert set(row["timings"]) == set(bench_forward.VARIANTS)
        assert all(t["median_ms"] > 0 and t["iters"] == 2 for t in row["timings"].values())
        assert row["speedup_cl"] > 0 and row["first_call_ms"] > 0
        assert row["numerics"]["passed"], row["numerics"]
        assert row["out_channels_last"] is True
    assert [s["mode"] for s in results["summaries"]] == modes
    for summary in results["summaries"]:
        assert SUMMARY_KEYS <= set(summary)
        assert summary["measured"] == len(labels) and summary["geomean_speedup_cl"] > 0
    assert next(tmp_path.glob("*.json")).with_suffix(".png").exists() == plot


def test_shapes_selects_part_of_the_suite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--shapes runs only the suite's shapes at those indices (to finish a run cut short), recorded as its suite;
    an index outside the suite is refused, naming the range."""
    assert bench_forward.main([*FAST, "--modes", "fp32", "--shapes", "1", "--out", str(tmp_path)]) == 0
    results = json.loads(next(tmp_path.glob("forward-*.json")).read_text())
    wanted = bench_forward.QUICK_SUITE[1]
    assert [row["label"] for row in results["rows"]] == [wanted.label]
    assert results["config"]["suite"] == [dataclasses.asdict(wanted)]
    assert results["summaries"][0]["missing"] == [] and results["complete"] is True
    size = len(bench_forward.QUICK_SUITE)
    with pytest.raises(SystemExit):
        bench_forward.main([*FAST, "--shapes", str(size), "--out", str(tmp_path)])
    assert f"--shapes: expected indices from 0 to {size - 1}" in capsys.readouterr().err


def test_1x1_gemm_probe_on_cpu(tmp_path: Path) -> None:
    """probe_1x1_gemm's ways (our op, conv2d, addmm, addmm with the relu epilogue) agree with the float64 matmul, keep
    channels_last, and only 1x1 / stride 1 / unpadded shapes of the suites are probed."""
    from bench import probe_1x1_gemm

    shapes = probe_1x1_gemm.one_by_one_shapes()
    assert shapes and all((s.kernel, s.stride, s.pad) == (1, 1, 0) for s in shapes)
    assert probe_1x1_gemm.main(["--device", "cpu", "--modes", "fp32", "--iters", "1", "--warmup", "0", "--calls", "1",
                                "--repeats", "1", "--out", str(tmp_path)]) == 0
    results = json.loads(next(tmp_path.glob("gemm_1x1-*.json")).read_text())
    relu = next(r for r in results["rows"] if r["activation"] == "relu")
    assert set(relu["numerics"]) == {"ours", "cudnn", "mm", "mm_epilogue"}
    assert all(check["passed"] for row in results["rows"] for check in row["numerics"].values())
    assert all(all(row["layout_kept"].values()) for row in results["rows"])
    assert results["summary"]["fp32"]["numerics_failures"] == []


def test_optional_api_is_recorded_and_oom_is_per_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With cache_clear/cache_info/explain present their results land in the JSON; an OOM costs one row."""
    state = {"misses": 0, "build_seconds": 0.0}
    monkeypatch.setattr(torch_convbias, "cache_clear", lambda: None, raising=False)
    info = {"hits": 0, "size": 0, "capacity": 8}
    monkeypatch.setattr(torch_convbias, "cache_info", lambda: {**state, **info}, raising=False)
    monkeypatch.setattr(torch_convbias, "explain", lambda *args, **kwargs: {"path": "fake", "engine": 7}, raising=False)
    real_make_problem = bench_forward.make_problem

    def make_problem(shape: bench_forward.Shape, *args: Any) -> bench_forward.Problem:
        if shape.c == 1024:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        state["misses"] += 1
        state["build_seconds"] += 0.25
        return real_make_problem(shape, *args)

    monkeypatch.setattr(bench_forward, "make_problem", make_problem)
    results = run(tmp_path, "--modes", "fp32")

    ok, _, oom = results["rows"]
    assert ok["explain"] == {"path": "fake", "engine": 7}
    assert ok["plan_cache"]["cache_cleared"] is True
    assert ok["plan_cache"]["cache_after"]["capacity"] == 8
    assert oom["status"] == "oom" and "simulated" in oom["error"] and oom["speedup_cl"] is None
    summary = results["summaries"][0]
    assert summary["missing"] == [oom["label"]] and summary["target_geomean_pass"] is None


def test_helpers() -> None:
    assert common.geomean([2.0, 8.0, None]) == pytest.approx(4.0)
    assert common.geomean([]) is None
    stats = common.summarize([3.0, 1.0, 2.0, 4.0])
    assert stats["median_ms"] == 2.5 and stats["min_ms"] == 1.0 and stats["iqr_ms"] == pytest.approx(1.5)
    assert common.slug("NVIDIA H200") == "nvidia-h200"
    env = {"gpu": "NVIDIA H200", "timestamp_utc": "2025-01-02T03:04:05Z"}
    path = common.result_path({"environment": env}, "x", "forward")
    assert path == Path("x/forward-nvidia-h200.json")  # one current file per benchmark and GPU
    before = torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark
    with common.mode_flags(common.modes()["tf32"], cudnn_benchmark=not before[1]):
        assert torch.backends.cudnn.allow_tf32 is True and torch.backends.cudnn.benchmark is not before[1]
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark) == before
    assert common.time_cuda(lambda: None, warmup=1, iters=3, device="cpu")["iters"] == 3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU"))])
def test_time_back_to_back_times_each_variant_in_batches(device: str) -> None:
    counts = {"a": 0, "b": 0}

    def call(name: str) -> None:
        counts[name] += 1
        torch.ones(8, device=device).sum()

    stats = common.time_back_to_back({"a": lambda: call("a"), "b": lambda: call("b")}, calls=4, repeats=3, device=device)
    assert set(stats) == {"a", "b"} and all(s["iters"] == 3 and s["median_ms"] > 0 for s in stats.values())
    # Per repeat: `calls` timed calls, plus on CUDA one untimed call ahead of the start event.
    assert counts == {name: 3 * (4 + (device == "cuda")) for name in counts}
    with pytest.raises(ValueError, match="calls and repeats must be >= 1, got 0 and 3"):
        common.time_back_to_back({"a": lambda: None}, calls=0, repeats=3, device="cpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given without a GPU")
def test_bias_grad_bench_says_it_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import bench_bias_grad

    assert bench_bias_grad.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given without a GPU")
def test_activation_pass_bench_says_it_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import bench_activation_pass

    assert bench_activation_pass.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given without a GPU")
def test_dgrad_epilogue_probe_says_it_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import probe_dgrad_epilogue

    assert probe_dgrad_epilogue.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_activation_pass_bench_sizes_and_summary() -> None:
    """bench_activation_pass measures only the suite's outputs of at least --min-mib in the dtype (each once), and its
    summary takes the geomean and the smallest ratio per dtype and activation."""
    from bench import bench_activation_pass, harness

    big = list(bench_activation_pass.large_outputs(128 << 20, torch.bfloat16))
    assert big and len(set(big)) == len(big)
    assert all(n * k * h * w * 2 >= 128 << 20 for n, k, h, w in big)
    every = {(s.n, s.k, *s.out_hw) for s in harness.SUITE}
    assert set(big) < every and set(bench_activation_pass.large_outputs(0, torch.bfloat16)) == every
    # float32 doubles the bytes: every bf16 row is a float32 row too
    assert set(big) <= set(bench_activation_pass.large_outputs(128 << 20, torch.float32))
    rows = [{"dtype": "bf16", "activation": "gelu", "graph_over_aten": g, "graph_vs_copy": c, "aten_vs_copy": a}
            for g, c, a in ((1.2, 0.9, 0.75), (1.5, 1.0, 0.6))]
    (summary,) = bench_activation_pass.summarize_rows(rows)
    assert summary["shapes"] == 2 and summary["min_graph_over_aten"] == 1.2 and summary["min_aten_vs_copy"] == 0.6
    assert summary["geomean_graph_over_aten"] == pytest.approx((1.2 * 1.5) ** 0.5)


def test_stress_memory_smoke(tmp_path: Path) -> None:
    """bench/stress_memory.py on the CPU: samples at the requested interval, a verdict, the JSON written."""
    from bench import stress_memory

    assert stress_memory.main(["--device", "cpu", "--calls", "40", "--every", "20", "--pool", "6", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("stress_memory-*.json")
    results = json.loads(path.read_text())
    assert [s["calls"] for s in results["samples"]] == [0, 20, 40]
    assert all(s["max_rss_mib"] > 0 for s in results["samples"])
    assert results["verdict"]["cache_bounded"] is True and results["verdict"]["allocated_bounded"] is None
    assert isinstance(results["verdict"]["rss_bounded"], bool)
    # The verdict's RSS bound is real: a run whose resident memory grows past the tolerance is not bounded.
    grown = [dict(s, max_rss_mib=100.0 + 50 * i) for i, s in enumerate(results["samples"])]
    assert stress_memory.verdict(grown, 64, 64.0)["rss_bounded"] is False
    # The last half's growth tells a leak (still growing) from memory that levelled off.
    assert stress_memory.verdict(grown, 64, 64.0)["rss_growth_last_half_mib"] == 50.0
    levelled = [dict(s, max_rss_mib=100.0 + 50 * min(i, 1)) for i, s in enumerate(results["samples"])]
    assert stress_memory.verdict(levelled, 64, 64.0)["rss_growth_last_half_mib"] == 0.0


def test_numerics_check_fails_a_forward_that_dropped_the_bias() -> None:
    """Every variant is checked against float64 with a tolerance a missing bias fails: here ours_cl computed
    without its bias (all else right) must fail, in every mode, while the real variants pass."""
    from bench import harness

    small = harness.Shape(n=2, c=16, h=6, w=6, k=16, kernel=3, stride=1, pad=1)
    for name, mode in common.modes().items():
        if name == "fp16":
            continue  # CPU half convolutions are not what the benchmark measures
        with torch.no_grad(), common.mode_flags(mode):
            problem = bench_forward.make_problem(small, mode, "cpu", seed=0)
            outputs = {variant: fn() for variant, fn in problem.variants().items()}
            expected = bench_forward.references(problem)
            good = bench_forward.check_outputs(outputs, expected, mode)
            assert good["passed"], (name, good["message"])
            dropped = problem.ours(problem.x_cl, problem.w_cl, None)
            bad = bench_forward.check_outputs({**outputs, "ours_cl": dropped}, expected, mode)
        assert not bad["passed"] and "ours_cl" in bad["message"], (name, bad)


def test_forward_activation_block_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--activation relu: ours, ours compiled, nn eager and nn compiled side by side (torch.cudnn_convolution_relu
    joins with --device cuda), each checked against float64 relu(conv), the headline against compiled nn."""
    from bench import harness

    monkeypatch.setattr(harness, "QUICK_SUITE", harness.QUICK_SUITE[:1])
    assert bench_forward.main([*FAST, "--modes", "fp32", "--activation", "relu", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("forward_relu-*.json")
    results = json.loads(path.read_text())
    (row,) = results["rows"]
    assert row["status"] == "ok", row["variant_errors"]
    expected = set(bench_forward.ACTIVATION_VARIANTS) - {"torch_cudnn_relu"}  # a CUDA op: not on --device cpu
    assert set(row["timings"]) == expected == set(row["numerics"]["checks"])
    assert row["numerics"]["passed"] and row["speedup_vs_compiled"] > 0 and row["vs_compiled_back_to_back"] > 0
    assert row["explain"]["activation"]["name"] == "relu" and row["explain"]["path"] == "aten", row["explain"]
    (summary,) = results["summaries"]
    # The targets are on GPU time (CUDA-graphed): on the CPU there is no graph, so no verdict, never a pass.
    assert summary["target_geomean_graphed_vs_compiled"] == bench_forward.ACTIVATION_TARGETS["fp32"]
    assert row["graphed_vs_compiled"] is None and summary["target_geomean_pass"] is None
    assert summary["geomean_speedup_vs_compiled"] == pytest.approx(row["speedup_vs_compiled"])
    # bench.resummarize recomputes the same summaries from the rows (the file's name says which spec), noting it.
    from bench import resummarize

    again = resummarize.resummarize(path)
    assert again["summaries"] == json.loads(json.dumps(results["summaries"]))
    assert json.loads(path.read_text())["summaries_recomputed"]["headline"] == "graphed_vs_compiled"
    with pytest.raises(SystemExit, match="not a forward_"):
        resummarize.spec_of(path.with_name("forward-cpu.json"))
    # bench.merge_results: a later run's row replaces the row measuring the same thing, and the summary follows it.
    from bench import merge_results

    rerun = json.loads(path.read_text())
    rerun["rows"][0]["speedup_vs_compiled"] = 2.5
    rerun["environment"]["commit"] = "later"
    rerun_path = tmp_path / "rerun" / path.name
    rerun_path.parent.mkdir()
    rerun_path.write_text(json.dumps(rerun))
    assert merge_results.main([str(path), str(rerun_path), "--note", "re-measured"]) == 0
    merged = json.loads(path.read_text())
    assert [row["speedup_vs_compiled"] for row in merged["rows"]] == [2.5]
    assert merged["summaries"][0]["geomean_speedup_vs_compiled"] == pytest.approx(2.5)
    assert [run["environment"]["commit"] for run in merged["merged_runs"]][-1] == "later"
    assert merged["merged_runs"][-1]["note"] == "re-measured" and len(merged["merged_runs"]) == 2
    # A shape of the run's suite with no row at all (a run cut short) is missing too: no verdict from the rest.
    suite = merged["config"]["suite"] + [dict(merged["config"]["suite"][0], n=3)]
    spec = resummarize.spec_of(path)
    cut = harness.summarize_rows(spec, merged["rows"], "fp32", merged["rows"][0]["cudnn_benchmark"], suite)
    # (On the CPU the measured row has no CUDA-graphed headline: missing already.)
    assert cut["missing"] == [*merged["summaries"][0]["missing"], harness.Shape(**suite[-1]).label]
    assert cut["shapes"] == 1 and cut["target_no_shape_below_1x_pass"] is None


def test_bias_grad_bench_activation_variants_agree_on_cpu() -> None:
    """The activation-backward table's variants compute the same thing (the op runs its CPU kernel here; two_pass
    needs the CUDA bias kernel), and its summary gives a verdict only from large rows."""
    from bench import bench_bias_grad

    for name, (activation, slope, from_output) in bench_bias_grad.ACTIVATIONS.items():
        z = torch.randn(2, 8, 3, 3).contiguous(memory_format=torch.channels_last)
        dy = torch.randn_like(z)
        saved = torch.ops.convbias.forward(z, torch.eye(8).reshape(8, 8, 1, 1), None, [1, 1], [0, 0], [1, 1], 1,
                                           activation, slope) if from_output else z
        fns = bench_bias_grad.activation_variants(dy, saved, name)
        assert set(fns) == {"fused", "two_pass", "aten", "copy"}
        fused, aten = fns["fused"](), fns["aten"]()
        torch.testing.assert_close(fused[0], aten[0], msg=name)
        torch.testing.assert_close(fused[1], aten[1], msg=name)
    row = {"large": True, "fused_way": "fused kernel", "fused_vs_copy_stream": 0.9,
           **{f"{v}{s}_fraction": 0.85 for v in bench_bias_grad.ACTIVATION_VARIANTS for s in ("", "_stream")}}
    summary = bench_bias_grad.activation_summary([row, {**row, "large": False, "fused_stream_fraction": 0.1}])
    assert summary["target_pass"] is True and summary["fused_min_stream_fraction_large"] == 0.85
    assert summary["fused_ran_everywhere"] is True and summary["fused_vs_copy_stream_min_large"] == 0.9


def test_activation_blocks_run_gpu_bound_shapes() -> None:
    """Issue 13's activation blocks: N >= 1024 wherever the output is 32x32 or smaller (a host-bound row would hide the
    pointwise pass the epilogue saves); larger images keep the suite's N; no shape twice."""
    from bench import bench_layerwise, harness

    for spec in (bench_forward.forward_activation_spec("relu"), bench_layerwise.activation_spec("gelu")):
        assert spec.suite == harness.ACTIVATION_SUITE
    assert len(set(harness.ACTIVATION_SUITE)) == len(harness.ACTIVATION_SUITE)
    for shape in harness.ACTIVATION_SUITE:
        assert shape.n >= 1024 or shape.h * shape.w > 32 * 32, shape
    assert {(s.c, s.h, s.k, s.kernel) for s in harness.SUITE} == {(s.c, s.h, s.k, s.kernel) for s in harness.ACTIVATION_SUITE}


def test_forward_residual_ending_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--activation relu --residual: relu(conv + bias + residual), torchvision's block ending, every side checked
    against float64 (a side that dropped the residual would fail); torch.cudnn_convolution_add_relu joins on CUDA."""
    from bench import harness

    monkeypatch.setattr(harness, "QUICK_SUITE", harness.QUICK_SUITE[:1])
    assert bench_forward.main([*FAST, "--modes", "fp32", "--activation", "relu", "--residual", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("forward_residual_relu-*.json")
    results = json.loads(path.read_text())
    assert results["config"]["residual"] is True
    (row,) = results["rows"]
    assert row["status"] == "ok", row["variant_errors"]
    expected = set(bench_forward.RESIDUAL_VARIANTS) - {"torch_cudnn_add_relu"}  # a CUDA op
    assert set(row["timings"]) == expected == set(row["numerics"]["checks"])
    assert row["numerics"]["passed"] and row["speedup_vs_compiled"] > 0
    assert row["fused_ending_vs_ours_compiled"] is None  # no cuDNN op on the CPU
    # explain(..., residual=r) recorded: how ours added the residual (on the CPU, ATen's reference, no graph).
    assert row["explain"]["path"] == "aten" and row["explain"]["residual"]["fused"] is False, row["explain"]
    # Each ending side's kernels (profiler) are recorded on CUDA; on the CPU there are none.
    assert set(row["kernels"]) == {"ours", "torch_compiled"} and row["kernels"]["ours"] is None, row["kernels"]
    # bench.resummarize (and so merge_results) reads the file's name as the residual spec, not an activation's.
    from bench import resummarize

    assert resummarize.spec_of(path) == bench_forward.forward_activation_spec("relu", residual=True)
    assert resummarize.resummarize(path)["summaries"] == json.loads(json.dumps(results["summaries"]))
    assert bench_forward.main(["--residual", *FAST]) == 2  # a residual needs an activation


def test_forward_residual_reference_catches_a_dropped_residual() -> None:
    """The residual ending's float64 check fails a side that left the residual out."""
    torch.manual_seed(0)
    mode = common.modes()["bf16"]
    conv = torch.nn.Conv2d(8, 8, 3, padding=1).double()
    x = torch.randn(2, 8, 8, 8, dtype=torch.float64)
    residual = torch.randn(2, 8, 8, 8, dtype=torch.float64)
    block = bench_forward.ResidualEnding(conv, torch.nn.ReLU())
    with torch.no_grad():
        reference = torch.relu(conv(x) + residual)
        assert common.check_against_float64(block(x, residual.clone()), reference, mode)["passed"]
        assert not common.check_against_float64(torch.relu(conv(x)), reference, mode)["passed"]
