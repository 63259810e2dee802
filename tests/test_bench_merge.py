"""bench.merge_results on synthetic runs: which rows are kept, replaced and added, and what is recorded of each run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import merge_results  # noqa: E402


def run(commit: str, modes: list[str], rows: list[dict[str, Any]], complete: bool = True) -> dict[str, Any]:
    return {"environment": {"commit": commit}, "config": {"modes": modes}, "rows": rows, "complete": complete,
            "wall_seconds": 10.0}


def test_later_rows_replace_the_same_measurement_and_other_rows_stay() -> None:
    first = run("a", ["bf16", "tf32"], [
        {"mode": "bf16", "label": "s1", "value": 1}, {"mode": "bf16", "label": "s2", "value": 2},
        {"mode": "tf32", "label": "s1", "value": 3},
    ], complete=False)
    second = run("b", ["tf32", "fp32"], [
        {"mode": "fp32", "label": "s1", "value": 5}, {"mode": "tf32", "label": "s1", "value": 4},
    ])
    merged = merge_results.merge(first, [second], note="n")
    assert [(r["mode"], r["label"], r["value"]) for r in merged["rows"]] == [
        ("bf16", "s1", 1), ("bf16", "s2", 2), ("tf32", "s1", 4), ("fp32", "s1", 5)]
    assert merged["config"]["modes"] == ["bf16", "tf32", "fp32"]
    # The target had no record of its own run: it becomes the first record, the merged run the second.
    assert [(r["environment"]["commit"], r["rows"], r.get("note")) for r in merged["merged_runs"]] == [
        ("a", 3, None), ("b", 2, "n")]
    assert merged["complete"] is False  # one incomplete run keeps the whole incomplete
    assert first["rows"][2]["value"] == 3  # the inputs are not modified


def test_model_rows_are_keyed_by_model_phase_and_mode() -> None:
    first = run("a", ["bf16"], [{"model": "vgg11", "phase": "train", "mode": "bf16", "value": 1}])
    second = run("b", ["bf16"], [
        {"model": "vgg11", "phase": "infer", "mode": "bf16", "value": 2},
        {"model": "alexnet", "phase": "train", "mode": "bf16", "value": 3},
    ])
    merged = merge_results.merge(None, [first, second])
    assert [r["value"] for r in merged["rows"]] == [1, 2, 3]
    assert [r["environment"]["commit"] for r in merged["merged_runs"]] == ["a", "b"]


def test_nothing_to_merge_is_an_error() -> None:
    with pytest.raises(ValueError, match="no run"):
        merge_results.merge(None, [])
