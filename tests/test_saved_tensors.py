"""What the forward keeps for backward: the input only when the weight needs a gradient (a frozen layer keeps no
activation alive), in the op's C++ autograd and in ConvBiasFunction alike; and ConvBiasFunction's input gradient
runs 16-bit CPU problems in float32 as the op does."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import torch_convbias
from torch_convbias import ConvBiasFunction

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
FORWARDS: dict[str, Forward] = {
    "op": lambda x, w, b: torch.ops.convbias.forward(x, w, b, [1, 1], [1, 1], [1, 1], 1),
    "autograd_function": lambda x, w, b: ConvBiasFunction.apply(x, w, b, 1, 1),
}


def saved_storages(forward: Forward, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The output and the data pointers of every tensor autograd saved for its backward."""
    pointers: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        pointers.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward(x, w, b)
    return y, pointers


@pytest.mark.parametrize("name", list(FORWARDS))
def test_input_is_saved_only_when_the_weight_needs_a_gradient(name: str) -> None:
    forward = FORWARDS[name]
    x = torch.randn(2, 3, 8, 8)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    _, trained = saved_storages(forward, x, w, b)
    assert x.untyped_storage().data_ptr() in trained

    frozen_w = w.detach()
    y, frozen = saved_storages(forward, x, frozen_w, b)
    assert x.untyped_storage().data_ptr() not in frozen, frozen
    # The bias gradient still comes out right without the input.
    (grad_b,) = torch.autograd.grad(y, [b], torch.ones_like(y))
    expected = torch.ones_like(y).sum((0, 2, 3))
    torch.testing.assert_close(grad_b, expected)


@pytest.mark.parametrize("name", list(FORWARDS))
def test_frozen_weight_input_gradient_and_bias_gradient_match_conv2d(name: str) -> None:
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    w = torch.randn(4, 3, 3, 3)
    b = torch.randn(4, requires_grad=True)
    y = FORWARDS[name](x, w, b)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, b], dy)
    x_ref, b_ref = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    expected = torch.autograd.grad(F.conv2d(x_ref, w.double(), b_ref, padding=1), [x_ref, b_ref], dy.double())
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_autograd_function_input_gradient_of_16_bit_cpu_problems() -> None:
    """A bfloat16 problem on which ATen's 16-bit CPU convolution crashed (csrc/reference.h): the input gradient is
    computed in float32 and rounded once, as the op's own autograd does."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 2, 7, generator=g).bfloat16().requires_grad_()
    w = torch.randn(3, 2, 4, 3, generator=g).bfloat16()
    y = ConvBiasFunction.apply(x, w, None, 1, (4, 3), 3)
    dy = torch.randn(y.shape, generator=g).bfloat16()
    (grad_x,) = torch.autograd.grad(y, [x], dy)
    x_ref = x.detach().double().requires_grad_()
    expected = torch.autograd.grad(F.conv2d(x_ref, w.double(), None, padding=(4, 3), dilation=3), [x_ref], dy.double())
    assert grad_x.dtype == torch.bfloat16
    torch.testing.assert_close(grad_x.double(), expected[0], rtol=3e-2, atol=3e-2 * expected[0].abs().max().item())
    # The op's own autograd agrees.
    x_op = x.detach().requires_grad_()
    (grad_op,) = torch.autograd.grad(torch_convbias.conv_bias2d(x_op, w, None, padding=(4, 3), dilation=3), [x_op], dy)
    torch.testing.assert_close(grad_x, grad_op)
