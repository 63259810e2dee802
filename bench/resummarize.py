"""Recompute the per-mode summaries of activation-benchmark JSONs with the current specs (after a change of headline
or of a summary's fields), leaving every measured row as it was.

``python -m bench.resummarize bench/results/layerwise_relu-nvidia-h200.json bench/results/forward_gelu-...json``

The file name says which benchmark and activation it holds (``forward_<activation>``, ``forward_residual_<activation>``
or ``layerwise_<activation>``);
the JSON records which commit recomputed its summaries (``summaries_recomputed``), beside the commit that measured.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import bench_forward, bench_layerwise, common, harness

# forward_<activation>, forward_residual_<activation> (bench_forward --residual) or layerwise_<activation>.
NAME = re.compile(r"^(forward|layerwise)_(residual_)?([a-z_]+?)-")


def summarizable(path: Path) -> bool:
    """Whether the file holds a forward_[residual_]<activation> / layerwise_<activation> run."""
    match = NAME.match(path.name)
    return match is not None and not (match.group(1) == "layerwise" and match.group(2))


def spec_of(path: Path) -> harness.Spec:
    """The spec the file's rows were measured under, from its name (forward_<activation>-<gpu>.json, ...)."""
    match = NAME.match(path.name)
    if match is None or not summarizable(path):
        raise SystemExit(
            f"resummarize: {path.name} is not a forward_[residual_]<activation> or layerwise_<activation> result"
        )
    bench, residual, activation = match.groups()
    if bench == "forward":
        return bench_forward.forward_activation_spec(activation, residual=bool(residual))
    return bench_layerwise.activation_spec(activation)


def resummarize(path: Path) -> dict[str, Any]:
    spec = spec_of(path)
    results = json.loads(path.read_text())
    order = results["config"]["modes"]
    settings = sorted({(r["mode"], r["cudnn_benchmark"]) for r in results["rows"]}, key=lambda s: order.index(s[0]))
    rows = results["rows"]
    suite = results["config"].get("suite")
    results["summaries"] = [harness.summarize_rows(spec, rows, mode, benchmark, suite) for mode, benchmark in settings]
    results["summaries_recomputed"] = {"commit": common.git_commit(), "headline": spec.headline}
    common.write_json(results, None, spec.name, path)
    print(f"== {path.name} ({spec.headline_definition or spec.headline_ratio}) ==")
    for summary in results["summaries"]:
        harness.print_summary(spec, summary)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.resummarize", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    for path in parser.parse_args(argv).paths:
        resummarize(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
