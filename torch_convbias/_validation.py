"""Argument checks for the convbias ops, for the fake (meta) kernels.

They mirror ``csrc/conv_args.cpp`` check for check and message for message, so that a bad call fails the same
way in eager mode (C++ kernels), under ``torch.compile`` (fake tensors) and on meta tensors. Sizes may be
symbolic (``torch.SymInt``) here: the checks then become guards, as in PyTorch's own meta functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch._prims_common import suggest_memory_format

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_rank4(op: str, name: str, layout: str, t: torch.Tensor) -> None:
    if t.dim() != 4:
        raise ValueError(
            f"{op}: expected `{name}` to be a 4-D tensor {layout}, got a {t.dim()}-D tensor of shape {list(t.shape)}"
        )


def _check_like_input(op: str, name: str, t: torch.Tensor, input: torch.Tensor) -> None:
    if t.dtype != input.dtype:
        raise TypeError(f"{op}: expected `{name}` to have the dtype of `input` ({input.dtype}), got {t.dtype}")
    if t.device != input.device:
        raise ValueError(f"{op}: expected `{name}` on the device of `input` ({input.device}), got {t.device}")


def _check_pair(op: str, name: str, v: Sequence[int], lowest: int, what: str) -> None:
    if len(v) != 2:
        raise ValueError(f"{op}: expected `{name}` to have 2 elements (height, width), got {len(v)}")
    if not (v[0] >= lowest and v[1] >= lowest):
        raise ValueError(f"{op}: expected every `{name}` element to be {what}, got {list(v)}")


def _check_conv_args(
    op: str,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> None:
    _check_rank4(op, "input", "(N, C, H, W)", input)
    _check_rank4(op, "weight", "(out_channels, in_channels / groups, kH, kW)", weight)
    if input.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{op}: expected `input` to have a floating-point dtype (torch.float16, torch.bfloat16, torch.float32 "
            f"or torch.float64), got {input.dtype}"
        )
    _check_like_input(op, "weight", weight, input)
    _check_pair(op, "stride", stride, 1, "positive")
    _check_pair(op, "padding", padding, 0, "non-negative")
    _check_pair(op, "dilation", dilation, 1, "positive")
    if not groups > 0:
        raise ValueError(f"{op}: expected `groups` to be positive, got {groups}")

    channels, out_channels = input.shape[1], weight.shape[0]
    if channels % groups != 0:
        raise ValueError(f"{op}: expected `groups` ({groups}) to divide the input channels ({channels})")
    if out_channels % groups != 0:
        raise ValueError(
            f"{op}: expected `groups` ({groups}) to divide the output channels weight.size(0) ({out_channels})"
        )
    if weight.shape[1] * groups != channels:
        raise ValueError(
            f"{op}: expected `weight`.size(1) to be input channels / groups = {channels} / {groups} = "
            f"{channels // groups}, got {weight.shape[1]} (weight shape {list(weight.shape)})"
        )
    if not (weight.shape[2] > 0 and weight.shape[3] > 0):
        raise ValueError(f"{op}: expected `weight` to have a non-empty kernel, got shape {list(weight.shape)}")
    for d, axis in enumerate("HW"):
        padded = input.shape[2 + d] + 2 * padding[d]
        dilated_kernel = dilation[d] * (weight.shape[2 + d] - 1) + 1
        if dilated_kernel > padded:
            raise ValueError(
                f"{op}: the kernel of `weight` ({weight.shape[2]}x{weight.shape[3]}, dilation {list(dilation)}) "
                f"spans {dilated_kernel} along {axis}, more than the padded input "
                f"({input.shape[2 + d]} + 2 * {padding[d]} = {padded})"
            )


def check_forward_args(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> None:
    """Raise ValueError/TypeError naming the offending argument, as convbias::forward's kernels do."""
    op = "convbias.forward"
    _check_conv_args(op, input, weight, stride, padding, dilation, groups)
    if bias is not None:
        _check_like_input(op, "bias", bias, input)
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"{op}: expected `bias` of shape [{weight.shape[0]}] (out_channels = weight.size(0)), "
                f"got shape {list(bias.shape)}"
            )


