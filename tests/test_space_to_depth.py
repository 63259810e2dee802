"""The space-to-depth way (csrc/cuda/space_to_depth.*, TORCH_CONVBIAS_SPACE_TO_DEPTH): a strided stem (at most 4 input
channels, stride above 1) runs as the stride-1 convolution of its input regrouped into stride-sized blocks, with the
weight regrouped alike; its weight gradient as the regrouped problem's, regrouped back. A stride-1 stem (VGG's 3x3 over
RGB) likewise runs as a 1x1 convolution over its input unfolded into patches (C * R * S channels, zero-padded to
16-byte rows).

On the CPU (the regrouping is device-independent, through the test hook ``convbias::_space_to_depth``): the regrouped
problem's convolution equals the strided one in float64 (the oracle is the original problem, which shares no code with
the regrouping), and the problems the way does not apply to get none. On CUDA, each knob setting in its own process
(knobs are read once): forced on, every case takes the way, says so in explain(), and equals F.conv2d in float64,
gradients included; timed (cudnn.benchmark) both ways are measured and the faster kept; untimed or off, never taken;
the choice survives the persistent plan cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import cuda, run_script_with_knobs

import torch_convbias  # noqa: F401 - registers torch.ops.convbias

ROOT = Path(__file__).resolve().parents[1]
ONES = [1, 1]


def regrouped(x: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int], dilation: list[int] = ONES,
              groups: int = 1) -> list[torch.Tensor]:  # fmt: skip
    return torch.ops.convbias._space_to_depth(x, w, stride, padding, dilation, groups)


@pytest.mark.parametrize(
    ("c", "size", "kernel", "stride", "padding"),
    [
        (3, (224, 224), (11, 11), (4, 4), (2, 2)),  # AlexNet's stem: 48 channels, 3x3
        (3, (31, 29), (7, 7), (2, 2), (3, 3)),  # ResNet's stem on odd sizes: 12 channels, 4x4; a zero row past the padding
        (1, (22, 23), (5, 3), (3, 2), (0, 1)),  # grey, unequal strides and kernels; a row no output reads cropped
        (4, (9, 9), (3, 3), (2, 2), (1, 1)),  # RGBA, a 3x3 stride-2 stem: 16 channels, 2x2
        (3, (8, 8), (2, 2), (2, 2), (0, 0)),  # kernel = stride: a 1x1 regrouped kernel
    ],
)
def test_regrouped_convolution_equals_the_strided_one(
    c: int, size: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, c, *size, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    w = torch.randn(5, c, *kernel, dtype=torch.float64)
    b = torch.randn(5, dtype=torch.float64)
    xs, ws = regrouped(x, w, list(stride), list(padding))
    blocks = stride[0] * stride[1]
    assert xs.shape[1] == ws.shape[1] == c * blocks
    assert list(ws.shape[2:]) == [-(-kernel[0] // stride[0]), -(-kernel[1] // stride[1])]
    assert xs.is_contiguous(memory_format=torch.channels_last) and ws.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(F.conv2d(xs, ws, b), F.conv2d(x, w, b, stride, padding), rtol=1e-12, atol=1e-12)
    # Every weight element appears once among the regrouped weight's entries; the rest are the padding's zeros.
    assert torch.equal(ws[ws != 0].sort().values, w[w != 0].sort().values)


@pytest.mark.parametrize(
    ("c", "size", "kernel", "stride", "padding"),
    [((3, (45, 45), (11, 11), (4, 4), (2, 2))), ((3, (31, 29), (7, 7), (2, 2), (3, 3))), ((1, (22, 23), (5, 3), (3, 2), (0, 1)))],
)
def test_the_regrouped_weights_gradient_gives_the_weights(
    c: int, size: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int]
) -> None:
    """Autograd of the regrouped convolution with respect to the regrouped weight, regrouped back
    (convbias::_space_to_depth_weight_grad), equals autograd of the strided convolution with respect to its weight."""
    torch.manual_seed(0)
    x = torch.randn(2, c, *size, dtype=torch.float64)
    w = torch.randn(5, c, *kernel, dtype=torch.float64, requires_grad=True)
    xs, ws = regrouped(x, w.detach(), list(stride), list(padding))
    ws.requires_grad_()
    seed = torch.randn_like(F.conv2d(x, w.detach(), None, stride, padding))
    (expected,) = torch.autograd.grad(F.conv2d(x, w, None, stride, padding), w, seed)
    (regrouped_grad,) = torch.autograd.grad(F.conv2d(xs, ws), ws, seed)
    actual = torch.ops.convbias._space_to_depth_weight_grad(regrouped_grad, x, w.detach(), list(stride), list(padding))
    assert actual.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


# (c, size, kernel, padding) of stride-1 stems: VGG's, grey with an unequal kernel, RGBA without padding, a 1x2 kernel,
# VGG's over rows of three tiles of the GPU's unfolding (128 pixels) with a partial last one, and 64 kernel rows (the
# most the unfolding stages: 64 input rows of a tile).
PATCHES = [
    (3, (12, 11), (3, 3), (1, 1)),
    (1, (9, 10), (5, 3), (2, 0)),
    (4, (7, 7), (3, 3), (0, 0)),
    (3, (8, 8), (1, 2), (0, 1)),
    (3, (5, 261), (3, 3), (1, 1)),
    (1, (66, 4), (64, 1), (0, 0)),
    (4, (20, 130), (16, 1), (3, 0)),  # the unfolding's largest stage: 4 + 15 input rows of 128 pixels, 4 channels
]


def patch_channels(c: int, kernel: tuple[int, int], dtype: torch.dtype) -> int:
    """C * R * S rounded up to 16-byte rows."""
    per_row = 16 // torch.empty((), dtype=dtype).element_size()
    return -(-(c * kernel[0] * kernel[1]) // per_row) * per_row


def patches_of_padded_input(x: torch.Tensor, kernel: tuple[int, int], padding: tuple[int, int], channels: int) -> torch.Tensor:
    """The oracle of the unfolding, written from its definition: channel (c, r, s) -> (c * R + r) * S + s of output
    pixel (i, j) is x zero-padded at (i + r, j + s); the channels past C * R * S are zeros."""
    n, c = x.shape[:2]
    padded = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    out_h, out_w = padded.shape[2] - kernel[0] + 1, padded.shape[3] - kernel[1] + 1
    out = torch.zeros(n, channels, out_h, out_w, dtype=x.dtype)
    for ci in range(c):
        for r in range(kernel[0]):
            for s in range(kernel[1]):
                out[:, (ci * kernel[0] + r) * kernel[1] + s] = padded[:, ci, r : r + out_h, s : s + out_w]
    return out


@pytest.mark.parametrize(("c", "size", "kernel", "padding"), PATCHES)
def test_unfolded_convolution_equals_the_stem(
    c: int, size: tuple[int, int], kernel: tuple[int, int], padding: tuple[int, int]
) -> None:
    """A stride-1 stem as a 1x1 convolution over its patches (float64: two channels a 16-byte row) equals the stem, the
    unfolded input is the oracle's, exactly, and the weight's gradient comes back from the 1x1 one."""
    torch.manual_seed(0)
    x = torch.randn(2, c, *size, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    w = torch.randn(5, c, *kernel, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64)
    xs, ws = regrouped(x, w.detach(), ONES, list(padding))
    channels = patch_channels(c, kernel, torch.float64)
    assert xs.shape[1] == ws.shape[1] == channels and list(ws.shape[2:]) == ONES
    assert xs.is_contiguous(memory_format=torch.channels_last) and ws.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(xs, patches_of_padded_input(x, kernel, padding, channels))
    expected = F.conv2d(x, w.detach(), b, 1, padding)
    torch.testing.assert_close(F.conv2d(xs, ws, b), expected, rtol=1e-12, atol=1e-12)
    ws.requires_grad_()
    seed = torch.randn_like(expected)
    (want,) = torch.autograd.grad(F.conv2d(x, w, None, 1, padding), w, seed)
    (unfolded_grad,) = torch.autograd.grad(F.conv2d(xs, ws), ws, seed)
    got = torch.ops.convbias._space_to_depth_weight_grad(unfolded_grad, x, w.detach(), ONES, list(padding))
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("c", "size", "kernel", "padding"), PATCHES)
@pytest.mark.parametrize("layout", ["channels_last", "nchw", "sliced"])
def test_gpu_unfolding_is_the_patches_of_the_padded_input(
    dtype: torch.dtype, c: int, size: tuple[int, int], kernel: tuple[int, int], padding: tuple[int, int], layout: str
) -> None:
    """The GPU's unfolding (unfold_patches.cu) gives exactly the oracle's tensor, zero padding channels included."""
    x = input_laid_out(dtype, c, size, layout, "cuda")
    w = torch.randn(5, c, *kernel, dtype=dtype, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        xs, ws = regrouped(x, w, ONES, list(padding))
        torch.cuda.synchronize()
    channels = patch_channels(c, kernel, dtype)
    assert xs.is_contiguous(memory_format=torch.channels_last) and xs.data_ptr() % 16 == 0
    assert torch.equal(xs.cpu(), patches_of_padded_input(x.cpu(), kernel, padding, channels))
    taps = c * kernel[0] * kernel[1]
    assert torch.equal(ws.reshape(5, channels)[:, :taps].cpu(), w.reshape(5, taps).cpu())
    assert not ws.reshape(5, channels)[:, taps:].any()
    events = [event.name for event in profile.events()]
    if not events:
        pytest.skip("the profiler recorded no CUDA activity here (compute-sanitizer?): values checked, kernel not seen")
    assert any("unfold_patches" in name for name in events), events


def blocks_of_padded_input(x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int],
                           padding: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """The oracle of the regrouping, written from its definition: x zero-padded (cropped past the rows any output reads)
    to whole blocks, each block's pixels made channels (c, a, b) -> c * bh * bw + a * bw + b."""
    n, c, size = x.shape[0], x.shape[1], x.shape[2:]
    blocks, pads = [], []
    for d in range(2):
        out = (size[d] + 2 * padding[d] - kernel[d]) // stride[d] + 1
        blocks.append(out - 1 + -(-kernel[d] // stride[d]))
        pads.append((padding[d], stride[d] * blocks[d] - padding[d] - size[d]))
    padded = F.pad(x, (*pads[1], *pads[0]))
    split = padded.reshape(n, c, blocks[0], stride[0], blocks[1], stride[1])
    return split.permute(0, 1, 3, 5, 2, 4).reshape(n, c * stride[0] * stride[1], *blocks)


# (c, size, kernel, stride, padding) of the regrouping tests against the oracle.
REGROUPINGS = [
    (3, (224, 224), (11, 11), (4, 4), (2, 2)),  # AlexNet's: 48 channels (16-byte rows: 16-byte stores)
    (3, (31, 29), (7, 7), (2, 2), (3, 3)),  # ResNet's on odd sizes: 12 channels (24-byte rows in 16-bit: 8 bytes)
    (1, (22, 23), (5, 3), (3, 2), (0, 1)),  # grey, unequal blocks, a cropped row: 6 channels (12-byte rows: 4 bytes)
    (4, (9, 9), (3, 3), (2, 2), (1, 1)),  # RGBA: 16 channels
    (1, (20, 19), (5, 5), (3, 3), (1, 1)),  # grey in 3x3 blocks: 9 channels (18-byte rows in 16-bit: a word a thread)
]


def input_laid_out(dtype: torch.dtype, c: int, size: tuple[int, int], layout: str, device: str = "cpu") -> torch.Tensor:
    """A [3, c, *size] input on ``device``: packed channels_last, packed NCHW, or a slice of a taller channels_last
    tensor (offset storage, batch stride past the packed one). Sliced on the device itself: ``.to(device)`` of a
    slice would make it packed."""
    torch.manual_seed(0)
    x = torch.randn(3, c, size[0] + 2, size[1], dtype=dtype).to(device).contiguous(memory_format=torch.channels_last)
    x = x[:, :, 1:-1] if layout == "sliced" else x[:, :, : size[0]]
    if layout == "nchw":
        return x.contiguous()
    return x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x


@pytest.mark.parametrize(("c", "size", "kernel", "stride", "padding"), REGROUPINGS)
@pytest.mark.parametrize("layout", ["channels_last", "nchw", "sliced"])
def test_regrouping_is_the_blocks_of_the_padded_input(
    c: int, size: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
    layout: str,
) -> None:  # fmt: skip
    """On the CPU (ATen's copies) the regrouped input is the oracle's, exactly."""
    x = input_laid_out(torch.float64, c, size, layout)
    xs, _ = regrouped(x, torch.randn(5, c, *kernel, dtype=torch.float64), list(stride), list(padding))
    assert torch.equal(xs, blocks_of_padded_input(x, kernel, stride, padding))


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("c", "size", "kernel", "stride", "padding"), REGROUPINGS)
@pytest.mark.parametrize("layout", ["channels_last", "nchw", "sliced"])
def test_gpu_regrouping_is_the_blocks_of_the_padded_input(
    dtype: torch.dtype, c: int, size: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int],
    padding: tuple[int, int], layout: str,
) -> None:  # fmt: skip
    """The one-pass kernel (space_to_depth_regroup.cu, which the profiler shows ran) gives exactly the oracle's tensor,
    bit for bit, channels_last and 16-byte aligned, from a channels_last, an NCHW or a sliced (offset, strided) input."""
    x = input_laid_out(dtype, c, size, layout, "cuda")
    assert layout != "sliced" or (x.storage_offset() > 0 and not x.is_contiguous(memory_format=torch.channels_last))
    w = torch.randn(5, c, *kernel, dtype=dtype, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        xs, _ = regrouped(x, w, list(stride), list(padding))
        torch.cuda.synchronize()
    assert xs.is_contiguous(memory_format=torch.channels_last) and xs.data_ptr() % 16 == 0
    assert torch.equal(xs.cpu(), blocks_of_padded_input(x.cpu(), kernel, stride, padding))
    events = [event.name for event in profile.events()]
    if not events:  # CUPTI is taken: compute-sanitizer (which the GPU runs use for memcheck) records no activity
        pytest.skip("the profiler recorded no CUDA activity here (compute-sanitizer?): values checked, kernel not seen")
    assert any("regroup_blocks" in name for name in events), events


def test_weight_grad_hook_refuses_problems_without_the_way() -> None:
    x, w = torch.randn(2, 8, 8, 8), torch.randn(4, 8, 3, 3)  # 8 channels: not a stem
    with pytest.raises(ValueError, match="the space-to-depth way does not apply"):
        torch.ops.convbias._space_to_depth_weight_grad(torch.randn(4, 8, 3, 3), x, w, [1, 1], [1, 1])
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)  # VGG's stem: 27 patch channels, 28 in float32's 16-byte rows
    with pytest.raises(ValueError, match=r"grad must have the regrouped weight's shape \[4, 28, 1, 1\]"):
        torch.ops.convbias._space_to_depth_weight_grad(torch.randn(4, 3, 3, 3), x, w, [1, 1], [1, 1])


