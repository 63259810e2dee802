"""examples/layerwise_digits.py: a tiny run of the demo. On the CPU both sides run ATen (ConvBias2d's reference
kernels), so that run tests the script; on CUDA ConvBias2d runs our graphs (asserted) against nn.Conv2d."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("sklearn")

import torch  # noqa: E402
from conftest import DEVICES  # noqa: E402
from torch import nn  # noqa: E402

import torch_convbias  # noqa: E402

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


@pytest.mark.parametrize("device", DEVICES)
def test_layerwise_digits_tiny_run(example: ModuleType, device: str) -> None:
    data = example.load_digits_data(seed=0)
    kwargs = dict(epochs=2, device=device, batch_size=32, seed=0)
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
    if device == "cuda":
        # The demo's second layer (32 -> 64 channels, channels_last float32) on a batch of its shape: our fused
        # graph ran it, not ATen (the first layer's single input channel is narrower than a fused engine's rows).
        c_in, c_out, stride = example.LAYERS[1]
        conv = example.ConvBias2d(c_in, c_out, 3, stride, padding=1).to(device, memory_format=torch.channels_last)
        x = torch.randn(32, c_in, 8, 8, device=device).contiguous(memory_format=torch.channels_last)
        info = torch_convbias.explain(x, conv.weight, conv.bias, stride=stride, padding=1)
        assert info["path"] == "fused", info


def test_train_layerwise_leaves_global_rng_alone(example: ModuleType) -> None:
    data = example.load_digits_data(seed=0)
    n = 64
    tiny = example.Data(data.x_train[:n], data.y_train[:n], data.x_test, data.y_test)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    example.train_layerwise(example.ConvBias2d, tiny, epochs=1, device="cpu", seed=7)
    assert torch.equal(torch.rand(3), expected)
