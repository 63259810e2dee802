"""``ConvBias2d``, a drop-in ``nn.Conv2d``, and conversion of existing models."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import _validation
from .functional import _forward, conv_bias2d

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SUPPORTED_DEVICES = ("cpu", "cuda", "meta")


class ConvBias2d(nn.Conv2d):
    """``nn.Conv2d`` whose convolution, bias and (optionally) activation run as one op
    (``torch.ops.convbias.forward``).

    Same constructor, attributes, ``state_dict`` and results as ``nn.Conv2d``, plus two keyword arguments:
    ``activation`` (``'identity'``, the default: none; ``'relu'``, ``'leaky_relu'``, ``'gelu'``, ``'gelu_tanh'``,
    ``'silu'``, ``'sigmoid'``, ``'tanh'``) and ``negative_slope`` (leaky_relu's). With an activation the module
    computes what ``nn.Sequential(nn.Conv2d(...), activation module)`` does. Padding modes other than ``'zeros'``
    pad the input first, exactly as ``nn.Conv2d`` does.
    """

    def __init__(self, *args: Any, activation: str = "identity", negative_slope: float = 0.01, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _validation.check_activation(activation, negative_slope, op="ConvBias2d")
        self.activation = activation
        self.negative_slope = float(negative_slope)

    def _conv_forward(
        self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Modules made (or pickled) before the activation existed have none. The slope is read only where it counts:
        # under torch.compile(dynamic=True) a float attribute of a user module is traced as a symbolic float, which
        # Dynamo then specializes by restarting the whole frame's analysis (a second compilation of every graph).
        activation = getattr(self, "activation", "identity")
        act = activation, (self.negative_slope if activation == "leaky_relu" else 0.01)
        if self.padding_mode != "zeros":
            padded = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return conv_bias2d(padded, weight, bias, self.stride, 0, self.dilation, self.groups, *act, residual=residual)
        if isinstance(self.padding, str) or input.dim() != 4 or residual is not None:
            return conv_bias2d(
                input, weight, bias, self.stride, self.padding, self.dilation, self.groups, *act, residual=residual
            )
        # The common case straight to the op: no Python argument normalisation per call.
        return _forward(input, weight, bias, self.stride, self.padding, self.dilation, self.groups, *act)

    def forward(self, input: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``nn.Conv2d``'s forward (then the module's activation). With ``residual`` (a tensor of the output's shape):
        ``act(conv(input) + bias + residual)``, a residual block's ending in one op (``convbias.forward_residual``)."""
        return self._conv_forward(input, self.weight, self.bias, residual)

    def extra_repr(self) -> str:
        act = getattr(self, "activation", "identity")
        if act == "identity":
            return super().extra_repr()
        slope = f", negative_slope={self.negative_slope}" if act == "leaky_relu" else ""
        return f"{super().extra_repr()}, activation={act!r}{slope}"

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, activation: str = "identity", negative_slope: float = 0.01) -> ConvBias2d:
        """A ConvBias2d computing what ``conv`` (followed by ``activation``) computes, sharing its parameters,
        buffers and hooks.

        ``conv`` must be exactly an ``nn.Conv2d`` (not a subclass, whose forward may differ) with a floating-point
        weight on the CPU, a CUDA GPU or the meta device.
        """
        reason = _ineligibility(conv)
        if reason is not None:
            raise TypeError(f"ConvBias2d.from_conv: cannot convert {type(conv).__name__}: {reason}")
        _validation.check_activation(activation, negative_slope, op="ConvBias2d.from_conv")
        converted = cls.__new__(cls)
        # The same state as conv, in containers of its own: registering a parameter or a hook on one module
        # later does not touch the other, while the Parameter objects themselves are shared.
        converted.__dict__.update(
            {key: copy.copy(value) if isinstance(value, (dict, set)) else value for key, value in conv.__dict__.items()}
        )
        converted.activation = activation
        converted.negative_slope = float(negative_slope)
        return converted


