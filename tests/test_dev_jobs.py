"""dev.sh's job runner (``./dev.sh gpu DIR jobs``; ``./dev.sh jobs DIR`` runs it without the build in front of it),
here on the CPU: jobs run in order under their own time bounds, an `env:` job exports a knob for the jobs after it, a bad
spec fails its job (and the run's status) without stopping the others, a job that no longer fits the budget is
skipped (and fails the run's status), and everything comes back in DIR/jobs.tgz with a summary."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_jobs(jobs: str, out: Path, budget: int = 60) -> tuple[int, str, dict[str, str]]:
    """(status, summary, {job dir: log}) of ``./dev.sh jobs`` over ``jobs`` (the runner alone: no setup, no build)."""
    # A clean environment (no TORCH_CONVBIAS_* knob leaking in), with this Python first on PATH as `python3`.
    path = f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin"
    env = {"PATH": path, "JOBS": jobs, "BUDGET": str(budget), "HOME": str(out)}
    result = subprocess.run(["./dev.sh", "jobs", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    logs = {}
    with tarfile.open(out / "jobs.tgz") as archive:
        for member in archive.getmembers():
            if member.isfile():
                logs[member.name] = archive.extractfile(member).read().decode()  # type: ignore[union-attr]
    return result.returncode, logs.pop("jobs/summary.txt"), logs


def test_env_job_exports_a_knob_for_the_later_jobs(tmp_path: Path) -> None:
    jobs = (
        "module:tests._env_probe:TORCH_CONVBIAS_INPUT_GRAD:30 env:TORCH_CONVBIAS_INPUT_GRAD=timed:0 "
        "module:tests._env_probe:TORCH_CONVBIAS_INPUT_GRAD:30"
    )
    status, summary, logs = run_jobs(jobs, tmp_path)
    assert status == 0, summary
    before, export, after = summary.splitlines()
    assert before.startswith("rc=0") and before.endswith("TORCH_CONVBIAS_INPUT_GRAD=<unset>"), summary
    assert export.startswith("rc=0") and export.endswith("export TORCH_CONVBIAS_INPUT_GRAD=timed"), summary
    assert after.startswith("rc=0") and after.endswith("TORCH_CONVBIAS_INPUT_GRAD=timed"), summary
    assert len(logs) == 3, logs


def test_bad_specs_fail_their_job_and_the_run_but_not_the_others(tmp_path: Path) -> None:
    jobs = "env:bad-name=1:0 nonsense:x:0 module:tests._env_probe:HOME:30 module:tests._env_probe:HOME:999"
    status, summary, _ = run_jobs(jobs, tmp_path, budget=60)
    assert status != 0, summary
    bad_env, unknown, fine, too_long = summary.splitlines()
    assert bad_env.startswith("rc=2") and "env job expects NAME=VALUE, got 'bad-name=1'" in bad_env, summary
    assert unknown.startswith("rc=2") and "unknown job kind 'nonsense'" in unknown, summary
    assert fine.startswith("rc=0"), summary
    assert too_long.startswith("skipped module:tests._env_probe:HOME:999 (needs 999s"), summary


def test_a_skipped_job_fails_the_run(tmp_path: Path) -> None:
    """A run whose job did not fit its budget did not do what it was asked: `jobs A && jobs B` stops there (a device
    call once went on to benchmarks after its tests were skipped)."""
    status, summary, logs = run_jobs("module:tests._env_probe:HOME:30 module:tests._env_probe:HOME:999", tmp_path)
    ran, skipped = summary.splitlines()
    assert ran.startswith("rc=0") and skipped.startswith("skipped module:tests._env_probe:HOME:999"), summary
    assert status != 0, summary
    assert len(logs) == 1, logs


def test_streams_run_side_by_side_each_with_its_own_environment(tmp_path: Path) -> None:
    """JOBS groups separated by '|' run as streams: an env: job holds for its stream only, a failing job fails the run,
    and the one archive has every stream's logs and a summary whose lines say their stream."""
    jobs = (
        "env:TORCH_CONVBIAS_INPUT_GRAD=timed:0 module:tests._env_probe:TORCH_CONVBIAS_INPUT_GRAD:30 "
        "| module:tests._env_probe:TORCH_CONVBIAS_INPUT_GRAD:30 nonsense:x:0"
    )
    status, summary, logs = run_jobs(jobs, tmp_path)
    assert status != 0, summary
    lines = summary.splitlines()
    assert [line.split(":")[0] for line in lines] == ["stream 0", "stream 0", "stream 1", "stream 1"], summary
    assert lines[1].endswith("TORCH_CONVBIAS_INPUT_GRAD=timed") and lines[2].endswith("=<unset>"), summary
    assert lines[3].startswith("stream 1: rc=2") and "unknown job kind 'nonsense'" in lines[3], summary
    assert sorted({name.split("/")[1] for name in logs}) == ["stream0", "stream1"] and len(logs) == 4, logs
