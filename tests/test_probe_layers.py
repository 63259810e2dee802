"""bench/probe_layers.py on the CPU: every layer of its tiny model runs a training step on both sides, each side's
output and gradients are checked against float64 autograd (independent of our ops), and the JSON records them."""

from __future__ import annotations

import json
from pathlib import Path

from bench import probe_layers as probe


def test_probe_runs_every_layer_on_the_cpu_and_checks_both_sides(tmp_path: Path) -> None:
    assert probe.main(["--device", "cpu", "--tiny", "--modes", "fp32", "--warmup", "0", "--calls", "1", "--repeats", "1",
                       "--out", str(tmp_path)]) == 0  # fmt: skip
    (path,) = tmp_path.glob("layers-tiny-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [row["layer"] for row in rows] == list(range(len(probe.MODELS["tiny"])))
    for row in rows:
        assert "error" not in row, row.get("error")
        assert row["numerics_passed"] is True
        # The stem takes no input gradient; every other layer does, on both sides.
        expected = {"output", "weight", "bias"} | ({"input"} if row["layer"] > 0 else set())
        for side in probe.SIDES:
            assert {key.split("_", 1)[1] for key in row["numerics"] if key.startswith(side + "_")} == expected
        assert set(row["back_to_back"]) == set(probe.SIDES)
        assert row["paths"]["forward"] == "aten"  # the op's CPU path, as explain() reports it


# The max-pools of torchvision's models, after the convolutions that have one: (kernel, stride).
POOLS = {"alexnet": {0: (3, 2), 1: (3, 2)}, "vgg11": {0: (2, 2), 1: (2, 2), 3: (2, 2), 5: (2, 2)}}


def test_model_tables_chain_their_shapes() -> None:
    """Each layer's input is the previous layer's output (channels, and size after the model's max-pool between them)."""
    for model, pools in POOLS.items():
        layers = probe.MODELS[model]
        assert layers[0][0] == 3 and layers[0][1] == 224
        for index, ((_, side, k, kernel, stride, padding), (c, next_side, *_)) in enumerate(zip(layers, layers[1:])):
            out = (side + 2 * padding - kernel) // stride + 1
            if index in pools:
                pool, pool_stride = pools[index]
                out = (out - pool) // pool_stride + 1
            assert (c, next_side) == (k, out), (model, index)


def test_ours_is_judged_against_the_dtype_model_or_nn_conv2d_own_error() -> None:
    """Within the dtype's error model: passed as is. Beyond it but within twice nn.Conv2d's own error on the same
    quantity: passed, saying so. Beyond both (or NaN): failed."""
    def record(error: float, tolerance: float = 1e-5) -> dict:
        passed = error <= tolerance
        return {"rel_rms_tolerance": tolerance, "rel_rms_error": error, "passed": passed,
                "message": None if passed else f"relative RMS error {error:.3g} > {tolerance:.3g}"}

    assert probe.judge_against_nn(record(1e-6), record(1e-3)) == record(1e-6)
    lenient = probe.judge_against_nn(record(4e-4), record(2.5e-4))
    assert lenient["passed"] and "nn.Conv2d's own error" in lenient["message"] and lenient["nn_bound"] == 5e-4
    assert not probe.judge_against_nn(record(6e-4), record(2.5e-4))["passed"]
    assert not probe.judge_against_nn(record(float("nan")), record(2.5e-4))["passed"]
    assert not probe.judge_against_nn(record(1e-3), record(1e-6))["passed"]


def test_probe_rows_record_failures_and_stop_at_the_budget(tmp_path: Path) -> None:
    """common.run_probe_rows, the loop both probes share: every mode over every item, a raising item recorded as a row
    (its keys, the mode, the error) without stopping the rest, each row reported, summarized and written as it lands;
    none once the budget is spent."""
    import argparse

    from bench import common

    def measure(item: int, mode: common.Mode) -> dict:
        if item == 1:
            raise ValueError("no engine for item 1")
        return {"item": item, "mode": mode.name}

    reported: list[tuple[str, int]] = []
    results: dict = {"rows": []}
    args = argparse.Namespace(modes=["fp32", "bf16"], budget=60.0, device="cpu", out=str(tmp_path))
    path = common.run_probe_rows(
        args, results, "probe-test", range(3), label=lambda item: (item,), measure=measure,
        failed_row=lambda item: {"item": item}, report=lambda name, row: reported.append((name, row["item"])),
        summarize=lambda rows: {"rows": len(rows)},
    )
    rows = results["rows"]
    expected = [(mode, item) for mode in ("fp32", "bf16") for item in range(3)]
    assert [(row["mode"], row["item"]) for row in rows] == reported == expected
    failed = [row for row in rows if "error" in row]
    assert [row["mode"] for row in failed] == ["fp32", "bf16"]
    assert all("no engine for item 1" in row["error"] for row in failed)
    assert json.loads(Path(path).read_text()) == {"rows": rows, "summary": {"rows": 6}}
    spent: dict = {"rows": []}
    args.modes, args.budget = ["fp32"], -1.0
    assert common.run_probe_rows(
        args, spent, "probe-test", range(3), label=lambda item: (item,), measure=measure, failed_row=lambda item: {},
        report=lambda name, row: None, summarize=lambda rows: {},
    ) is None
    assert spent == {"rows": []}


def test_probe_runs_the_forward_alone_with_each_layers_ending(tmp_path: Path) -> None:
    """--phase infer: only the output is checked (no gradients), and the tiny model's second layer ends with a residual
    add + ReLU on both sides (ENDINGS), recorded in its row."""
    assert probe.main(["--device", "cpu", "--tiny", "--phase", "infer", "--modes", "fp32", "--warmup", "0", "--calls",
                       "1", "--repeats", "1", "--out", str(tmp_path)]) == 0  # fmt: skip
    (path,) = tmp_path.glob("layers-tiny-infer-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [row["ending"] for row in rows] == ["relu", "residual_relu"]
    for row in rows:
        assert "error" not in row, row.get("error")
        assert row["phase"] == "infer" and row["numerics_passed"] is True
        assert set(row["numerics"]) == {"nn_output", "ours_output"}


def test_resnet50_table_chains_its_blocks() -> None:
    """ResNet-50's distinct convolutions: each stage's first block (1x1 reduce, 3x3, 1x1 expand with the residual
    ending, downsample with none), then its later blocks' 1x1 reduce over the expanded width and (but in the first
    stage, where it is the first block's) their 3x3."""
    layers = probe.MODELS["resnet50"]
    assert len(layers) == 24 and layers[0] == (3, 224, 64, 7, 2, 3)
    c, side = 64, 56  # after the stem and its max-pool
    for stage, first in enumerate((1, 6, 12, 18)):
        width, stride = 64 * 2**stage, 1 if stage == 0 else 2
        out = side // stride
        assert layers[first : first + 5] == [(c, side, width, 1, 1, 0), (width, side, width, 3, stride, 1),
                                             (width, out, 4 * width, 1, 1, 0), (c, side, 4 * width, 1, stride, 0),
                                             (4 * width, out, width, 1, 1, 0)]  # fmt: skip
        if stage > 0:
            assert layers[first + 5] == (width, out, width, 3, 1, 1)
        assert probe.ENDINGS["resnet50"][first + 2] == "residual_relu" and probe.ENDINGS["resnet50"][first + 3] == "identity"
        c, side = 4 * width, out
    assert len(probe.ENDINGS["resnet50"]) == 8