# The activation modules convert() fuses into the convolution before them, as the op's (activation, slope).
def _fusable_activation(module: nn.Module) -> tuple[str, float] | None:
    kind = type(module)
    if kind is nn.ReLU:
        return "relu", 0.01
    if kind is nn.LeakyReLU:
        return "leaky_relu", float(module.negative_slope)  # type: ignore[arg-type]
    if kind is nn.GELU:
        return {"none": ("gelu", 0.01), "tanh": ("gelu_tanh", 0.01)}.get(module.approximate)  # type: ignore[arg-type]
    if kind is nn.SiLU:
        return "silu", 0.01
    if kind is nn.Sigmoid:
        return "sigmoid", 0.01
    if kind is nn.Tanh:
        return "tanh", 0.01
    return None


def _has_hooks(module: nn.Module) -> bool:
    """Forward, forward-pre or backward hooks on the module (which fusion would skip or feed another tensor)."""
    return any(
        getattr(module, name, None)
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    )


def _ineligibility(module: nn.Module) -> str | None:
    """Why ``module`` cannot become a ConvBias2d, or None if it can."""
    if type(module) is not nn.Conv2d:
        return "only plain nn.Conv2d modules are converted"
    if module.weight.dtype not in _SUPPORTED_DTYPES:
        return f"weight dtype {module.weight.dtype} is not one of {', '.join(map(str, _SUPPORTED_DTYPES))}"
    if module.weight.device.type not in _SUPPORTED_DEVICES:
        return f"weight device {module.weight.device} is not one of {', '.join(_SUPPORTED_DEVICES)}"
    return None


def convert(model: nn.Module, fuse_activations: bool = True) -> nn.Module:
    """Replace, in place, every eligible ``nn.Conv2d`` in ``model`` by a ConvBias2d sharing its parameters.

    With ``fuse_activations`` (the default), an ``nn.Conv2d`` directly followed inside an ``nn.Sequential`` by a
    supported activation module (``nn.ReLU``, ``nn.LeakyReLU``, ``nn.GELU``, ``nn.SiLU``, ``nn.Sigmoid``,
    ``nn.Tanh``) becomes one ConvBias2d with that activation, and the activation's slot an ``nn.Identity`` (names,
    indices and ``state_dict`` unchanged). A pair is left unfused when either module carries hooks, when either is
    reachable more than once in the model (its output may be used elsewhere), or when global module hooks are
    registered: what they observe would change.

    Returns ``model`` (or the converted module if ``model`` itself is an eligible ``nn.Conv2d``). Modules reached
    twice stay shared; subclasses of nn.Conv2d and unsupported dtypes or devices are left as they are.
    """
    converted: dict[int, nn.Module] = {}
    reached = Counter(id(m) for m in model.modules(remove_duplicate=False))
    global_hooks = any(
        getattr(torch.nn.modules.module, name, None)
        for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks")
    )

    def fusable_pair(conv: nn.Module, act: nn.Module) -> tuple[str, float] | None:
        if not fuse_activations or global_hooks or _ineligibility(conv) is not None:
            return None
        if reached[id(conv)] != 1 or reached[id(act)] != 1 or _has_hooks(conv) or _has_hooks(act):
            return None
        return _fusable_activation(act)

    def visit(module: nn.Module) -> nn.Module:
        if id(module) in converted:
            return converted[id(module)]
        if _ineligibility(module) is None:
            result: nn.Module = ConvBias2d.from_conv(module)  # type: ignore[arg-type]
        else:
            children = list(module._modules.items())
            fused_slots: set[str] = set()
            if isinstance(module, nn.Sequential):
                for (name, child), (next_name, following) in zip(children, children[1:]):
                    pair = fusable_pair(child, following) if child is not None and following is not None else None
                    if pair is not None and name not in fused_slots:
                        converted[id(child)] = ConvBias2d.from_conv(child, *pair)  # type: ignore[arg-type]
                        setattr(module, next_name, nn.Identity())
                        fused_slots.add(next_name)
            # _modules, not named_children(): the latter skips a module's second name, which must be swapped too.
            for name, child in list(module._modules.items()):
                if child is not None and name not in fused_slots:
                    setattr(module, name, visit(child))
            result = module
        converted[id(module)] = result
        return result

    return visit(model)
