"""Bad input raises a clear exception naming the argument: the same type and message from the C++ kernels
(eager, CPU) and from the fake kernels (meta tensors, as torch.compile traces them)."""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch
from conftest import cuda

import torch_convbias
from torch_convbias import conv_bias2d

Args = dict[str, Any]


def forward_args(device: str) -> Args:
    return dict(
        input=torch.randn(2, 4, 8, 8, device=device),
        weight=torch.randn(6, 2, 3, 3, device=device),
        bias=torch.randn(6, device=device),
        stride=[1, 1],
        padding=[1, 1],
        dilation=[1, 1],
        groups=2,
    )


def with_(**changes: Callable[[Args], Any]) -> Callable[[Args], Args]:
    return lambda a: {**a, **{k: f(a) for k, f in changes.items()}}


# (id, change to valid arguments, exception type, message pattern)
FORWARD_ERRORS = [
    ("input-rank", with_(input=lambda a: a["input"][0]), ValueError, r"`input` to be a 4-D tensor .* got a 3-D tensor of shape \[4, 8, 8\]"),
    ("weight-rank", with_(weight=lambda a: a["weight"][0]), ValueError, r"`weight` to be a 4-D tensor \(out_channels"),
    ("input-int", with_(input=lambda a: a["input"].long()), TypeError, r"`input` to have a floating-point dtype .* got torch\.int64"),
    ("weight-dtype", with_(weight=lambda a: a["weight"].double()), TypeError, r"`weight` to have the dtype of `input` \(torch\.float32\), got torch\.float64"),
    ("bias-dtype", with_(bias=lambda a: a["bias"].half()), TypeError, r"`bias` to have the dtype of `input` \(torch\.float32\), got torch\.float16"),
    ("bias-shape", with_(bias=lambda a: a["bias"][:5]), ValueError, r"`bias` of shape \[6\] \(out_channels = weight.size\(0\)\), got shape \[5\]"),
    ("bias-rank", with_(bias=lambda a: a["bias"].view(1, 6)), ValueError, r"`bias` of shape \[6\] .* got shape \[1, 6\]"),
    ("groups-input", with_(groups=lambda a: 3, weight=lambda a: a["weight"]), ValueError, r"`groups` \(3\) to divide the input channels \(4\)"),
    ("groups-output", with_(weight=lambda a: a["weight"][:5], bias=lambda a: None), ValueError, r"`groups` \(2\) to divide the output channels weight.size\(0\) \(5\)"),
    ("weight-channels", with_(weight=lambda a: torch.randn(6, 3, 3, 3, device=a["input"].device)), ValueError, r"`weight`.size\(1\) to be input channels / groups = 4 / 2 = 2, got 3"),
    ("groups-zero", with_(groups=lambda a: 0), ValueError, r"`groups` to be positive, got 0"),
    ("stride-zero", with_(stride=lambda a: [1, 0]), ValueError, r"every `stride` element to be positive, got \[1, 0\]"),
    ("stride-length", with_(stride=lambda a: [1, 1, 1]), ValueError, r"`stride` to have 2 elements \(height, width\), got 3"),
    ("dilation-negative", with_(dilation=lambda a: [-1, 1]), ValueError, r"every `dilation` element to be positive, got \[-1, 1\]"),
    ("padding-negative", with_(padding=lambda a: [0, -2]), ValueError, r"every `padding` element to be non-negative, got \[0, -2\]"),
    ("kernel-too-large", with_(weight=lambda a: torch.randn(6, 2, 3, 11, device=a["input"].device)), ValueError, r"spans 11 along W, more than the padded input \(8 \+ 2 \* 1 = 10\)"),
    ("dilated-kernel-too-large", with_(dilation=lambda a: [5, 1]), ValueError, r"dilation \[5, 1\]\) spans 11 along H"),
    ("empty-kernel", with_(weight=lambda a: torch.randn(6, 2, 0, 3, device=a["input"].device)), ValueError, r"non-empty kernel"),
]


def call_forward(a: Args) -> torch.Tensor:
    return torch.ops.convbias.forward(
        a["input"], a["weight"], a["bias"], a["stride"], a["padding"], a["dilation"], a["groups"]
    )


