"""Smoke tests of the cold-start benchmark (bench/bench_cold_start.py) on the CPU: the worker processes, the three
scenarios and their plan directories, the JSON and its summary. CPU kernels have no plans, so the times mean
nothing and the disk counters stay 0; on the GPU the same pipeline measures the persistent plan cache."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

# The benchmarks are a package at the repository root, which pytest does not put on sys.path by itself.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import bench_cold_start as cs  # noqa: E402

SCENARIOS = ["cold", "cold_writing", "warm_from_disk"]
TIMES = ["forward_first_ms", "param_grad_first_ms", "forward_warm_ms", "param_grad_warm_ms", "process_first_call_ms"]
SUMMARY_KEYS = {
    "problems",
    "measured",
    "missing",
    "cold_first_call_ms",
    "cold_writing_first_call_ms",
    "warm_from_disk_first_call_ms",
    "first_call_ratio_cold_over_disk",
    "median_first_call_ms",
    "median_warm_ms",
    "disk_hits_warm_from_disk",
    "disk_writes_cold_writing",
    "disk_rejected",
}
# One plain problem and the one with a knob of its own (TORCH_CONVBIAS_BIAS_GRAD=cudnn): 6 worker processes.
PROBLEMS = ["cl_fp32_3x3", "bias_grad_cudnn"]


def load(tmp_path: Path) -> dict[str, Any]:
    (path,) = tmp_path.glob("cold_start-*.json")  # named after the GPU when one is visible
    return json.loads(path.read_text())


def test_quick_cpu_run_writes_every_problem_and_scenario(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A directory set by whoever runs the benchmark must neither make `cold` warm nor be written to.
    users_dir = tmp_path / "users-plan-dir"
    monkeypatch.setenv(cs.PLAN_CACHE_ENV, str(users_dir))
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--quick", "--repeats", "2", "--problems", ",".join(PROBLEMS), "--out", str(out)]
    assert cs.main(argv) == 0
    results = load(out)

    assert results["schema"] == cs.SCHEMA and results["complete"] is True
    assert {"commit", "gpu", "torch", "cudnn", "torch_convbias", "timestamp_utc"} <= set(results["environment"])
    assert results["config"]["device"] == "cpu" and results["config"]["problems"] == PROBLEMS
    assert [r["problem"] for r in results["rows"]] == PROBLEMS
    dirs = set()
    for row in results["rows"]:
        assert list(row["scenarios"]) == SCENARIOS
        for name, s in row["scenarios"].items():
            assert s["status"] == "ok", (row["problem"], name, s.get("error"), s.get("stderr"))
            for key in TIMES:
                assert math.isfinite(s[key]) and s[key] > 0, (row["problem"], name, key, s[key])
            assert len(s["forward_warm_samples_ms"]) == 2 and len(s["param_grad_warm_samples_ms"]) == 2
            assert isinstance(s["cache_info"], dict) and "hits" in s["cache_info"]
            assert isinstance(s["problem_cache"], dict) and "capacity" not in s["problem_cache"]
            # CPU kernels have no plans: nothing written, nothing loaded (0 where the counters exist).
            assert s["problem_cache"].get("disk_hits", 0) == 0 and s["problem_cache"].get("disk_writes", 0) == 0
            assert s["cudnn_benchmark"] is False
            bias_grad = "cudnn" if row["problem"] == "bias_grad_cudnn" else None
            assert s["knobs"].get("TORCH_CONVBIAS_BIAS_GRAD") == bias_grad and s["warmup_error"] is None
        cold, writing, disk = (row["scenarios"][name] for name in SCENARIOS)
        assert cs.PLAN_CACHE_ENV not in cold["knobs"] and cold["plan_cache_dir"] is None
        # cold_writing and warm_from_disk share one directory, the problem's own, and not the user's.
        assert writing["knobs"][cs.PLAN_CACHE_ENV] == disk["knobs"][cs.PLAN_CACHE_ENV] == writing["plan_cache_dir"]
        assert Path(writing["plan_cache_dir"]).name == row["problem"]
        dirs.add(writing["plan_cache_dir"])
        assert row["first_call_ratio_cold_over_disk"] > 0
    assert len(dirs) == len(PROBLEMS) and not users_dir.exists()
    # The plan directories are temporary unless --keep-plans.
    assert not Path(results["config"]["plan_root"]).exists()

    summary = results["summary"]
    assert SUMMARY_KEYS <= set(summary)
    assert summary["problems"] == summary["measured"] == len(PROBLEMS) and summary["missing"] == []
    assert summary["cold_first_call_ms"] > 0 and summary["warm_from_disk_first_call_ms"] > 0
    assert summary["first_call_ratio_cold_over_disk"] > 0
    assert summary["disk_hits_warm_from_disk"] in (0, None) and summary["problems_with_disk_hits"] == 0


def test_failed_workers_are_recorded_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that dies costs its scenario (status and stderr in the JSON); with nothing measured, exit 1."""
    fail = [sys.executable, "-c", "import sys; sys.stderr.write('simulated crash'); sys.exit(3)"]
    monkeypatch.setattr(cs, "worker_command", lambda *args: fail)
    assert cs.main(["--device", "cpu", "--quick", "--problems", "cl_fp32_1x1", "--out", str(tmp_path)]) == 1
    results = load(tmp_path)
    (row,) = results["rows"]
    for s in row["scenarios"].values():
        assert s["status"] == "error" and "exit status 3" in s["error"] and "simulated crash" in s["stderr"]
    assert results["summary"]["measured"] == 0 and results["summary"]["missing"] == ["cl_fp32_1x1"]
    assert results["summary"]["cold_first_call_ms"] is None and row["first_call_ratio_cold_over_disk"] is None


