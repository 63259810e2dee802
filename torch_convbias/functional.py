"""``conv_bias2d``: ``torch.nn.functional.conv2d`` with the bias fused into the convolution."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import _C, _validation, ops


def _forward(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    activation: str = "identity",
    negative_slope: float = 0.01,
) -> torch.Tensor:
    """``torch.ops.convbias.forward`` with normalised arguments. Eagerly, with plain tensors and ints, through
    ``_C._forward_eager``, which skips torch.ops' generic argument matching (~5 us per call, most of a small
    layer's host time); under torch.compile / export tracing, __torch_function__ modes, or for tensor subclasses
    and SymInts (the entry returns NotImplemented), through torch.ops, so that tracers and overrides see the op."""
    if not torch.compiler.is_compiling() and not torch._C._is_torch_function_mode_enabled():
        if activation == "identity":
            output = _C._forward_eager(input, weight, bias, stride, padding, dilation, groups)
        else:
            output = _C._forward_eager(
                input, weight, bias, stride, padding, dilation, groups, activation, float(negative_slope)
            )
        if output is not NotImplemented:
            return output
    if activation == "identity":
        return ops.forward(input, weight, bias, stride, padding, dilation, groups)
    return ops.forward(input, weight, bias, stride, padding, dilation, groups, activation, negative_slope)


def _pair(name: str, value: int | Sequence[int]) -> list[int]:
    """An int or a sequence of one or two ints as [height, width], as F.conv2d accepts them."""
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return [value, value]
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) in (1, 2):
        if all(isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool) for v in value):
            return [value[0], value[-1]]
    raise ValueError(f"conv_bias2d: expected `{name}` to be an int or a pair of ints, got {value!r}")


def _resolve_string_padding(
    input: torch.Tensor, weight: torch.Tensor, padding: str, stride: list[int], dilation: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """Turn padding='valid'|'same' into symmetric padding, padding the input itself where 'same' needs one more
    row or column at the end (even effective kernels), as F.conv2d does."""
    if padding == "valid":
        return input, [0, 0]
    if padding != "same":
        raise ValueError(f"conv_bias2d: expected `padding` to be 'valid', 'same', an int or a pair of ints, got {padding!r}")
    if stride != [1, 1]:
        raise ValueError(f"conv_bias2d: padding='same' is not supported for strided convolutions (stride={stride})")
    if weight.dim() != 4:
        raise ValueError(
            f"conv_bias2d: expected `weight` to be a 4-D tensor (out_channels, in_channels / groups, kH, kW), "
            f"got a {weight.dim()}-D tensor of shape {list(weight.shape)}"
        )
    totals = [dilation[d] * (weight.shape[2 + d] - 1) for d in range(2)]
    before = [total // 2 for total in totals]
    extra = [total - 2 * b for total, b in zip(totals, before)]  # 0 or 1, added after (bottom, right)
    if extra != [0, 0]:
        input = F.pad(input, [0, extra[1], 0, extra[0]])
    return input, before


def conv_bias2d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | Sequence[int] = 1,
    padding: str | int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    activation: str = "identity",
    negative_slope: float = 0.01,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch.nn.functional.conv2d``'s signature and result, computed by ``torch.ops.convbias.forward``, with an
    optional activation applied in the same call.

    With ``residual`` (a tensor of the convolution's output shape, dtype and device) the result is
    ``act(conv2d(input, weight, bias) + residual)``, a residual block's ending, by
    ``torch.ops.convbias.forward_residual`` (on CUDA one cuDNN graph where an engine runs it).

    ``input`` is (N, C, H, W) or unbatched (C, H, W); ``padding`` is an int, a (height, width) pair, ``'valid'``
    or ``'same'``. ``activation``: ``'identity'`` (none), ``'relu'``, ``'leaky_relu'`` (``negative_slope``, as
    ``F.leaky_relu``), ``'gelu'``, ``'gelu_tanh'`` (``F.gelu(approximate='tanh')``), ``'silu'``, ``'sigmoid'``,
    ``'tanh'``. Differentiable: weight and bias gradients come from ``convbias::param_grad`` applied to the
    activation's gradient.
    """
    if not isinstance(activation, str) or isinstance(negative_slope, bool) or not isinstance(negative_slope, (int, float)):
        raise ValueError(
            f"conv_bias2d: expected `activation` to be one of {', '.join(_validation.ACTIVATIONS)} and "
            f"`negative_slope` a number, got {activation!r} and {negative_slope!r}"
        )
    stride = _pair("stride", stride)
    dilation = _pair("dilation", dilation)
    unbatched = input.dim() == 3
    if unbatched:
        input = input.unsqueeze(0)
    if isinstance(padding, str):
        input, padding = _resolve_string_padding(input, weight, padding, stride, dilation)
    else:
        padding = _pair("padding", padding)
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"conv_bias2d: expected `residual` to be a tensor or None, got {type(residual).__name__}")
        residual = residual.unsqueeze(0) if unbatched else residual
        output = ops.forward_residual(
            input, weight, bias, residual, stride, padding, dilation, groups, activation, negative_slope
        )
    else:
        output = _forward(input, weight, bias, stride, padding, dilation, groups, activation, negative_slope)
    return output.squeeze(0) if unbatched else output