@pytest.mark.parametrize("change,error,pattern", [pytest.param(*e[1:], id=e[0]) for e in FORWARD_ERRORS])
def test_forward_errors_eager_and_fake_agree(change, error, pattern) -> None:  # type: ignore[no-untyped-def]
    messages = []
    for device in ("cpu", "meta"):
        with pytest.raises(error, match=pattern) as info:
            call_forward(change(forward_args(device)))
        messages.append(str(info.value).splitlines()[0])
    assert messages[0] == messages[1]


def test_valid_arguments_pass() -> None:
    for device in ("cpu", "meta"):
        assert call_forward(forward_args(device)).shape == (2, 6, 8, 8)


def param_grad_args(device: str) -> Args:
    a = forward_args(device)
    del a["bias"]
    return dict(grad_output=torch.randn(2, 6, 8, 8, device=device), **a, output_mask=[True, True])


PARAM_GRAD_ERRORS = [
    ("grad-shape", with_(grad_output=lambda a: a["grad_output"][:, :, :7]), ValueError, r"convbias.param_grad: expected `grad_output` of shape \[2, 6, 8, 8\] \(the forward's output shape\), got \[2, 6, 7, 8\]"),
    ("grad-dtype", with_(grad_output=lambda a: a["grad_output"].double()), TypeError, r"`grad_output` to have the dtype of `input`"),
    ("input-rank", with_(input=lambda a: a["input"][0]), ValueError, r"convbias.param_grad: expected `input` to be a 4-D tensor"),
    ("groups", with_(groups=lambda a: 3), ValueError, r"`groups` \(3\) to divide the input channels"),
]


@pytest.mark.parametrize("change,error,pattern", [pytest.param(*e[1:], id=e[0]) for e in PARAM_GRAD_ERRORS])
def test_param_grad_errors_eager_and_fake_agree(change, error, pattern) -> None:  # type: ignore[no-untyped-def]
    messages = []
    for device in ("cpu", "meta"):
        a = change(param_grad_args(device))
        with pytest.raises(error, match=pattern) as info:
            torch.ops.convbias.param_grad(*a.values())
        messages.append(str(info.value).splitlines()[0])
    assert messages[0] == messages[1]


@pytest.mark.parametrize("change,error,pattern", [pytest.param(*e[1:], id=e[0]) for e in PARAM_GRAD_ERRORS])
def test_explain_param_grad_checks_like_param_grad(change, error, pattern) -> None:  # type: ignore[no-untyped-def]
    a = change(param_grad_args("cpu"))
    del a["output_mask"]
    with pytest.raises(error, match=pattern):
        torch_convbias.explain_param_grad(*a.values())


def test_explain_param_grad_on_cpu_says_aten() -> None:
    a = param_grad_args("cpu")
    del a["output_mask"]
    info = torch_convbias.explain_param_grad(*a.values())
    assert info["weight_grad"]["path"] == "aten" and info["bias_grad"]["way"] == "aten", info
    assert "CPU tensors run ATen" in info["weight_grad"]["notes"][0]


@cuda
def test_device_mismatch() -> None:
    a = forward_args("cuda")
    with pytest.raises(ValueError, match=re.escape("expected `weight` on the device of `input` (cuda:0), got cpu")):
        call_forward({**a, "weight": a["weight"].cpu()})
    with pytest.raises(ValueError, match=re.escape("expected `bias` on the device of `input` (cuda:0), got cpu")):
        call_forward({**a, "bias": a["bias"].cpu()})


def test_device_mismatch_fake() -> None:
    a = forward_args("meta")
    with pytest.raises(ValueError, match=re.escape("expected `bias` on the device of `input` (meta), got cpu")):
        call_forward({**a, "bias": torch.randn(6)})


@pytest.mark.parametrize(
    "kwargs,error,pattern",
    [
        (dict(stride="2"), ValueError, r"`stride` to be an int or a pair of ints, got '2'"),
        (dict(dilation=(1, 2, 3)), ValueError, r"`dilation` to be an int or a pair of ints"),
        (dict(padding="full"), ValueError, r"`padding` to be 'valid', 'same', an int or a pair of ints, got 'full'"),
        (dict(padding="same", stride=2), ValueError, r"padding='same' is not supported for strided convolutions"),
        (dict(padding=1.5), ValueError, r"`padding` to be an int or a pair of ints, got 1.5"),
    ],
)
def test_functional_argument_errors(kwargs: Args, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        conv_bias2d(torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3), **kwargs)
