"""Outputs and gradients of the convbias ops against F.conv2d and its autograd, over the case grid."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cases import CASES, Case
from conftest import CUDA_MODES, DEVICES, MODES, assert_close, cuda, device_modes, math_mode
from torch.utils._python_dispatch import TorchDispatchMode

from torch_convbias import ConvBiasFunction, conv_bias2d

CASE_PARAMS = [pytest.param(c, id=c.id) for c in CASES]


@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.parametrize("device,mode_name", device_modes())
def test_forward_matches_conv2d(device: str, mode_name: str, case: Case) -> None:
    mode = MODES[mode_name]
    x, w, b = case.tensors(device, mode.dtype)
    stride, padding, dilation, groups = case.conv_args()
    with math_mode(mode):
        out = conv_bias2d(x, w, b, stride, padding, dilation, groups)
        expected = F.conv2d(x, w, b, stride, padding, dilation, groups)
    assert out.shape == expected.shape and out.dtype == expected.dtype and out.device == expected.device
    assert_close(out, expected, mode, "output")
    if case.channels_last and case.h * case.w > 1:
        assert out.is_contiguous(memory_format=torch.channels_last)
    if not case.channels_last:
        assert out.is_contiguous()


@pytest.mark.parametrize("case", CASE_PARAMS[::3])
@pytest.mark.parametrize("mode_name", CUDA_MODES)
@cuda
def test_benchmark_mode_matches_conv2d(mode_name: str, case: Case) -> None:
    """Under cudnn.benchmark every engine that builds is timed (including the engine sweep) and any may be
    chosen: outputs and parameter gradients must still match F.conv2d's."""
    mode = MODES[mode_name]
    stride, padding, dilation, groups = case.conv_args()
    x, w, b = case.tensors("cuda", mode.dtype)
    w.requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        with math_mode(mode):
            out = conv_bias2d(x, w, b, stride, padding, dilation, groups)
            expected = F.conv2d(x, w_ref, b, stride, padding, dilation, groups)
            grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2)).to("cuda", mode.dtype)
            out.backward(grad)
            expected.backward(grad)
    finally:
        torch.backends.cudnn.benchmark = saved
    assert_close(out, expected, mode, "output (cudnn.benchmark)")
    assert_close(w.grad, w_ref.grad, mode, "grad of weight (cudnn.benchmark)")


