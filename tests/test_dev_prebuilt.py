"""dev.sh's prebuilt libraries (`./dev.sh prebuild DIR`, then `TORCH_CONVBIAS_PREBUILT=DIR ./dev.sh setup` on the GPU
machine): used only when the stamp names this machine's Python, torch, cuDNN wheel and sources and the copied
libraries import; otherwise setup builds, saying why, and leaves no copied library behind. Run in a scratch tree
(dev.sh, setup.py, csrc/ and a stand-in torch_convbias package whose import succeeds only for "good" libraries), so
that the real build is never touched."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def scratch_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    (tree / "torch_convbias").mkdir(parents=True)
    shutil.copy(ROOT / "dev.sh", tree)
    shutil.copy(ROOT / "setup.py", tree)
    shutil.copytree(ROOT / "csrc", tree / "csrc")
    # The stand-in package imports only when its extension library says "good" (a library that fails to load).
    (tree / "torch_convbias" / "__init__.py").write_text(
        "import pathlib\n"
        "assert pathlib.Path(__file__).with_name('_C.so').read_text() == 'good', 'undefined symbol'\n"
    )
    return tree


def dev(tree: Path, *args: str, prebuilt: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CONVBIAS_PREBUILT"}
    if prebuilt is not None:
        env["TORCH_CONVBIAS_PREBUILT"] = str(prebuilt)
    return subprocess.run(
        ["bash", str(tree / "dev.sh"), *args], cwd=tree, env=env, capture_output=True, text=True, timeout=120
    )


def prebuilt_dir(tmp_path: Path, stamp: str | None, library: str) -> Path:
    out = tmp_path / "prebuilt"
    out.mkdir()
    for name in ("_C.so", "libtorch_convbias.so"):
        (out / name).write_text(library)
    if stamp is not None:
        (out / "stamp.txt").write_text(stamp + "\n")
    return out


def copied(tree: Path) -> list[str]:
    return sorted(p.name for p in (tree / "torch_convbias").glob("*.so"))


def test_stamp_changes_with_the_sources(tmp_path: Path) -> None:
    tree = scratch_tree(tmp_path)
    first = dev(tree, "stamp")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("python=") and " torch=" in first.stdout and " sources=" in first.stdout
    (tree / "csrc" / "ops.cpp").write_text((tree / "csrc" / "ops.cpp").read_text() + "\n// changed\n")
    assert dev(tree, "stamp").stdout != first.stdout


def test_benchmark_records_name_the_stamps_sources(tmp_path: Path) -> None:
    """bench.common.source_digest (every benchmark JSON's environment["sources"]) is the stamp's sources= of the same
    tree, before and after a change: a result names the build that ran even where its commit was handed over wrong."""
    from bench import common

    tree = scratch_tree(tmp_path)
    for _ in range(2):
        stamp = dev(tree, "stamp")
        assert stamp.returncode == 0, stamp.stderr
        assert f" sources={common.source_digest(tree)}" in stamp.stdout, stamp.stdout
        (tree / "csrc" / "cuda" / "knobs.h").write_text((tree / "csrc" / "cuda" / "knobs.h").read_text() + "// x\n")
    assert common.source_digest(tmp_path / "no tree") is None


def test_matching_stamp_and_importable_libraries_are_used(tmp_path: Path) -> None:
    tree = scratch_tree(tmp_path)
    stamp = dev(tree, "stamp").stdout.strip()
    used = dev(tree, "use-prebuilt", prebuilt=prebuilt_dir(tmp_path, stamp, "good"))
    assert used.returncode == 0 and "using the prebuilt libraries" in used.stdout, used.stdout + used.stderr
    assert copied(tree) == ["_C.so", "libtorch_convbias.so"]


def test_another_machines_stamp_is_refused(tmp_path: Path) -> None:
    tree = scratch_tree(tmp_path)
    stamp = dev(tree, "stamp").stdout.strip().replace("python=", "python=2.")
    refused = dev(tree, "use-prebuilt", prebuilt=prebuilt_dir(tmp_path, stamp, "good"))
    assert refused.returncode == 1 and "building" in refused.stdout and stamp in refused.stdout, refused.stdout
    assert copied(tree) == []


def test_libraries_that_do_not_import_are_removed(tmp_path: Path) -> None:
    tree = scratch_tree(tmp_path)
    stamp = dev(tree, "stamp").stdout.strip()
    refused = dev(tree, "use-prebuilt", prebuilt=prebuilt_dir(tmp_path, stamp, "corrupt"))
    assert refused.returncode == 1 and "do not import here; building" in refused.stdout, refused.stdout
    assert copied(tree) == []


def test_missing_stamp_or_no_prebuilt_builds(tmp_path: Path) -> None:
    tree = scratch_tree(tmp_path)
    no_stamp = dev(tree, "use-prebuilt", prebuilt=prebuilt_dir(tmp_path, None, "good"))
    assert no_stamp.returncode == 1 and "stamp.txt; building" in no_stamp.stdout, no_stamp.stdout
    unset = dev(tree, "use-prebuilt")
    assert unset.returncode == 1 and unset.stdout == ""
    assert copied(tree) == []
