"""Smoke test for examples/layerwise_digits.py: a tiny CPU run of the demo."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("sklearn")

import torch  # noqa: E402
from torch import nn  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "layerwise_digits.py"


@pytest.fixture(scope="module")
def example() -> Iterator[ModuleType]:
    # examples/ is not a package, so load the script by path.  It must sit in
    # sys.modules while it executes: dataclasses look their module up there.
    name = "layerwise_digits_example"
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


def test_layerwise_digits_tiny_run(example: ModuleType) -> None:
    data = example.load_digits_data(seed=0)
    kwargs = dict(epochs=2, device="cpu", batch_size=32, seed=0)
    ours = example.train_layerwise(example.ConvBias2d, data, **kwargs)
    ref = example.train_layerwise(nn.Conv2d, data, **kwargs)

    assert len(ours) == len(ref) == len(example.LAYERS)
    assert [r.layer for r in ours] == list(range(1, len(example.LAYERS) + 1))
    for a, b in zip(ours, ref):
        assert a.seconds > 0 and b.seconds > 0
        # Same split, same initial weights, same batches: only float rounding
        # inside the conv may differ, so the accuracies must nearly agree.
        assert abs(a.accuracy - b.accuracy) <= 0.02, (a, b)
    # Chance is 0.1; two epochs per layer reach ~0.9 (0.88-0.95 over seeds).
    assert ours[-1].accuracy > 0.8
    assert ref[-1].accuracy > 0.8


def test_train_layerwise_leaves_global_rng_alone(example: ModuleType) -> None:
    data = example.load_digits_data(seed=0)
    n = 64
    tiny = example.Data(data.x_train[:n], data.y_train[:n], data.x_test, data.y_test)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    example.train_layerwise(example.ConvBias2d, tiny, epochs=1, device="cpu", seed=7)
    assert torch.equal(torch.rand(3), expected)
