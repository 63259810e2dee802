"""A public ``torch.autograd.Function`` over the convbias ops, for users who call autograd Functions directly.

``torch.ops.convbias.forward`` is differentiable on its own; this class exposes the same forward and backward
(weight and bias gradients through ``convbias::param_grad``, the input gradient only when needed).
"""

from __future__ import annotations

from typing import Any

import torch

from . import ops
from .functional import _pair


class ConvBiasFunction(torch.autograd.Function):
    """``ConvBiasFunction.apply(input, weight, bias, stride=1, padding=0, dilation=1, groups=1)``.

    ``stride``, ``padding`` and ``dilation`` are ints or (height, width) pairs; ``bias`` may be None.
    """

    @staticmethod
    def forward(
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
    ) -> torch.Tensor:
        return ops.forward(
            input, weight, bias, _pair("stride", stride), _pair("padding", padding), _pair("dilation", dilation), groups
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        input, weight, bias, *given = inputs
        defaults = (1, 0, 1, 1)  # forward's defaults, for the arguments left out of apply()
        stride, padding, dilation, groups = (*given, *defaults[len(given) :])
        ops.setup_context(
            ctx,
            (input, weight, bias, _pair("stride", stride), _pair("padding", padding), _pair("dilation", dilation), groups),
            output,
        )

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ops.backward(ctx, grad_output)
