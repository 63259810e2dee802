"""bench/bench_ddp.py on the CPU (gloo, two ranks, one small shape): the script's logic end to end, its JSON, and the
replicas of both data-parallel layers equal across ranks after the timed steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bench import bench_ddp


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_ddp_bench_cpu_smoke(tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--quick", "--modes", "fp32", "--warmup", "1", "--calls", "2", "--repeats", "2"]
    assert bench_ddp.main([*argv, "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("ddp-*.json")
    results = json.loads(path.read_text())
    (row,) = results["rows"]
    assert row["status"] == "ok" and row["label"] == "N16 C16 16x16 K16 k3s1p1" and len(row["per_rank"]) == 2
    for side in bench_ddp.SIDES:
        assert row[f"{side}_replicas_equal"] is True
        assert row[f"{side}_single_ms"] > 0 and row[f"{side}_ddp_ms"] > 0
        assert row[f"{side}_efficiency"] == pytest.approx(row[f"{side}_single_ms"] / row[f"{side}_ddp_ms"])
    assert results["ddp_speedup_geomean"] == pytest.approx(row["torch_ddp_ms"] / row["ours_ddp_ms"])


def test_ddp_bench_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_ddp.main(["--world", "1", "--device", "cpu"])
    assert "--world must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_ddp.main(["--modes", "fp64", "--device", "cpu"])
    assert "unknown mode" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown shape"):
        bench_ddp.main(["--shapes", "N1 C1 1x1 K1 k1s1p0", "--device", "cpu"])


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs the benchmark needs")
def test_ddp_bench_says_it_needs_more_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_ddp.main(["--world", "2"]) == 2
    assert f"needs 2 GPUs, this machine has {torch.cuda.device_count()}" in capsys.readouterr().out
