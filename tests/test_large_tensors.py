"""Calls past 2^31 - 1 elements in one tensor (cuDNN's engines index with 32 bits).

A call whose input or output side passes the limit while one sample's does not runs in parts of the batch that fit,
each part on its own route (a cuDNN graph writing into its slice of the output; the weight gradients of the parts
summed): the output passes first where a layer has more output than input channels (N >= 1024 RGB images into 64
channels). A call that cannot be split (one sample alone past the limit) runs ATen's convolution, which splits what it
can itself. The oracles are matrix products (einsum over the 1x1 convolutions used here), not convolutions, computed
one sample at a time in FP32; the tests need a few GiB of GPU memory each."""

from __future__ import annotations

import pytest
import torch
from conftest import cuda

import torch_convbias

LIMIT = "more than 2^31 - 1 elements"
CL = torch.channels_last
CONV_ARGS = ([1, 1], [0, 0], [1, 1], 1)


@cuda
def test_one_sample_past_the_limit_routes_forward_and_weight_gradient_to_aten() -> None:
    """A 1-channel 16384 x 16384 input (2^28 elements) into 9 channels: the output has 9 * 2^28 > 2^31 - 1 elements
    and one sample cannot be split."""
    x = torch.empty(1, 1, 16384, 16384, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    w = torch.randn(9, 1, 1, 1, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    b = torch.randn(9, device="cuda", dtype=torch.float16)
    info = torch_convbias.explain(x, w, b)
    assert info["path"] == "aten" and LIMIT in info["notes"][0] and "batch_parts" not in info, info
    dy = torch.empty(1, 9, 16384, 16384, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    grad = torch_convbias.explain_param_grad(dy, x, w)
    assert grad["weight_grad"]["path"] == "aten" and LIMIT in grad["weight_grad"]["notes"][0], grad


@cuda
def test_tensors_under_the_limit_are_neither_split_nor_sent_to_aten_for_it() -> None:
    """The same layer at a quarter of the size (9 * 2^26 output elements) takes a cuDNN graph whole: the check is the
    element count, not the shape."""
    x = torch.randn(1, 1, 8192, 8192, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    w = torch.randn(9, 1, 1, 1, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    b = torch.randn(9, device="cuda", dtype=torch.float16)
    info = torch_convbias.explain(x, w, b)
    assert "batch_parts" not in info and not any(LIMIT in note for note in info["notes"]), info


def large_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """6 channels_last fp16 samples of 8 x 4096 x 4096 into 24 channels (1x1): 6 * 24 * 2^24 = 2.4e9 output elements,
    4.0e8 per sample, so two parts of 3 samples."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(6, 4096, 4096, 8, device="cuda", dtype=torch.float16, generator=g).permute(0, 3, 1, 2)
    w = torch.randn(24, 8, 1, 1, device="cuda", dtype=torch.float16, generator=g).contiguous(memory_format=CL)
    b = torch.randn(24, device="cuda", dtype=torch.float16, generator=g)
    assert x.is_contiguous(memory_format=CL)
    return x, w, b


def conv1x1_sample(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, i: int) -> torch.Tensor:
    """Sample i of conv(x, w) + b in FP32 as a matrix product (the oracle, independent of any convolution code)."""
    return torch.einsum("chw,kc->khw", x[i].float(), w[:, :, 0, 0].float()) + b.float()[:, None, None]


def assert_parts(info: dict, what: str) -> None:
    assert info.get("batch_parts") == {"samples": 3, "count": 2}, (what, info)
    assert "runs in 2 parts of at most 3 samples" in info["notes"][0], (what, info)
    assert not any(LIMIT in note for note in info["notes"]), (what, info)


@cuda
@torch.no_grad()
def test_a_batch_past_the_limit_runs_in_parts_and_matches() -> None:
    x, w, b = large_batch()
    info = torch_convbias.explain(x, w, b)
    assert_parts(info, "forward")
    y = torch.ops.convbias.forward(x, w, b, *CONV_ARGS)
    assert y.shape == (6, 24, 4096, 4096) and y.is_contiguous(memory_format=CL)
    for i in range(6):  # both parts, every sample
        torch.testing.assert_close(y[i].float(), conv1x1_sample(x, w, b, i), rtol=1e-2, atol=1e-2, msg=f"sample {i}")


@cuda
@torch.no_grad()
def test_an_nchw_batch_past_the_limit_copies_its_parts_into_the_output() -> None:
    """NCHW tensors: a part's plan may run via channels_last copies (or ATen), whose result is not the output's slice:
    the part is copied into it (forward_in_batch_parts' other branch)."""
    x, w, b = large_batch()
    x, w = x.contiguous(), w.contiguous()
    assert_parts(torch_convbias.explain(x, w, b), "NCHW forward")
    y = torch.ops.convbias.forward(x, w, b, *CONV_ARGS)
    assert y.is_contiguous() and y.shape == (6, 24, 4096, 4096)
    for i in (0, 2, 3, 5):  # both edges of both parts
        torch.testing.assert_close(y[i].float(), conv1x1_sample(x, w, b, i), rtol=1e-2, atol=1e-2, msg=f"sample {i}")


@cuda
@torch.no_grad()
def test_a_batch_past_the_limit_keeps_its_preactivation_in_parts() -> None:
    """_forward_with_preactivation (autograd's forward for gelu): both outputs, every sample."""
    x, w, b = large_batch()
    assert_parts(torch_convbias.explain(x, w, b, activation="gelu", for_backward=True), "gelu for backward")
    out, z = torch.ops.convbias._forward_with_preactivation(x, w, b, *CONV_ARGS, "gelu", 0.01)
    assert out.is_contiguous(memory_format=CL) and z.is_contiguous(memory_format=CL)
    for i in range(6):
        want = conv1x1_sample(x, w, b, i)
        torch.testing.assert_close(z[i].float(), want, rtol=1e-2, atol=1e-2, msg=f"pre-activation, sample {i}")
        torch.testing.assert_close(
            out[i].float(), torch.nn.functional.gelu(want), rtol=1e-2, atol=1e-2, msg=f"output, sample {i}"
        )


@cuda
@torch.no_grad()
def test_a_residual_call_past_the_limit_runs_its_convolution_in_parts() -> None:
    """The residual's graph does not take parts: forward's route in parts, then the residual add and the activation."""
    x, w, b = large_batch()
    r = torch.randn(6, 4096, 4096, 24, device="cuda", dtype=torch.float16).permute(0, 3, 1, 2)
    info = torch_convbias.explain(x, w, b, activation="relu", residual=r)
    assert info["residual"]["fused"] is False and LIMIT in info["residual"]["why"], info
    assert_parts(info, "residual")
    y = torch.ops.convbias.forward_residual(x, w, b, r, *CONV_ARGS, "relu", 0.01)
    for i in (0, 5):
        want = torch.relu(conv1x1_sample(x, w, b, i) + r[i].float())
        torch.testing.assert_close(y[i].float(), want, rtol=1e-2, atol=2e-2, msg=f"sample {i}")


@cuda
@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_weight_and_bias_gradients_of_a_batch_past_the_limit_sum_the_parts(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grad_output of 2.4e9 elements: the weight gradient summed over the two parts (in FP32 for fp16), the bias
    gradient by our reduction over the whole tensor (64-bit indexing). Scaled so that fp16 sums stay in range; fp32
    without TF32 (which alone is off by ~1e-3 of the largest entry over these 1e8-term sums)."""
    if dtype == torch.float32:
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    x, w, _ = large_batch()
    x, w = x.to(dtype), w.to(dtype)
    g = torch.Generator(device="cuda").manual_seed(1)
    dy = (torch.randn(6, 4096, 4096, 24, device="cuda", dtype=dtype, generator=g) * 0.01).permute(0, 3, 1, 2)
    grad_info = torch_convbias.explain_param_grad(dy, x, w)
    assert_parts(grad_info["weight_grad"], "weight gradient")
    grad_weight, grad_bias = torch.ops.convbias.param_grad(dy, x, w, *CONV_ARGS, [True, True])
    want_weight = sum(torch.einsum("khw,chw->kc", dy[i].float(), x[i].float()) for i in range(6))
    want_bias = sum(dy[i].float().sum((1, 2)) for i in range(6))
    assert grad_weight.dtype == dtype and grad_weight.shape == w.shape
    scale = want_weight.abs().max().item()
    tol = 2e-3 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(grad_weight[:, :, 0, 0].float(), want_weight, rtol=tol, atol=tol * scale)
    torch.testing.assert_close(
        grad_bias.float(), want_bias, rtol=tol, atol=tol * want_bias.abs().max().item()
    )


def meta(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


def part_size(input: torch.Tensor, weight: torch.Tensor, output_numel: int) -> int | None:
    return torch.ops.convbias._batch_part_size(input, weight, output_numel)


def test_batch_parts_fit_the_limit_and_are_balanced() -> None:
    """The split's arithmetic, on meta tensors (nothing allocated): every part's input and output fit 2^31 - 1, parts
    are as equal as possible (at most two sizes, so at most two plans), and only a call that needs parts gets them."""
    limit = 2**31 - 1
    w = meta(64, 3, 3, 3)
    # N = 1024 RGB 224 x 224 images into 64 channels: the output (3.3e9) passes, the input (1.5e8) does not.
    per_sample = 64 * 224 * 224
    part = part_size(meta(1024, 3, 224, 224), w, 1024 * per_sample)
    assert part is not None and part * per_sample <= limit
    assert part == 512  # two equal parts, not 668 (the most that fit) + 356
    # Balanced: 1025 samples run as 513 + 512 rather than 668 + 357; 1337 (past 2 x 668) as 446 + 446 + 445.
    assert part_size(meta(1025, 3, 224, 224), w, 1025 * per_sample) == 513
    assert part_size(meta(1337, 3, 224, 224), w, 1337 * per_sample) == 446
    # The input side alone can ask for parts too: 786432 input elements per sample, 2730 samples fit.
    assert part_size(meta(3000, 3, 512, 512), meta(1, 3, 1, 1), 3000 * 512 * 512) == 1500
    assert part_size(meta(6, 8, 4096, 4096), meta(24, 8, 1, 1), 6 * 24 * 4096 * 4096) == 3


def test_calls_that_fit_or_cannot_be_split_get_no_parts() -> None:
    w = meta(9, 1, 1, 1)
    assert part_size(meta(2, 1, 8192, 8192), w, 2 * 9 * 8192 * 8192) is None  # fits: 1.2e9
    assert part_size(meta(1, 1, 16384, 16384), w, 9 * 16384 * 16384) is None  # one sample past the limit
    assert part_size(meta(2, 1, 16384, 16384), w, 2 * 9 * 16384 * 16384) is None  # each sample past it
    assert part_size(meta(4, 1, 4096, 4096), meta(2**31, 1, 1, 1), 4 * 2**31 * 4096 * 4096) is None  # the weight
    # float64 runs ATen whatever its size (no cuDNN float64 graphs): nothing to split for.
    x64 = meta(1024, 3, 224, 224, dtype=torch.float64)
    assert part_size(x64, meta(64, 3, 3, 3, dtype=torch.float64), 1024 * 64 * 224 * 224) is None