class OpRecorder(TorchDispatchMode):
    """Records the ops that run below autograd, to see what backward actually computes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("input_requires_grad", [False, True], ids=["params-only", "with-input"])
@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.parametrize("device,mode_name", device_modes())
def test_gradients_match_autograd(device: str, mode_name: str, case: Case, input_requires_grad: bool) -> None:
    mode = MODES[mode_name]
    stride, padding, dilation, groups = case.conv_args()
    ours = [t.requires_grad_() if t is not None else None for t in case.tensors(device, mode.dtype)]
    ref = [t.detach().clone().requires_grad_() if t is not None else None for t in ours]
    ours[0].requires_grad_(input_requires_grad)
    ref[0].requires_grad_(input_requires_grad)
    with math_mode(mode):
        out = conv_bias2d(ours[0], ours[1], ours[2], stride, padding, dilation, groups)
        expected = F.conv2d(ref[0], ref[1], ref[2], stride, padding, dilation, groups)
        grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        grad = grad.to(device=device, dtype=mode.dtype)
        with OpRecorder() as recorder:
            out.backward(grad)
        expected.backward(grad)
    for name, a, e in zip(("input", "weight", "bias"), ours, ref):
        if a is not None and e is not None:
            assert_close(a.grad, e.grad, mode, f"grad of {name}")
    assert ("convbias.param_grad" in recorder.ops) is True
    # The input gradient is computed only when the input needs one.
    assert ("convbias._input_grad" in recorder.ops) == input_requires_grad
    assert (ours[0].grad is None) == (not input_requires_grad)


@pytest.mark.parametrize("device,mode_name", device_modes())
def test_autograd_function_matches_op(device: str, mode_name: str) -> None:
    mode = MODES[mode_name]
    case = Case(2, 4, 10, 13, 6, (3, 2), (2, 1), (2, 0), (1, 2), 2, True, False)
    stride, padding, dilation, groups = case.conv_args()
    x, w, b = (t.requires_grad_() for t in case.tensors(device, mode.dtype))
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    with math_mode(mode):
        out = ConvBiasFunction.apply(x, w, b, tuple(stride), tuple(padding), tuple(dilation), groups)
        expected = F.conv2d(x2, w2, b2, stride, padding, dilation, groups)
        out.sum().backward()
        expected.sum().backward()
    assert_close(out, expected, mode, "output")
    for a, e in ((x, x2), (w, w2), (b, b2)):
        assert_close(a.grad, e.grad, mode, "grad")


def test_autograd_function_defaults() -> None:
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    out = ConvBiasFunction.apply(x, w, None)
    torch.testing.assert_close(out, F.conv2d(x, w))
    out.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_frozen_weight_trainable_bias() -> None:
    x = torch.randn(2, 3, 6, 6)
    w = torch.randn(4, 3, 3, 3)
    b = torch.randn(4, requires_grad=True)
    conv_bias2d(x, w, b, padding=1).sum().backward()
    torch.testing.assert_close(b.grad, torch.full((4,), 2.0 * 36))
    assert w.grad is None


def test_gradcheck_float64() -> None:
    case = Case(2, 4, 6, 5, 4, (3, 2), (2, 1), (1, 0), (1, 2), 2, True, False)
    stride, padding, dilation, groups = case.conv_args()
    x, w, b = (t.requires_grad_() for t in case.tensors("cpu", torch.float64))
    assert torch.autograd.gradcheck(lambda *t: conv_bias2d(*t, stride, padding, dilation, groups), (x, w, b))
    x.requires_grad_(False)
    assert torch.autograd.gradcheck(lambda w, b: conv_bias2d(x, w, b, stride, padding, dilation, groups), (w, b))


def test_double_backward_raises() -> None:
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    (grad_w,) = torch.autograd.grad(conv_bias2d(x, w).square().sum(), w, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        grad_w.sum().backward()


@pytest.mark.parametrize("mask", [[True, True], [True, False], [False, True]])
def test_param_grad_called_directly_is_not_differentiable(mask: list[bool]) -> None:
    dy = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64)
    grad_weight, grad_bias = torch.ops.convbias.param_grad(dy, x, w, [1, 1], [0, 0], [1, 1], 1, mask)
    expected = torch.ops.aten.convolution_backward(dy, x, w, [3], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                                   [False, *mask])
    for got, want, wanted in ((grad_weight, expected[1], mask[0]), (grad_bias, expected[2], mask[1])):
        assert (got is None) == (not wanted)
        if got is not None:
            torch.testing.assert_close(got, want)
            assert got.requires_grad
            with pytest.raises(NotImplementedError, match="double backward"):
                got.sum().backward()
    with torch.no_grad():
        grad_weight, _ = torch.ops.convbias.param_grad(dy, x, w, [1, 1], [0, 0], [1, 1], 1, mask)
    assert grad_weight is None or not grad_weight.requires_grad


@pytest.mark.parametrize("device,mode_name", device_modes())
def test_empty_batch(device: str, mode_name: str) -> None:
    mode = MODES[mode_name]
    x = torch.randn(0, 4, 8, 8, device=device, dtype=mode.dtype)
    w = torch.randn(6, 4, 3, 3, device=device, dtype=mode.dtype, requires_grad=True)
    b = torch.randn(6, device=device, dtype=mode.dtype, requires_grad=True)
    out = conv_bias2d(x, w, b, padding=1)
    assert out.shape == F.conv2d(x, w, b, padding=1).shape == (0, 6, 8, 8)
    out.sum().backward()
    assert torch.count_nonzero(w.grad) == 0 and torch.count_nonzero(b.grad) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kernel,dilation,padding",
    [((3, 3), 1, "same"), ((4, 2), 1, "same"), ((2, 3), (2, 1), "same"), ((3, 3), 1, "valid"), ((3, 3), 2, 1)],
)
def test_string_padding_and_unbatched(device: str, kernel: tuple[int, int], dilation, padding) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(2, 4, 9, 8, device=device, dtype=torch.float64)
    w = torch.randn(5, 4, *kernel, device=device, dtype=torch.float64)
    b = torch.randn(5, device=device, dtype=torch.float64)
    torch.testing.assert_close(
        conv_bias2d(x, w, b, padding=padding, dilation=dilation), F.conv2d(x, w, b, padding=padding, dilation=dilation)
    )
    torch.testing.assert_close(
        conv_bias2d(x[0], w, b, padding=padding, dilation=dilation),
        F.conv2d(x[0], w, b, padding=padding, dilation=dilation),
    )
