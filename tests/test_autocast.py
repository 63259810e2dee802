"""Under torch.autocast the op casts its inputs the way nn.Conv2d does, and its gradients equal nn.Conv2d's."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import cuda
from torch import nn

import torch_convbias
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
    """Output and every gradient (to the fp32 parameters and input, through autocast's casts) equal nn.Conv2d's under
    the same autocast; on CUDA the op's fused graph ran (explain on the cast tensors)."""
    torch.manual_seed(0)
    reference = nn.Conv2d(8, 16, 3, padding=1, device=device)
    ours = ConvBias2d.from_conv(copy.deepcopy(reference))
    x = torch.randn(4, 8, 10, 10, device=device)
    if device == "cuda":
        x = x.contiguous(memory_format=torch.channels_last)
        reference, ours = (m.to(memory_format=torch.channels_last) for m in (reference, ours))
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast(device_type=device, dtype=dtype):
        expected = reference(x_ref)
        out = ours(x_ours)
    assert expected.dtype == dtype
    assert out.dtype == expected.dtype
    tol = {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, expected, **tol)
    seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    out.backward(seed)
    expected.backward(seed)
    for name, got, want in (
        ("input", x_ours.grad, x_ref.grad),
        ("weight", ours.weight.grad, reference.weight.grad),
        ("bias", ours.bias.grad, reference.bias.grad),
    ):
        # Gradients flow back through autocast's casts to the fp32 leaves.
        assert got is not None and got.dtype == torch.float32, name
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=tol["atol"] * scale, msg=lambda m: f"{name}: {m}")
    if device == "cuda":
        info = torch_convbias.explain(x.to(dtype), ours.weight.to(dtype), ours.bias.to(dtype), padding=1)
        assert info["path"] == "fused", info


def test_autocast_leaves_float64_alone() -> None:
    conv = ConvBias2d(2, 3, 3, dtype=torch.float64)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        assert conv(torch.randn(1, 2, 5, 5, dtype=torch.float64)).dtype == torch.float64


def test_no_autocast_outside_context() -> None:
    conv = ConvBias2d(2, 3, 3)
    assert conv(torch.randn(1, 2, 5, 5)).dtype == torch.float32
