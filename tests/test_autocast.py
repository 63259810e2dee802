"""Under torch.autocast the op casts its inputs the way nn.Conv2d does."""

from __future__ import annotations

import pytest
import torch
from conftest import cuda
from torch import nn

from torch_convbias import ConvBias2d


@pytest.mark.parametrize(
    "device,dtype",
    [
        pytest.param("cpu", torch.bfloat16, id="cpu-bfloat16"),
        pytest.param("cuda", torch.float16, id="cuda-float16", marks=cuda),
        pytest.param("cuda", torch.bfloat16, id="cuda-bfloat16", marks=cuda),
    ],
)
def test_autocast_matches_conv2d(device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    reference = nn.Conv2d(8, 16, 3, padding=1, device=device)
    ours = ConvBias2d.from_conv(reference)
    x = torch.randn(4, 8, 10, 10, device=device)
    with torch.autocast(device_type=device, dtype=dtype):
        expected = reference(x)
        out = ours(x)
    assert expected.dtype == dtype
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    out.float().sum().backward()
    # Gradients flow back through autocast's casts to the fp32 parameters.
    assert ours.weight.grad is not None and ours.weight.grad.dtype == torch.float32


def test_autocast_leaves_float64_alone() -> None:
    conv = ConvBias2d(2, 3, 3, dtype=torch.float64)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        assert conv(torch.randn(1, 2, 5, 5, dtype=torch.float64)).dtype == torch.float64


def test_no_autocast_outside_context() -> None:
    conv = ConvBias2d(2, 3, 3)
    assert conv(torch.randn(1, 2, 5, 5)).dtype == torch.float32