def check_forward_residual_args(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> None:
    """Raise as convbias::forward_residual's kernels do: forward's checks, then `residual` of the input's dtype and
    device and the convolution's output shape."""
    check_forward_args(input, weight, bias, stride, padding, dilation, groups)
    op = "convbias.forward_residual"
    _check_like_input(op, "residual", residual, input)
    expected = output_size(input, weight, stride, padding, dilation)
    if list(residual.shape) != expected:
        raise ValueError(
            f"{op}: expected `residual` of shape {expected} (the convolution's output shape), got {list(residual.shape)}"
        )


# csrc/activation.cpp's names, in its order (the messages list them so).
ACTIVATIONS = ("identity", "relu", "leaky_relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh")


def check_activation(activation: str, negative_slope: float, op: str = "convbias.forward") -> None:
    """Raise ValueError for an unknown activation (listing the supported ones) or a slope that is not finite."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: expected `activation` to be one of {', '.join(ACTIVATIONS)}, got '{activation}'")
    if not math.isfinite(negative_slope):
        raise ValueError(f"{op}: expected `negative_slope` to be a finite number, got {negative_slope}")


def check_activation_backward_args(
    grad_output: torch.Tensor, saved: torch.Tensor, activation: str, negative_slope: float
) -> None:
    """Raise ValueError/TypeError naming the offending argument, as convbias::_activation_backward's kernels do."""
    op = "convbias._activation_backward"
    _check_rank4(op, "grad_output", "(N, K, H, W)", grad_output)
    if grad_output.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{op}: expected `grad_output` to have a floating-point dtype (torch.float16, torch.bfloat16, "
            f"torch.float32 or torch.float64), got {grad_output.dtype}"
        )
    if saved.dtype != grad_output.dtype:
        raise TypeError(f"{op}: expected `saved` to have the dtype of `grad_output` ({grad_output.dtype}), got {saved.dtype}")
    if saved.device != grad_output.device:
        raise ValueError(f"{op}: expected `saved` on the device of `grad_output` ({grad_output.device}), got {saved.device}")
    if list(saved.shape) != list(grad_output.shape):
        raise ValueError(
            f"{op}: expected `saved` of the shape of `grad_output` ({list(grad_output.shape)}), got {list(saved.shape)}"
        )
    check_activation(activation, negative_slope, op)


def activation_grad_memory_format(grad_output: torch.Tensor, saved: torch.Tensor) -> torch.memory_format:
    """The layout of _activation_backward's grad_z (csrc/activation.h, activation_grad_memory_format): channels_last
    when grad_output or saved suggests it (an expanded grad_output, as from ``out.sum()``, has no layout of its own)."""
    if memory_format_of(grad_output) == torch.channels_last or memory_format_of(saved) == torch.channels_last:
        return torch.channels_last
    return torch.contiguous_format


def check_param_grad_args(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> None:
    """Raise ValueError/TypeError naming the offending argument, as convbias::param_grad's kernels do."""
    op = "convbias.param_grad"
    _check_conv_args(op, input, weight, stride, padding, dilation, groups)
    _check_like_input(op, "grad_output", grad_output, input)
    expected = output_size(input, weight, stride, padding, dilation)
    if list(grad_output.shape) != expected:
        raise ValueError(
            f"{op}: expected `grad_output` of shape {expected} (the forward's output shape), "
            f"got {list(grad_output.shape)}"
        )


def check_input_grad_activation_args(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    saved: torch.Tensor,
    activation: str,
    negative_slope: float,
) -> None:
    """Raise ValueError/TypeError naming the offending argument, as convbias::_input_grad_activation's kernels do:
    param_grad's checks, then ``saved`` of input's dtype, device and shape, then the activation."""
    op = "convbias._input_grad_activation"
    check_param_grad_args(grad_output, input, weight, stride, padding, dilation, groups)
    if saved.dtype != input.dtype:
        raise TypeError(f"{op}: expected `saved` to have the dtype of `input` ({input.dtype}), got {saved.dtype}")
    if saved.device != input.device:
        raise ValueError(f"{op}: expected `saved` on the device of `input` ({input.device}), got {saved.device}")
    if list(saved.shape) != list(input.shape):
        raise ValueError(f"{op}: expected `saved` of the shape of `input` ({list(input.shape)}), got {list(saved.shape)}")
    check_activation(activation, negative_slope, op)


def output_size(
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> list[int]:
    """(N, K, H_out, W_out) of the convolution, for arguments that passed the checks."""
    spatial = [
        (input.shape[2 + d] + 2 * padding[d] - (dilation[d] * (weight.shape[2 + d] - 1) + 1)) // stride[d] + 1
        for d in range(2)
    ]
    return [input.shape[0], weight.shape[0], *spatial]


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    """PyTorch's reading of a 4-D tensor's layout (``suggest_memory_format``): csrc's memory_format_of."""
    if t.dim() == 4 and suggest_memory_format(t) == torch.channels_last:
        return torch.channels_last
    return torch.contiguous_format


def output_memory_format(input: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """F.conv2d's choice, by ATen's rule (csrc/conv_args.h): channels_last when the input or the weight suggests
    channels_last, except on CUDA for float64 and with ``torch.backends.cudnn.enabled`` False (NCHW there)."""
    if input.device.type == "cuda" and (input.dtype == torch.float64 or not torch.backends.cudnn.enabled):
        return torch.contiguous_format
    if memory_format_of(input) == torch.channels_last or memory_format_of(weight) == torch.channels_last:
        return torch.channels_last
    return torch.contiguous_format