def test_any_input_layout_is_regrouped() -> None:
    """NCHW input (the regrouping reads any strides): the same regrouped tensors as from channels_last."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 20, 20, dtype=torch.float64)
    w = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    from_nchw = regrouped(x, w, [2, 2], [2, 2])
    from_channels_last = regrouped(x.contiguous(memory_format=torch.channels_last), w, [2, 2], [2, 2])
    for a, b in zip(from_nchw, from_channels_last):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("c", "kernel", "stride", "dilation", "groups", "applies"),
    [
        (3, 3, 1, 1, 1, True),  # stride 1: patches, 27 channels
        (4, 4, 1, 1, 1, True),  # RGBA 4x4: 64 channels, the most patches take
        (3, 5, 1, 1, 1, False),  # 5x5 RGB: 75 channels, more than the patches would be worth
        (3, 1, 1, 1, 1, False),  # 1x1 stride 1: already one pixel a patch
        (3, 3, 1, 2, 1, False),  # dilated patches
        (8, 3, 1, 1, 1, False),  # 8 channels at stride 1: not a stem
        (8, 3, 2, 1, 1, False),  # 8 channels: not a stem
        (4, 3, 2, 1, 2, False),  # grouped
        (3, 3, 2, 2, 1, False),  # dilated
        (3, 1, 2, 1, 1, False),  # 1x1 stride 2: the blocks' zeros would quadruple the multiply-adds
        (3, 3, 2, 1, 1, True),  # 3x3 stride 2: 16 taps for 9, within twice
        (3, 3, 3, 1, 1, True),  # 3x3 stride 3: one block, no zeros
    ],
)
def test_which_problems_it_applies_to(c: int, kernel: int, stride: int, dilation: int, groups: int, applies: bool) -> None:
    x = torch.randn(2, c, 12, 12)
    w = torch.randn(6, c // groups, kernel, kernel)
    assert (regrouped(x, w, [stride] * 2, [0, 0], [dilation] * 2, groups) != []) == applies


def test_a_regrouped_input_past_32_bit_indexing_is_not_taken() -> None:
    """The regrouped input has more elements than the input (the blocks' zero padding): where it would pass INT32_MAX
    the way does not apply (meta tensors: nothing allocated)."""
    w = torch.empty(64, 3, 11, 11, device="meta")
    fits = torch.empty(1024, 3, 224, 224, device="meta")  # 1024 * 48 * 57 * 57 = 1.6e8 elements
    too_big = torch.empty(14000, 3, 224, 224, device="meta")  # 2.11e9 elements; regrouped 2.18e9
    assert [list(t.shape) for t in regrouped(fits, w, [4, 4], [2, 2])] == [[1024, 48, 57, 57], [64, 48, 3, 3]]
    assert regrouped(too_big, w, [4, 4], [2, 2]) == []


def test_patches_past_32_bit_indexing_are_not_taken() -> None:
    """The patches have C * R * S channels (padded) where the input has C: past INT32_MAX elements the way does not
    apply (meta tensors, float32: 28 channels)."""
    w = torch.empty(64, 3, 3, 3, device="meta")
    fits = torch.empty(1024, 3, 224, 224, device="meta")  # 1024 * 28 * 224 * 224 = 1.44e9 elements
    too_big = torch.empty(1600, 3, 224, 224, device="meta")  # 2.25e9
    assert [list(t.shape) for t in regrouped(fits, w, ONES, ONES)] == [[1024, 28, 224, 224], [64, 28, 1, 1]]
    assert regrouped(too_big, w, ONES, ONES) == []


# (n, c, hw, k, kernel, stride, padding, dtype name, activation, channels_last): AlexNet's and ResNet's stems scaled
# down, a 3x3 stride-2 stem, grey and RGBA inputs, relu / gelu / identity, an NCHW case (via channels_last copies), and
# VGG's stride-1 stem (patches).
CASES = [
    (4, 3, 43, 16, 11, 4, 2, "bfloat16", "relu", True),
    (4, 3, 30, 16, 7, 2, 3, "float16", "relu", True),
    (4, 3, 30, 16, 7, 2, 3, "float32", "gelu", True),
    (3, 4, 17, 8, 3, 2, 1, "bfloat16", "identity", True),
    (3, 1, 20, 8, 5, 2, 2, "float32", "relu", True),
    (2, 3, 30, 16, 7, 2, 3, "bfloat16", "relu", False),
    (3, 3, 20, 16, 3, 1, 1, "bfloat16", "relu", True),  # VGG's stem scaled down: patches, 27 -> 32 channels
    (3, 3, 20, 16, 3, 1, 1, "float32", "gelu", True),  # 27 -> 28 channels
]

# Runs CASES (forward and, under autograd, every gradient) against float64 and prints, per case, what explain() says.
SCRIPT = r"""
import json, sys, torch, torch.nn.functional as F, torch_convbias
sys.path.insert(0, "tests")
from conftest import MODES, assert_close
from test_space_to_depth import CASES
ACTIVATIONS = {"identity": lambda t: t, "relu": F.relu, "gelu": F.gelu}
torch.backends.cudnn.allow_tf32 = False
torch.backends.cudnn.benchmark = sys.argv[1] == "benchmark"
rows = []
for n, c, hw, k, r, stride, pad, mode_name, act, channels_last in CASES:
    mode = MODES[mode_name]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    g = torch.Generator(device="cuda").manual_seed(n * 100 + c * 10 + r)
    # empty_like(memory_format=...).copy_: a grey (C=1) batch made by .contiguous(memory_format=channels_last) keeps
    # its NCHW strides (it counts as contiguous both ways), which ATen and the op read as NCHW.
    x = torch.randn(n, c, hw, hw, device="cuda", generator=g).to(mode.dtype)
    x = torch.empty_like(x, memory_format=fmt).copy_(x)
    w = (torch.randn(k, c, r, r, device="cuda", generator=g) / (c * r * r) ** 0.5).to(mode.dtype)
    w = torch.empty_like(w, memory_format=fmt).copy_(w)
    b = torch.randn(k, device="cuda", generator=g).to(mode.dtype)
    leaves = [t.detach().requires_grad_(True) for t in (x, w, b)]
    y = torch_convbias.conv_bias2d(*leaves, stride=stride, padding=pad, activation=act)
    dy = torch.randn(y.shape, device="cuda", generator=g).to(mode.dtype)
    y.backward(dy)
    ref_leaves = [t.detach().cpu().double().requires_grad_(True) for t in (x, w, b)]
    pre = F.conv2d(*ref_leaves, stride=stride, padding=pad)
    ref = ACTIVATIONS[act](pre)
    if act == "relu":
        # ReLU's derivative where our output is positive (a pre-activation within rounding of 0 lands on either side).
        pre.backward(dy.cpu().double() * (y.detach().cpu() > 0))
    else:
        ref.backward(dy.cpu().double())
    for what, got, want in [("output", y, ref)] + [(f"grad {i}", t.grad, u.grad) for i, (t, u) in enumerate(zip(leaves, ref_leaves))]:
        assert_close(got.detach().cpu().double(), want.detach(), mode, f"case {(n, c, hw, k, r, mode_name, act)}: {what}")
    info = torch_convbias.explain(x, w, b, stride=stride, padding=pad, activation=act)
    trained = torch_convbias.explain(x, w, b, stride=stride, padding=pad, activation=act, for_backward=True)
    wgrad = torch_convbias.explain_param_grad(dy, x, w, stride=stride, padding=pad)["weight_grad"]
    rows.append({"s2d_wgrad": wgrad.get("space_to_depth"), "wgrad_notes": wgrad.get("notes", []),
                 "wgrad_timings": {"s2d": wgrad.get("space_to_depth_ms", -1), "own": wgrad.get("own_way_ms", -1)},
                 "case": [c, r, stride, mode_name, act, channels_last], "s2d": info.get("space_to_depth"),
                 "s2d_for_backward": trained.get("space_to_depth"), "path": info["path"],
                 "padded": info.get("padded_channels"),
                 "timings": dict(info.get("layout_timings") or []), "notes": info.get("notes", []),
                 "layout": info["layout"]})
print(json.dumps({"rows": rows, "cache": torch_convbias.cache_info()}))
"""


def run(tuning: str, **knobs: str) -> dict[str, Any]:
    return run_script_with_knobs(SCRIPT, tuning, **knobs)


def names_the_way(note: str) -> bool:
    return "regrouped into" in note or "unfolded into" in note


def regrouped_problem_runs_aten(notes: list[str]) -> bool:
    return any(names_the_way(note) and "plan is ATen's" in note for note in notes)


def weight_grad_applies(case: tuple[Any, ...]) -> bool:
    """The weight gradient's way: channels_last, x's channel rows misaligned and the regrouped ones 16-byte multiples."""
    _, c, _, _, _, stride, _, mode_name, _, channels_last = case
    size = {"bfloat16": 2, "float16": 2, "float32": 4}[mode_name]
    regrouped_rows_aligned = stride == 1 or (c * stride * stride * size) % 16 == 0  # patches: padded to 16 bytes
    return channels_last and (c * size) % 16 != 0 and regrouped_rows_aligned


def regrouped_channels(c: int, r: int, stride: int, mode_name: str) -> int:
    if stride == 1:
        return patch_channels(c, (r, r), getattr(torch, mode_name))
    return c * stride * stride


def expected_regrouping(case: tuple[Any, ...]) -> dict[str, Any]:
    _, c, _, _, r, stride, _, mode_name, *_ = case
    if stride == 1:
        return {"blocks": [r, r], "channels": regrouped_channels(c, r, 1, mode_name), "kernel": [1, 1], "patches": True}
    return {"blocks": [stride, stride], "channels": c * stride * stride, "kernel": [-(-r // stride)] * 2, "patches": False}


@cuda
def test_forced_way_matches_conv2d_and_is_reported() -> None:
    """TORCH_CONVBIAS_SPACE_TO_DEPTH=on: every case runs regrouped (the NCHW one behind channels_last copies), explain()
    says how, and output and gradients equal float64 F.conv2d."""
    report = run("untimed", space_to_depth="on", nchw="copy")
    taken = []
    for index, (case, row) in enumerate(zip(CASES, report["rows"])):
        if regrouped_problem_runs_aten(row["notes"]):  # (an NCHW plan carries its channels_last plan's notes)
            assert row["s2d"] is None, row
            continue
        s2d = row["s2d"]
        keys = ("blocks", "channels", "kernel", "patches")
        assert s2d is not None and {key: s2d[key] for key in keys} == expected_regrouping(case), row
        assert row["s2d_for_backward"] is not None, row
        assert any(names_the_way(note) and "SPACE_TO_DEPTH=on" in note for note in row["notes"]), row
        taken.append(index)
    # Where the regrouped rows are 16-byte multiples (48 bf16, 16 bf16, 12 and 4 float32 channels) a graph runs them;
    # 12 channels in 16-bit (24-byte rows) may have none untimed (the padded way needs timed choices). The patches
    # (6, 7) are padded to 16-byte rows.
    assert {0, 2, 3, 4, 6, 7} <= set(taken), report["rows"]
    # The weight gradient (checked against float64 by the script): regrouped wherever its way applies and a graph runs
    # the regrouped problem.
    for case, row in zip(CASES, report["rows"]):
        if not weight_grad_applies(case):
            assert row["s2d_wgrad"] is None, row
        elif not regrouped_problem_runs_aten(row["wgrad_notes"]):
            assert row["s2d_wgrad"] == expected_regrouping(case), row
    assert sum(row["s2d_wgrad"] is not None for row in report["rows"]) >= 3, report["rows"]


@cuda
def test_timed_choice_measures_both_ways_and_keeps_the_faster() -> None:
    """Under cudnn.benchmark (default knob): both complete ways measured (the regrouping included), the regrouped one
    taken exactly when it measured faster; results equal float64 F.conv2d either way."""
    report = run("benchmark")
    measured = 0
    for case, row in zip(CASES, report["rows"]):
        if not case[-1]:
            continue  # NCHW: its own layout timings; the channels_last plan behind the copies chose for itself
        if regrouped_problem_runs_aten(row["notes"]):
            assert row["s2d"] is None and "space_to_depth" not in row["timings"], row
            continue
        timings = row["timings"]
        assert "space_to_depth" in timings and all(ms > 0 for ms in timings.values()), row
        own = min(ms for way, ms in timings.items() if way != "space_to_depth")
        if row["padded"] is not None:
            # The padded way won over regrouping this problem; its own plan (float32 C=3 padded to 4) may regroup the
            # padded problem, which explain reports.
            assert timings["space_to_depth"] >= own, row
            padded_problem = regrouped_channels(row["padded"], case[4], case[5], case[7])
            assert row["s2d"] is None or row["s2d"]["channels"] == padded_problem, row
        else:
            assert (row["s2d"] is not None) == (timings["space_to_depth"] < own), row
        measured += 1
    assert measured > 0, report["rows"]
    wgrad_measured = 0
    for case, row in zip(CASES, report["rows"]):
        timings = row["wgrad_timings"]
        if not weight_grad_applies(case) or regrouped_problem_runs_aten(row["wgrad_notes"]):
            assert row["s2d_wgrad"] is None, row
            continue
        assert timings["s2d"] > 0 and timings["own"] > 0, row
        assert (row["s2d_wgrad"] is not None) == (timings["s2d"] < timings["own"]), row
        wgrad_measured += 1
    assert wgrad_measured > 0, report["rows"]


@cuda
def test_untimed_and_off_run_the_problem_its_own_way() -> None:
    """Untimed choices (the default) never regroup (heuristics cannot weigh the regrouping), nor does
    TORCH_CONVBIAS_SPACE_TO_DEPTH=off under cudnn.benchmark."""
    for tuning, knobs in (("untimed", {}), ("benchmark", {"space_to_depth": "off"})):
        report = run(tuning, **knobs)
        for row in report["rows"]:
            assert row["s2d"] is None and row["s2d_for_backward"] is None, (tuning, row)
            assert "space_to_depth" not in row["timings"], (tuning, row)
            assert row["s2d_wgrad"] is None and row["wgrad_timings"]["s2d"] == -1, (tuning, row)


@cuda
def test_regrouped_plan_is_stored_and_loaded(tmp_path: Path) -> None:
    """A timed regrouped choice (forced on, so that it is the one made) goes to the persistent plan cache and the next
    process loads it, regrouped still, with the same results (the script checks them)."""
    first = run("benchmark", space_to_depth="on", plan_cache_dir=str(tmp_path))
    assert first["cache"]["disk_writes"] > 0, first["cache"]
    second = run("benchmark", space_to_depth="on", plan_cache_dir=str(tmp_path))
    assert second["cache"]["disk_hits"] > 0, second["cache"]
    for before, after in zip(first["rows"], second["rows"]):
        assert after["s2d"] == before["s2d"] and after["s2d_wgrad"] == before["s2d_wgrad"], (before, after)
        if after["s2d"] is not None and after["case"][-1]:
            assert any("loaded from the persistent plan cache" in note for note in after["notes"]), after


@cuda
def test_knob_value_is_checked() -> None:
    """An unknown TORCH_CONVBIAS_SPACE_TO_DEPTH is refused by name, as a ValueError, when the knobs are first read."""
    env = {**os.environ, "TORCH_CONVBIAS_SPACE_TO_DEPTH": "maybe"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, "untimed"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    message = "TORCH_CONVBIAS_SPACE_TO_DEPTH must be auto, on or off, got 'maybe'"
    assert result.returncode != 0 and message in result.stderr and "ValueError" in result.stderr, result.stderr[-3000:]
