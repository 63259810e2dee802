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
