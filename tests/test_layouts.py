"""The output's memory format equals F.conv2d's for every mix of input and weight layouts: contiguous, channels_last,
tensors that are both (size-1 dimensions: a 1x1 weight, a 1x1 image, one channel), and strided views. PyTorch's
rule (``suggest_memory_format`` of input and weight; NCHW on CUDA for float64 and without cuDNN) decides it, and the
strides are those of a fresh tensor in that format, as ATen's. The fake kernel promises the same strides."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import cuda
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_convbias

CL = torch.channels_last

# (input shape, weight shape, padding, groups): the ambiguous ones have size-1 dimensions.
CASES = [
    ((2, 4, 5, 6), (8, 4, 3, 3), 1, 1),
    ((2, 4, 5, 6), (8, 4, 1, 1), 0, 1),  # 1x1 weight: contiguous and channels_last at once
    ((2, 4, 1, 1), (8, 4, 1, 1), 0, 1),  # 1x1 image and weight: every tensor ambiguous, so is the output
    ((1, 1, 5, 5), (3, 1, 3, 3), 1, 1),  # one image, one channel
    ((2, 4, 6, 6), (6, 2, 3, 3), 1, 2),  # groups
    ((3, 8, 4, 4), (8, 1, 3, 3), 1, 8),  # depthwise
]


def layout(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """A tensor of `shape` in the named layout: a view into a larger tensor for the sliced ones."""
    g = torch.Generator().manual_seed(seed)
    n, c, h, w = shape

    def base(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=g).to(device=device, dtype=dtype)

    if name == "contiguous":
        return base(n, c, h, w)
    if name == "channels_last":
        return base(n, c, h, w).contiguous(memory_format=CL)
    if name == "sliced":  # every other column of a wider NCHW tensor
        return base(n, c, h, 2 * w)[..., ::2]
    if name == "sliced_channels_last":  # the first channels of a channels_last tensor with twice as many
        return base(n, 2 * c, h, w).contiguous(memory_format=CL)[:, :c]
    raise ValueError(name)


LAYOUTS = ["contiguous", "channels_last", "sliced", "sliced_channels_last"]


def layout_facts(t: torch.Tensor) -> tuple[object, ...]:
    return (tuple(t.shape), t.stride(), suggest_memory_format(t), t.is_contiguous(), t.is_contiguous(memory_format=CL))


def check_against_conv2d(device: str, dtype: torch.dtype, tol: float, forward: Callable[..., torch.Tensor]) -> int:
    checked = 0
    for (xs, ws, pad, groups), xl, wl in itertools.product(CASES, LAYOUTS, LAYOUTS):
        x = layout(xl, xs, dtype, device, seed=1)
        w = layout(wl, ws, dtype, device, seed=2).mul_(1 / (ws[1] * ws[2] * ws[3]) ** 0.5)
        b = torch.randn(ws[0], generator=torch.Generator().manual_seed(3)).to(device, dtype)
        ours = forward(x, w, b, padding=pad, groups=groups)
        theirs = F.conv2d(x, w, b, padding=pad, groups=groups)
        what = f"input {xs} {xl}, weight {ws} {wl}, {dtype}"
        assert layout_facts(ours) == layout_facts(theirs), what
        reference = F.conv2d(x.cpu().double(), w.cpu().double(), b.cpu().double(), padding=pad, groups=groups)
        torch.testing.assert_close(ours.cpu().double(), reference, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
        checked += 1
    return checked


def test_output_layout_matches_conv2d_on_cpu() -> None:
    for dtype in (torch.float32, torch.float64):
        assert check_against_conv2d("cpu", dtype, 1e-5, torch_convbias.conv_bias2d) == len(CASES) * len(LAYOUTS) ** 2


def test_fake_kernel_promises_the_eager_strides() -> None:
    """torch.compile and export see, through the fake kernel, the strides the eager kernel returns."""
    for (xs, ws, pad, groups), xl, wl in itertools.product(CASES, LAYOUTS, LAYOUTS):
        x, w = layout(xl, xs, torch.float32, "cpu", 1), layout(wl, ws, torch.float32, "cpu", 2)
        b = torch.zeros(ws[0])
        args = ([1, 1], [pad, pad], [1, 1], groups)
        eager = torch.ops.convbias.forward(x, w, b, *args)
        with FakeTensorMode() as mode:
            fake = torch.ops.convbias.forward(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(b), *args)
        assert layout_facts(fake) == layout_facts(eager), (xs, xl, ws, wl)


def test_weight_gradient_keeps_the_weight_layout() -> None:
    """grad_weight comes back in the weight's own (suggested) format, with fresh strides, on every path."""
    for (xs, ws, pad, groups), wl in itertools.product(CASES, LAYOUTS):
        x = layout("channels_last", xs, torch.float32, "cpu", 1)
        w = layout(wl, ws, torch.float32, "cpu", 2)
        y = torch.ops.convbias.forward(x, w, None, [1, 1], [pad, pad], [1, 1], groups)
        grad_w, _ = torch.ops.convbias.param_grad(torch.ones_like(y), x, w, [1, 1], [pad, pad], [1, 1], groups, [True, False])
        assert suggest_memory_format(grad_w) == suggest_memory_format(w), (xs, ws, wl, grad_w.stride(), w.stride())
        assert grad_w.is_contiguous(memory_format=suggest_memory_format(w)), (ws, wl, grad_w.stride())


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_output_layout_matches_conv2d_on_cuda(dtype: torch.dtype) -> None:
    """float64 included: ATen's CUDA convolution returns NCHW in double whatever the inputs' layout."""
    tol = {torch.float32: 5e-3, torch.bfloat16: 4e-2, torch.float64: 1e-7}[dtype]
    assert check_against_conv2d("cuda", dtype, tol, torch_convbias.conv_bias2d) > 0


@cuda
def test_output_layout_matches_conv2d_without_cudnn() -> None:
    saved = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = False
    try:
        assert check_against_conv2d("cuda", torch.float32, 1e-4, torch_convbias.conv_bias2d) > 0
    finally:
        torch.backends.cudnn.enabled = saved

