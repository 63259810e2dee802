"""The eager entry of ConvBias2d / conv_bias2d (``torch_convbias._C._forward_eager``): same results and errors as
``torch.ops.convbias.forward``, and the op stays visible to whatever must see it (tensor subclasses and
__torch_function__ modes here; torch.compile in test_opcheck.py)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import DEVICES
from torch.overrides import TorchFunctionMode

from torch_convbias import ConvBias2d, _C, conv_bias2d


def args(device: str = "cpu") -> tuple:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 6, 6, generator=g).to(device)
    w = torch.randn(6, 2, 3, 3, generator=g).to(device)
    b = torch.randn(6, generator=g).to(device)
    return x, w, b, (2, 1), [1, 0], (1, 2), 2


@pytest.mark.parametrize("device", DEVICES)
def test_same_result_as_torch_ops(device: str) -> None:
    a = args(device)
    expected = torch.ops.convbias.forward(*a)
    # The same kernel on the same plan: exact on the CPU; on CUDA an engine may split its reduction differently.
    exact = {"rtol": 0, "atol": 0} if device == "cpu" else {}
    torch.testing.assert_close(_C._forward_eager(*a), expected, **exact)
    torch.testing.assert_close(_C._forward_eager(*a[:2], None, *a[3:]), torch.ops.convbias.forward(*a[:2], None, *a[3:]))


def test_anything_but_plain_tensors_and_ints_is_not_taken() -> None:
    x, w, b, stride, padding, dilation, groups = args()

    class Sub(torch.Tensor):
        pass

    declined = [
        (x.as_subclass(Sub), w, b, stride, padding, dilation, groups),
        (x, w, b.as_subclass(Sub), stride, padding, dilation, groups),
        (x, w, b, (2.0, 1), padding, dilation, groups),
        (x, w, b, (2, 1, 1), padding, dilation, groups),
        (x, w, b, stride, padding, dilation, True),
        (x, w, b, stride, padding, dilation, 2**70),
        (x, w, b, stride, padding, dilation),
        (x.tolist(), w, b, stride, padding, dilation, groups),
    ]
    for call in declined:
        assert _C._forward_eager(*call) is NotImplemented
    # Parameters are plain tensors here, as for nn.Conv2d.
    assert isinstance(_C._forward_eager(x, torch.nn.Parameter(w), b, stride, padding, dilation, groups), torch.Tensor)


def test_errors_are_the_ops_errors() -> None:
    x, w, b, stride, padding, dilation, _ = args()
    for groups in (3, 0):
        with pytest.raises(ValueError) as via_ops:
            torch.ops.convbias.forward(x, w, b, stride, padding, dilation, groups)
        with pytest.raises(ValueError, match=re.escape(str(via_ops.value).splitlines()[0])):
            _C._forward_eager(x, w, b, stride, padding, dilation, groups)
    with pytest.raises(TypeError, match="to have the dtype of `input`"):
        _C._forward_eager(x, w.double(), b, stride, padding, dilation, 2)


def test_module_and_functional_gradients_flow_through_it() -> None:
    torch.manual_seed(0)
    ours = ConvBias2d(4, 6, 3, padding=1, groups=2)
    theirs = torch.nn.Conv2d(4, 6, 3, padding=1, groups=2)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ours(x).square().sum().backward()
    theirs(x2).square().sum().backward()
    for got, expected in ((x.grad, x2.grad), (ours.weight.grad, theirs.weight.grad), (ours.bias.grad, theirs.bias.grad)):
        torch.testing.assert_close(got, expected)
    w = ours.weight.detach().requires_grad_()
    conv_bias2d(x.detach(), w, None, padding=1, groups=2).sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape


class Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_torch_function_modes_and_subclasses_still_see_the_op() -> None:
    layer = ConvBias2d(4, 6, 3, padding=1)
    x = torch.randn(1, 4, 5, 5)
    with Recorder() as mode:
        layer(x)
        conv_bias2d(x, layer.weight, layer.bias, padding=1)
    assert sum("convbias.forward" in name for name in mode.seen) == 2, mode.seen

    seen: list[str] = []

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(str(func))
            return super().__torch_function__(func, types, args, kwargs or {})

    out = layer(x.as_subclass(Logged))
    assert any("convbias.forward" in name for name in seen), seen
    assert isinstance(out, Logged)
