"""bench/probe_space_to_depth.py: a strided convolution equals the stride-1 convolution of its space-to-depth
regrouping, and the weight gradient regrouped back equals the original weight's. The oracle is the original strided
problem itself (F.conv2d and autograd in float64, on the CPU), which shares no code with the regrouping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench import probe_space_to_depth as probe


@pytest.mark.parametrize(
    ("size", "kernel", "stride", "padding"),
    [
        ((224, 224), (11, 11), (4, 4), (2, 2)),  # AlexNet's stem: the padded input is exactly the input plus padding
        ((31, 29), (7, 7), (2, 2), (3, 3)),  # ResNet's stem on odd sizes: a zero row added past the padding
        ((22, 23), (5, 3), (3, 2), (0, 1)),  # unequal strides and kernels; a row no output reads cropped (22 -> 21)
        ((9, 9), (3, 3), (2, 2), (1, 1)),  # a 3x3 stride-2 stem
        ((8, 8), (2, 2), (2, 2), (0, 0)),  # kernel = stride: the regrouped kernel is 1x1
    ],
)
def test_regrouped_problem_equals_the_strided_convolution(
    size: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    w = torch.randn(5, 3, *kernel, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64)
    expected = F.conv2d(x, w, b, stride, padding)
    xs = probe.space_to_depth_input(x, kernel, stride, padding)
    ws = probe.space_to_depth_weight(w.detach(), stride).requires_grad_()
    assert xs.shape[1] == ws.shape[1] == 3 * stride[0] * stride[1]
    assert xs.is_contiguous(memory_format=torch.channels_last)
    actual = F.conv2d(xs, ws, b)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    seed = torch.randn_like(expected)
    (expected_grad,) = torch.autograd.grad(expected, w, seed)
    (regrouped_grad,) = torch.autograd.grad(actual, ws, seed)
    actual_grad = probe.weight_grad_from_space_to_depth(regrouped_grad, kernel, stride)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("size", "kernel", "padding"), [((12, 11), (3, 3), (1, 1)), ((9, 10), (5, 3), (2, 0))])
def test_unfolded_problem_equals_the_stride_one_stem(
    size: tuple[int, int], kernel: tuple[int, int], padding: tuple[int, int]
) -> None:
    """A stride-1 stem as the 1x1 convolution over its patches (float64: rows of two channels), and the weight's
    gradient back from the 1x1 weight's, against the stem itself."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    w = torch.randn(5, 3, *kernel, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64)
    expected = F.conv2d(x, w, b, 1, padding)
    channels = probe.patch_channels(3 * kernel[0] * kernel[1], torch.float64)
    xs = probe.patches_input(x, kernel, padding, channels)
    ws = probe.patches_weight(w.detach(), channels).requires_grad_()
    assert xs.shape[1] == ws.shape[1] == channels and channels % 2 == 0 and channels - 3 * kernel[0] * kernel[1] < 2
    actual = F.conv2d(xs, ws, b)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    seed = torch.randn_like(expected)
    (expected_grad,) = torch.autograd.grad(expected, w, seed)
    (unfolded_grad,) = torch.autograd.grad(actual, ws, seed)
    actual_grad = probe.weight_grad_from_patches(unfolded_grad, w.shape)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-12, atol=1e-12)


def test_geometry_names_a_kernel_that_does_not_fit() -> None:
    with pytest.raises(ValueError, match="kernel 11 with padding 0 does not fit an input of size 5"):
        probe.regrouped_geometry(5, 11, 4, 0)


def test_probe_runs_on_the_cpu_and_checks_every_variant(tmp_path: Path) -> None:
    """The probe's CPU run (our ops' CPU kernels, perf_counter timing): every variant timed and checked against
    float64, the JSON written."""
    assert probe.main(["--device", "cpu", "--tiny", "--modes", "fp32", "--warmup", "0", "--iters", "1", "--calls", "1",
                       "--repeats", "1", "--out", str(tmp_path)]) == 0  # fmt: skip
    (path,) = tmp_path.glob("space_to_depth-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == len(probe.TINY)
    for row in rows:
        assert "error" not in row, row.get("error")
        assert row["numerics_passed"], {name: check["message"] for name, check in row["numerics"].items()}
        assert set(row["gpu_ms"]) == set(probe.FORWARD + probe.WGRAD)
