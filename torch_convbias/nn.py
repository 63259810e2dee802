"""``ConvBias2d``, a drop-in ``nn.Conv2d``, and conversion of existing models."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .functional import _forward, conv_bias2d

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SUPPORTED_DEVICES = ("cpu", "cuda", "meta")


class ConvBias2d(nn.Conv2d):
    """``nn.Conv2d`` whose convolution and bias run as one fused op (``torch.ops.convbias.forward``).

    Same constructor, attributes, ``state_dict`` and results as ``nn.Conv2d``; padding modes other than
    ``'zeros'`` pad the input first, exactly as ``nn.Conv2d`` does.
    """

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.padding_mode != "zeros":
            padded = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return conv_bias2d(padded, weight, bias, self.stride, 0, self.dilation, self.groups)
        if isinstance(self.padding, str) or input.dim() != 4:
            return conv_bias2d(input, weight, bias, self.stride, self.padding, self.dilation, self.groups)
        # The common case straight to the op: no Python argument normalisation per call.
        return _forward(input, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(input, self.weight, self.bias)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> ConvBias2d:
        """A ConvBias2d computing what ``conv`` computes, sharing its parameters, buffers and hooks.

        ``conv`` must be exactly an ``nn.Conv2d`` (not a subclass, whose forward may differ) with a floating-point
        weight on the CPU, a CUDA GPU or the meta device.
        """
        reason = _ineligibility(conv)
        if reason is not None:
            raise TypeError(f"ConvBias2d.from_conv: cannot convert {type(conv).__name__}: {reason}")
        converted = cls.__new__(cls)
        # The same state as conv, in containers of its own: registering a parameter or a hook on one module
        # later does not touch the other, while the Parameter objects themselves are shared.
        converted.__dict__.update(
            {key: copy.copy(value) if isinstance(value, (dict, set)) else value for key, value in conv.__dict__.items()}
        )
        return converted


def _ineligibility(module: nn.Module) -> str | None:
    """Why ``module`` cannot become a ConvBias2d, or None if it can."""
    if type(module) is not nn.Conv2d:
        return "only plain nn.Conv2d modules are converted"
    if module.weight.dtype not in _SUPPORTED_DTYPES:
        return f"weight dtype {module.weight.dtype} is not one of {', '.join(map(str, _SUPPORTED_DTYPES))}"
    if module.weight.device.type not in _SUPPORTED_DEVICES:
        return f"weight device {module.weight.device} is not one of {', '.join(_SUPPORTED_DEVICES)}"
    return None


def convert(model: nn.Module) -> nn.Module:
    """Replace, in place, every eligible ``nn.Conv2d`` in ``model`` by a ConvBias2d sharing its parameters.

    Returns ``model`` (or the converted module if ``model`` itself is an eligible ``nn.Conv2d``). Modules reached
    twice stay shared; subclasses of nn.Conv2d and unsupported dtypes or devices are left as they are.
    """
    converted: dict[int, nn.Module] = {}

    def visit(module: nn.Module) -> nn.Module:
        if id(module) in converted:
            return converted[id(module)]
        if _ineligibility(module) is None:
            result: nn.Module = ConvBias2d.from_conv(module)  # type: ignore[arg-type]
        else:
            # _modules, not named_children(): the latter skips a module's second name, which must be swapped too.
            for name, child in list(module._modules.items()):
                if child is not None:
                    setattr(module, name, visit(child))
            result = module
        converted[id(module)] = result
        return result

    return visit(model)
