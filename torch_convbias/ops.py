"""Python-side registrations of the convbias ops: fake kernels and autograd.

The schemas and the CPU/CUDA/autocast kernels are registered in C++ (``csrc/``); loading
``torch_convbias/libtorch_convbias.so`` (``torch_convbias/__init__.py`` does) registers them. This module adds
what torch.compile and autograd need:

* fake kernels (``torch.library.register_fake``) giving the output's shape, dtype, device and memory format (also of
  ``convbias::_activation_backward``, the activation's derivative fused with the bias gradient, and of
  ``convbias::_forward_with_preactivation``, the output with the pre-activation, both of which the autograd of
  forward calls, of ``convbias::forward_residual``, a residual block's ending, and of
  ``convbias::_input_grad_activation``, which the convbias backend puts into backward graphs);
* ``setup_context``/``backward`` for :class:`torch_convbias.ConvBiasFunction`.

The autograd of the ops is registered in C++ (``csrc/autograd.cpp``, no Python per call): forward's (and
forward_residual's) weight and bias gradients through ``convbias::param_grad``, the input gradient only when the input
needs one, the residual's as the gradient at the sum; param_grad itself raises NotImplementedError when
differentiated (double backward).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import _validation

forward = torch.ops.convbias.forward
forward_residual = torch.ops.convbias.forward_residual
param_grad = torch.ops.convbias.param_grad
activation_backward = torch.ops.convbias._activation_backward


@torch.library.register_fake("convbias::forward")
def _forward_fake(
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
    _validation.check_forward_args(input, weight, bias, stride, padding, dilation, groups)
    _validation.check_activation(activation, negative_slope)
    return torch.empty(
        _validation.output_size(input, weight, stride, padding, dilation),
        dtype=input.dtype,
        device=input.device,
        memory_format=_validation.output_memory_format(input, weight),
    )


@torch.library.register_fake("convbias::forward_residual")
def _forward_residual_fake(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    activation: str = "identity",
    negative_slope: float = 0.01,
) -> torch.Tensor:
    """As forward's output: the residual has its shape and does not change the memory format."""
    _validation.check_forward_residual_args(input, weight, bias, residual, stride, padding, dilation, groups)
    _validation.check_activation(activation, negative_slope, op="convbias.forward_residual")
    return torch.empty(
        _validation.output_size(input, weight, stride, padding, dilation),
        dtype=input.dtype,
        device=input.device,
        memory_format=_validation.output_memory_format(input, weight),
    )


@torch.library.register_fake("convbias::_forward_with_preactivation")
def _forward_with_preactivation_fake(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    activation: str,
    negative_slope: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, preactivation): two distinct tensors, each as forward's output (shape, dtype, memory format)."""
    output = _forward_fake(input, weight, bias, stride, padding, dilation, groups, activation, negative_slope)
    return output, torch.empty_like(output)


@torch.library.register_fake("convbias::param_grad")
def _param_grad_fake(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    _validation.check_param_grad_args(grad_output, input, weight, stride, padding, dilation, groups)
    grad_weight = (
        torch.empty(
            weight.shape,
            dtype=weight.dtype,
            device=weight.device,
            memory_format=_validation.memory_format_of(weight),
        )
        if output_mask[0]
        else None
    )
    grad_bias = weight.new_empty((weight.shape[0],)) if output_mask[1] else None
    return grad_weight, grad_bias


@torch.library.register_fake("convbias::_input_grad")
def _input_grad_fake(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """grad_input: input's shape and dtype, in the memory format F.conv2d gives its output for input and weight."""
    _validation.check_param_grad_args(grad_output, input, weight, stride, padding, dilation, groups)
    return torch.empty(
        input.shape, dtype=input.dtype, device=input.device, memory_format=_validation.output_memory_format(input, weight)
    )


@torch.library.register_fake("convbias::_activation_backward")
def _activation_backward_fake(
    grad_output: torch.Tensor,
    saved: torch.Tensor,
    activation: str,
    negative_slope: float,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad_z, grad_bias): grad_z of grad_output's shape and dtype, channels_last when grad_output or saved is
    (csrc/activation.h, activation_grad_memory_format); grad_bias of shape [K] when ``bias_grad``."""
    _validation.check_activation_backward_args(grad_output, saved, activation, negative_slope)
    grad_z = torch.empty(
        grad_output.shape,
        dtype=grad_output.dtype,
        device=grad_output.device,
        memory_format=_validation.activation_grad_memory_format(grad_output, saved),
    )
    grad_bias = grad_output.new_empty((grad_output.shape[1],)) if bias_grad else None
    return grad_z, grad_bias


@torch.library.register_fake("convbias::_input_grad_activation")
def _input_grad_activation_fake(
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
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What ``_activation_backward(_input_grad(grad_output, input, weight, ...), saved, ...)`` gives: grad_z of
    input's shape and dtype, channels_last when the input gradient (F.conv2d's rule) or saved is; grad_bias [C]."""
    _validation.check_input_grad_activation_args(
        grad_output, input, weight, stride, padding, dilation, groups, saved, activation, negative_slope
    )
    grad_input = torch.empty(
        input.shape, dtype=input.dtype, device=input.device, memory_format=_validation.output_memory_format(input, weight)
    )
    return _activation_backward_fake(grad_input, saved, activation, negative_slope, bias_grad)


def _input_stand_in(input: torch.Tensor) -> torch.Tensor:
    """A tensor of ``input``'s shape over one (uninitialised) element: what param_grad needs of the input for the bias
    gradient alone; its data is never read."""
    return input.new_empty(()).expand(input.shape)


def _cpu_computable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ATen's CPU convolutions can take it: float32 for a 16-bit CPU tensor (csrc/reference.h says why)."""
    return t.float() if t.device.type == "cpu" and t.dtype in (torch.float16, torch.bfloat16) else t


def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    """Save what :func:`backward` needs (used by :class:`ConvBiasFunction`): the input only when the weight needs a
    gradient (as the C++ autograd of the op)."""
    input, weight, _bias, stride, padding, dilation, groups = inputs
    ctx.save_for_backward(input if weight.requires_grad else _input_stand_in(input), weight)
    ctx.conv_params = (list(stride), list(padding), list(dilation), groups)


def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Gradients of convbias::forward: (input, weight, bias) then None for the conv parameters.

    The same formula as the C++ autograd of the op: weight and bias gradients from convbias::param_grad in one
    call; the input gradient only when the input requires grad.
    """
    input, weight = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv_params
    needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
    grad_input = grad_weight = grad_bias = None
    if needs_input and not torch.is_grad_enabled():
        grad_input = torch.ops.convbias._input_grad(grad_output, input, weight, stride, padding, dilation, groups)
    elif needs_input:
        # create_graph=True: ATen's differentiable convolution backward, as the C++ autograd does (on the CPU 16-bit
        # problems in float32, rounded once).
        grad_input = torch.ops.aten.convolution_backward(
            _cpu_computable(grad_output),
            _cpu_computable(input),
            _cpu_computable(weight),
            None,
            stride,
            padding,
            dilation,
            False,
            [0, 0],
            groups,
            [True, False, False],
        )[0].to(input.dtype)
    if needs_weight or needs_bias:
        grad_weight, grad_bias = param_grad(
            grad_output, input, weight, stride, padding, dilation, groups, [needs_weight, needs_bias]
        )
    return grad_input, grad_weight, grad_bias, None, None, None, None
