"""Smoke test of bench/bench_models.py's logic on the CPU: the tiny built-in model, every variant (Inductor
included), training and inference; the timings mean nothing here, the structure and the numerics check do."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import bench_models  # noqa: E402


def test_models_benchmark_runs_every_variant_on_cpu(tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--models", "tiny", "--modes", "fp32", "--warmup", "1", "--calls", "1", "--repeats", "1"]
    argv.append("--activation-backward-variant")
    assert bench_models.main([*argv, "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("models-*.json")
    results = json.loads(path.read_text())
    assert {"commit", "torch", "cudnn", "timestamp_utc"} <= set(results["environment"])
    rows = {row["phase"]: row for row in results["rows"]}
    assert set(rows) == {"train", "infer"}
    for phase, variants in (("train", bench_models.TRAIN_VARIANTS), ("infer", bench_models.INFER_VARIANTS)):
        row = rows[phase]
        extra = {"ours_backend_kernel_bwd"} if phase == "train" else set()
        assert row["status"] == "ok" and set(row["step_ms"]) == set(variants) | extra
        assert row["numerics"]["passed"], row["numerics"]
        assert row["backend_vs_nn_compiled_rate"] > 0
    # The tiny model's convolutions rewritten: in training the two with a bias (the bias-free one keeps its batch
    # norm), in inference all three (the batch norm folded into the second).
    assert rows["train"]["rewrites"] == 2 and rows["infer"]["rewrites"] == 3
    # tiny(): the three convs are followed by ReLU, BN + ReLU, GELU; BN is folded for inference only; no residual.
    assert rows["infer"]["rewrite_details"]["batchnorm_folded"] == 1 and rows["infer"]["rewrite_details"]["residual"] == 0
    assert rows["infer"]["rewrite_details"]["with_activation"] == 3
    # In training the first conv's ReLU gets its gradient from the second conv's input gradient (our kernel stays),
    # the last conv's GELU from the average pool's backward (handed to Inductor).
    assert rows["train"]["backward_fusion"]["handed"] == 1 and rows["train"]["backward_fusion"]["kept"] == 1
    assert rows["train"]["backward_fusion"]["merged"] == 0 and rows["train"]["backward_fusion"]["merged_paths"] == []
    assert "convolution_backward" in rows["train"]["backward_fusion"]["kept_why"][0]
    assert rows["infer"]["backward_fusion"] is None
    # Per rewritten layer, how the op ran it (explain on the layer's shapes: ATen's reference on the CPU); for
    # training the weight gradient's path too. tiny(): 3 -> 16 (3x3), 16 -> 16, then 16 -> 32 after the pool, batch 2.
    for phase in ("train", "infer"):
        layers = rows[phase]["layers"]
        assert len(layers) == rows[phase]["rewrites"] and all("error" not in layer for layer in layers), layers
        assert layers[0]["input"] == [2, 3, 32, 32] and layers[0]["weight"] == [16, 3, 3, 3], layers[0]
        assert all(layer["path"] == "aten" for layer in layers), layers
        assert all(("weight_grad_path" in layer) == (phase == "train") for layer in layers), layers
    assert [layer["activation"] for layer in rows["infer"]["layers"]] == ["relu", "relu", "gelu"]


def test_skipped_variants_are_not_measured(tmp_path: Path) -> None:
    """--skip leaves variants out (a device call's time goes to compiling them); the headline's and the numerics'
    variants cannot be skipped."""
    argv = ["--device", "cpu", "--models", "tiny", "--modes", "fp32", "--warmup", "1", "--calls", "1", "--repeats", "1"]
    assert bench_models.main([*argv, "--phases", "infer,train", "--skip", "ours_backend_frozen,ours_eager", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("models-*.json")
    rows = {row["phase"]: row for row in json.loads(path.read_text())["rows"]}
    assert set(rows["infer"]["step_ms"]) == {"nn_eager", "nn_compiled", "nn_frozen", "ours_backend"}, rows["infer"]
    assert set(rows["train"]["step_ms"]) == {"nn_eager", "nn_compiled", "ours_backend"}, rows["train"]
    assert rows["infer"]["backend_vs_nn_compiled_rate"] > 0 and rows["train"]["numerics"]["passed"], rows
    with pytest.raises(SystemExit):
        bench_models.main([*argv, "--skip", "ours_backend"])


def test_frozen_variants_really_freeze() -> None:
    """nn_frozen and ours_backend_frozen: Inductor's freezing takes effect (parameters become constants in the
    generated code) through bench_models.Frozen; torch.compile's options={"freezing": True} alone, which the benchmark
    used before, does not (the reason for the wrapper)."""
    import torch
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = bench_models.tiny().eval()
    x = torch.randn(2, 3, 16, 16)
    fns = bench_models.variants(model, "infer", "cpu")
    unfrozen = torch.compile(bench_models.tiny().eval(), options={"freezing": True})  # Inductor's own backend
    cases = [("nn_frozen", fns["nn_frozen"], True), ("ours_backend_frozen", fns["ours_backend_frozen"], True)]
    for name, fn, frozen in [*cases, ("options only", unfrozen, False)]:
        torch._dynamo.reset()
        with torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False):
            _, code = run_and_get_code(fn, x)
        assert ("_frozen_param" in "\n".join(code)) is frozen, name


def test_kernel_groups_sort_profiler_names_by_kind() -> None:
    kernels = {
        "sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc": 3.0,
        "sm90_xmma_wgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc": 2.0,
        "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc": 4.0,
        # cuDNN's runtime-compiled kernels: the input gradient with ReLU' fused, the weight gradient.
        "cudnn_generated_fort_native_sm90_convBwdData_pointwise_knob_40_128x128x64_5_0": 0.5,
        "cudnn_generated_fort_native_sm90_convBwdFilter_knob_7_128x128x64": 0.5,
        "void convbias::cuda::(anonymous namespace)::column_partial_sums<float, 8, true>(...)": 1.0,
        "triton_red_fused_max_pool2d_with_indices_backward_sum_threshold_backward_0": 0.375,
        # Inductor's bias + ReLU after nn.Conv2d: named after the convolution it follows, but a Triton kernel.
        "triton_poi_fused_convolution_relu_0": 0.125,
        "nvjet_hsh_192x128_64x4_2x1_v_bz_coopA_TNN": 0.25,
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(...)": 0.125,
        "Memcpy DtoD (Device -> Device)": 0.0625,
    }
    groups = bench_models.kernel_groups(kernels, calls=2)
    assert groups == {
        "conv_fprop": 2.0, "conv_dgrad": 1.75, "conv_wgrad": 1.25, "ours": 0.5, "inductor": 0.25, "gemm": 0.125,
        "aten": 0.0625, "other": 0.03125,
    }  # fmt: skip
    assert bench_models.kernel_groups(None, calls=2) is None


def test_merged_paths_explain_each_pair_from_the_backward_report() -> None:
    """A merged pair as the backend's report records it (conv 8 -> 4 above a ReLU, batch 2): explained on the CPU
    (the two steps, ATen's reference); a pair without static shapes says so instead of failing."""
    import torch

    problem = {"grad_output": [2, 4, 3, 3], "input": [2, 8, 6, 6], "weight": [4, 8, 3, 3], "stride": [2, 2],
               "padding": [1, 1], "dilation": [1, 1], "groups": 1, "negative_slope": 0.01}  # fmt: skip
    entries = [{"node": "a", "activation": "relu", "problem": problem}, {"node": "b", "activation": "gelu", "problem": None}]
    first, second = bench_models.merged_paths(entries, torch.float32, "cpu")
    assert first["path"] == "separate" and first["input"] == [2, 8, 6, 6] and "CPU tensors" in first["notes"][0], first
    assert second == {"node": "b", "activation": "gelu", "error": "dynamic shapes"}