def scenario(first: float, hits: int | None = None, writes: int | None = None) -> dict[str, Any]:
    cache = {"build_seconds": 0.5} | ({} if hits is None else {"disk_hits": hits, "disk_writes": writes or 0})
    times = {"first_call_ms": first, "forward_first_ms": first / 2, "param_grad_first_ms": first / 2, "warm_ms": 0.1}
    extra = {"process_first_call_ms": 150.0, "problem_build_seconds": 0.5, "problem_cache": cache}
    return {"status": "ok", **times, **extra}


def row(name: str, cold: float, disk: float, hits: int | None) -> dict[str, Any]:
    scenarios = {
        "cold": scenario(cold),
        "cold_writing": scenario(cold, 0 if hits is not None else None, hits),
        "warm_from_disk": scenario(disk, hits, 0),
    }
    return {"problem": name, "scenarios": scenarios, "first_call_ratio_cold_over_disk": cold / disk}


def test_summary_medians_ratio_and_disk_counters() -> None:
    rows = [row("a", 100.0, 10.0, 3), row("b", 700.0, 20.0, 4), row("c", 50.0, 25.0, 0)]
    broken = row("d", 1.0, 1.0, 9)
    broken["scenarios"]["warm_from_disk"] = {"status": "timeout"}
    summary = cs.summarize([*rows, broken])
    assert summary["measured"] == 3 and summary["missing"] == ["d"]
    assert summary["cold_first_call_ms"] == 100.0 and summary["warm_from_disk_first_call_ms"] == 20.0
    assert summary["first_call_ratio_cold_over_disk"] == pytest.approx(5.0)
    assert summary["median_problem_ratio_cold_over_disk"] == pytest.approx(10.0)
    assert summary["disk_hits_warm_from_disk"] == 7 and summary["problems_with_disk_hits"] == 2
    assert summary["disk_writes_cold_writing"] == 7 and summary["disk_rejected"] is None
    # An extension without the disk counters: the summary says "not reported" (None), not 0.
    old = cs.summarize([row("a", 100.0, 90.0, None)])
    assert old["disk_hits_warm_from_disk"] is None and old["problems_with_disk_hits"] == 0


def test_suites_have_distinct_geometries_and_the_same_names() -> None:
    """No problem's plans (nor the warm-up's) may serve another problem's first call."""
    for suite in (cs.SUITE, cs.QUICK_SUITE):
        geometries = [p.geometry for p in suite] + [cs.WARMUP]
        assert len(set(geometries)) == len(geometries)
    assert [p.name for p in cs.SUITE] == [p.name for p in cs.QUICK_SUITE]
    assert 6 <= len(cs.SUITE) <= 8
    assert any(p.env.get("TORCH_CONVBIAS_BIAS_GRAD") == "cudnn" for p in cs.SUITE)
    assert any(p.cudnn_benchmark for p in cs.SUITE) and any(not p.channels_last for p in cs.SUITE)


def test_unknown_problem_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cs.main(["--device", "cpu", "--problems", "no_such_problem"])
    assert "unknown problem" in capsys.readouterr().err
