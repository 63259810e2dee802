"""Smoke test of bench/bench_models.py's logic on the CPU: the tiny built-in model, every variant (Inductor
included), training and inference; the timings mean nothing here, the structure and the numerics check do."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
    assert "convolution_backward" in rows["train"]["backward_fusion"]["kept_why"][0]
    assert rows["infer"]["backward_fusion"] is None
