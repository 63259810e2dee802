"""Merge the results of separate benchmark processes (one device call per mode, or per model row) into one committed
JSON, keeping a record of every run that contributed.

``python -m bench.merge_results bench/results/forward_gelu-nvidia-h200.json out/fw_gelu/forward_gelu-nvidia-h200.json
--note "fp32 at <sha>"``

A row of a newer run replaces the row measuring the same thing (same model / phase / mode / shape label / cuDNN
benchmark setting) in the target; the other rows stay as they were. Each merged run is appended to ``merged_runs``
with its environment (commit, GPU, versions), its modes or config, its wall time and the note. The per-mode
summaries of ``forward_<activation>`` / ``layerwise_<activation>`` files are then recomputed from the merged rows
(``bench.resummarize``), so a headline never mixes a stale summary with new rows.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import common, resummarize

# The fields that together name what a row measured, in every benchmark's rows that has them.
ROW_IDENTITY = ("model", "phase", "mode", "label", "activation", "cudnn_benchmark")


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(json.dumps(row.get(field), sort_keys=True) for field in ROW_IDENTITY)


def run_record(run: dict[str, Any], note: str | None) -> dict[str, Any]:
    """What ``merged_runs`` keeps of one run: enough to tell which commit and machine measured which rows."""
    record: dict[str, Any] = {"environment": run.get("environment")}
    config = run.get("config") or {}
    record["modes"] = config.get("modes")
    if "models" in config:
        record["models"] = config.get("models")
        record["phases"] = config.get("phases")
    record["rows"] = len(run.get("rows", []))
    if "wall_seconds" in run:
        record["wall_seconds"] = run["wall_seconds"]
    if note:
        record["note"] = note
    return record


def merge(into: dict[str, Any] | None, runs: Sequence[dict[str, Any]], note: str | None = None) -> dict[str, Any]:
    """``into`` with the rows of ``runs`` merged in (later runs win); ``into`` None starts from the first run."""
    if not runs:
        raise ValueError("merge_results: no run to merge")
    if into is None:
        merged = json.loads(json.dumps(runs[0]))
        merged.pop("merged_runs", None)
        merged["merged_runs"] = [run_record(runs[0], note)]
        runs = runs[1:]
    else:
        merged = json.loads(json.dumps(into))
        if "merged_runs" not in merged:  # a single run so far: it becomes the first record
            merged["merged_runs"] = [run_record(into, None)]
    for run in runs:
        replaced = {row_key(row) for row in run.get("rows", [])}
        kept = [row for row in merged.get("rows", []) if row_key(row) not in replaced]
        merged["rows"] = kept + list(run.get("rows", []))
        config = merged.setdefault("config", {})
        run_modes = (run.get("config") or {}).get("modes") or []
        modes = list(config.get("modes") or [])
        config["modes"] = modes + [mode for mode in run_modes if mode not in modes]
        if "complete" in run:
            merged["complete"] = bool(merged.get("complete", True)) and bool(run["complete"])
        merged["merged_runs"].append(run_record(run, note))
    # Rows in the order of the modes they belong to (the summaries and the README tables read them in that order).
    order = merged.get("config", {}).get("modes") or []
    merged["rows"].sort(key=lambda row: order.index(row["mode"]) if row.get("mode") in order else len(order))
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.merge_results", description=__doc__.splitlines()[0])
    parser.add_argument("into", type=Path, help="the committed JSON (created from the first run if it does not exist)")
    parser.add_argument("runs", nargs="+", type=Path, help="JSONs written by separate runs, oldest first")
    parser.add_argument("--note", default=None, help="recorded with each of these runs in merged_runs")
    args = parser.parse_args(argv)
    into = json.loads(args.into.read_text()) if args.into.exists() else None
    runs = [json.loads(path.read_text()) for path in args.runs]
    merged = merge(into, runs, args.note)
    common.write_json(merged, None, args.into.stem, args.into)
    print(f"{args.into}: {len(merged['rows'])} rows from {len(merged['merged_runs'])} runs")
    if resummarize.summarizable(args.into):
        resummarize.resummarize(args.into)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
