"""The activation argument of convbias::forward (conv + bias + activation in one call): forward and every gradient
against nn.Conv2d followed by the activation module (float64 on the CPU: an oracle independent of our kernels),
for every activation, dtype and layout; the errors, alike in eager and fake mode; what the backward keeps and what
it calls (one convbias._activation_backward, then the weight gradient; on CUDA the fused kernel, seen by explain
and the profiler); and convert() fusing a Sequential's conv + activation pairs, never one whose modules carry hooks
or are shared. The op _activation_backward itself: tests/test_activation_backward.py."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, MODES, assert_close, math_mode
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import torch_convbias
from torch_convbias import ConvBias2d, conv_bias2d, convert

# name -> (the module nn.Conv2d is followed by, the op's negative_slope)
ACTIVATIONS = {
    "identity": (nn.Identity(), 0.01),
    "relu": (nn.ReLU(), 0.01),
    "leaky_relu": (nn.LeakyReLU(0.2), 0.2),
    "leaky_relu_negative": (nn.LeakyReLU(-0.3), -0.3),  # the backward keeps the pre-activation then
    "gelu": (nn.GELU(), 0.01),
    "gelu_tanh": (nn.GELU(approximate="tanh"), 0.01),
    "silu": (nn.SiLU(), 0.01),
    "sigmoid": (nn.Sigmoid(), 0.01),
    "tanh": (nn.Tanh(), 0.01),
}


def op_name(name: str) -> str:
    return "leaky_relu" if name.startswith("leaky_relu") else name


def device_modes() -> list:
    pairs = [pytest.param("cpu", m, id=f"cpu-{m}") for m in ("float64", "float32", "bfloat16")]
    marks = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
    pairs += [pytest.param("cuda", m, id=f"cuda-{m}", marks=marks) for m in ("float32", "tf32", "float16", "bfloat16")]
    return pairs


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("device,mode_name", device_modes())
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_forward_and_gradients_match_conv2d_then_activation(
    name: str, device: str, mode_name: str, channels_last: bool
) -> None:
    mode = MODES[mode_name]
    module, slope = ACTIVATIONS[name]
    g = torch.Generator().manual_seed(7)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x64 = torch.randn(3, 16, 9, 10, generator=g, dtype=torch.float64)
    w64 = torch.randn(32, 16, 3, 3, generator=g, dtype=torch.float64) / 12
    b64 = torch.randn(32, generator=g, dtype=torch.float64)
    x, w, b = (t.to(device, mode.dtype) for t in (x64, w64, b64))
    x, w = x.contiguous(memory_format=fmt).requires_grad_(), w.contiguous(memory_format=fmt).requires_grad_()
    b.requires_grad_()
    with math_mode(mode):
        out = conv_bias2d(x, w, b, padding=1, activation=op_name(name), negative_slope=slope)
    # The oracle: float64 on the CPU, from the same rounded values.
    leaves = [t.detach().cpu().double().requires_grad_() for t in (x, w, b)]
    expected = module(F.conv2d(*leaves, padding=1))
    assert out.dtype == mode.dtype and out.shape == expected.shape
    assert out.is_contiguous(memory_format=fmt)
    assert_close(out.detach().cpu().double(), expected.detach(), mode, f"{name} output")
    seed = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    with math_mode(mode):
        grads = torch.autograd.grad(out, [x, w, b], torch.empty_like(out).copy_(seed))
    want = torch.autograd.grad(expected, leaves, seed.to(mode.dtype).double())
    for what, got, ref in zip(("input", "weight", "bias"), grads, want):
        assert_close(got.cpu().double(), ref, mode, f"{name} grad {what}")


def test_module_and_functional_forms_agree() -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.GELU(approximate="tanh"))
    module = ConvBias2d(4, 8, 3, padding=1, activation="gelu_tanh")
    module.load_state_dict(reference[0].state_dict())
    assert module.state_dict().keys() == reference[0].state_dict().keys()
    x = torch.randn(2, 4, 6, 6)
    torch.testing.assert_close(module(x), reference(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        conv_bias2d(x, module.weight, module.bias, padding=1, activation="gelu_tanh"), reference(x), rtol=1e-5, atol=1e-5
    )
    assert "activation='gelu_tanh'" in repr(module)
    # Other padding modes pad first, then the same fused call.
    circular = ConvBias2d(4, 8, 3, padding=1, padding_mode="circular", activation="relu")
    plain = nn.Conv2d(4, 8, 3, padding=1, padding_mode="circular")
    plain.load_state_dict(circular.state_dict())
    torch.testing.assert_close(circular(x), torch.relu(plain(x)), rtol=1e-5, atol=1e-5)


BAD = [
    ({"activation": "swish"}, "expected `activation` to be one of identity, relu, leaky_relu, gelu, gelu_tanh, silu, sigmoid, tanh, got 'swish'"),
    ({"activation": "leaky_relu", "negative_slope": float("nan")}, "expected `negative_slope` to be a finite number, got nan"),
    ({"activation": "relu", "negative_slope": float("inf")}, "expected `negative_slope` to be a finite number, got inf"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=["unknown", "nan-slope", "inf-slope"])
def test_bad_activation_is_a_value_error_in_eager_and_fake_mode(kwargs: dict, message: str) -> None:
    x, w, b = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3), torch.randn(3)
    args = (x, w, b, [1, 1], [1, 1], [1, 1], 1, kwargs["activation"], kwargs.get("negative_slope", 0.01))
    with pytest.raises(ValueError) as eager:
        torch.ops.convbias.forward(*args)
    assert str(eager.value).splitlines()[0] == f"convbias.forward: {message}"
    with FakeTensorMode() as fake_mode:
        fake = [fake_mode.from_tensor(t) for t in (x, w, b)]
        with pytest.raises(ValueError) as faked:
            torch.ops.convbias.forward(*fake, *args[3:])
    assert str(faked.value).splitlines()[0] == str(eager.value).splitlines()[0]
    with pytest.raises(ValueError, match="expected `activation` to be one of|finite number"):
        conv_bias2d(x, w, b, padding=1, **kwargs)
    with pytest.raises(ValueError, match="ConvBias2d: expected `activation` to be one of|finite number"):
        ConvBias2d(2, 3, 3, **kwargs)


def test_non_string_activation_is_refused() -> None:
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    with pytest.raises(ValueError, match="expected `activation` to be one of"):
        conv_bias2d(x, w, None, activation=None)  # type: ignore[arg-type]


def saved_pointers(fn) -> list[int]:  # type: ignore[no-untyped-def]
    pointers: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        pointers.append(t.untyped_storage().data_ptr() if t.numel() else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, pointers


@pytest.mark.parametrize("name,keeps_output", [("relu", True), ("sigmoid", True), ("tanh", True), ("gelu", False), ("silu", False)])
def test_backward_keeps_the_output_or_the_pre_activation(name: str, keeps_output: bool) -> None:
    """relu / sigmoid / tanh differentiate from their output (kept anyway by whoever uses it); gelu / silu need the
    pre-activation, the one extra tensor they keep."""
    x = torch.randn(2, 3, 6, 6)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    out, pointers = saved_pointers(lambda: torch.ops.convbias.forward(x, w, b, [1, 1], [1, 1], [1, 1], 1, name, 0.01))
    assert (out.untyped_storage().data_ptr() in pointers) == keeps_output, (name, pointers)
    # input, weight and one tensor for the derivative: nothing else.
    assert len(pointers) == 3, pointers


def test_double_backward_is_refused_with_an_activation() -> None:
    x = torch.randn(1, 2, 5, 5)
    w = torch.randn(3, 2, 3, 3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    out = conv_bias2d(x, w, b, padding=1, activation="silu")
    (grad_w,) = torch.autograd.grad(out.sum(), [w], create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        grad_w.sum().backward()


def test_opcheck_and_compile_with_an_activation() -> None:
    for requires_grad in (False, True):
        x = torch.randn(2, 4, 7, 7, requires_grad=requires_grad)
        w = torch.randn(6, 4, 3, 3, requires_grad=requires_grad)
        b = torch.randn(6, requires_grad=requires_grad)
        for name, slope in (("leaky_relu", 0.1), ("gelu", 0.01)):
            torch.library.opcheck(torch.ops.convbias.forward.default, (x, w, b, [1, 1], [1, 1], [1, 1], 1, name, slope))
    model = nn.Sequential(ConvBias2d(4, 6, 3, padding=1, activation="relu"), ConvBias2d(6, 2, 1, activation="tanh"))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 4, 7, 7)
    torch.testing.assert_close(compiled(x), model(x))


def test_convert_fuses_conv_activation_pairs_of_a_sequential() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1), nn.GELU(approximate="tanh"),
        nn.Conv2d(8, 8, 3, padding=1), nn.LeakyReLU(0.2),
        nn.Conv2d(8, 4, 1), nn.MaxPool2d(2), nn.Sigmoid(),
    )  # fmt: skip
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    x = torch.randn(2, 3, 8, 8)
    expected = reference(x)
    convert(model)
    kinds = [(type(m).__name__, getattr(m, "activation", None)) for m in model]
    assert kinds == [
        ("ConvBias2d", "relu"), ("Identity", None), ("ConvBias2d", "gelu_tanh"), ("Identity", None),
        ("ConvBias2d", "leaky_relu"), ("Identity", None), ("ConvBias2d", "identity"), ("MaxPool2d", None),
        ("Sigmoid", None),
    ]  # fmt: skip
    assert model[4].negative_slope == 0.2
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_convert_leaves_pairs_with_hooks_or_shared_modules_unfused() -> None:
    act = nn.ReLU()
    seen: list[torch.Size] = []
    hooked = nn.Sequential(nn.Conv2d(3, 4, 3), act)
    act.register_forward_hook(lambda module, inputs, output: seen.append(output.shape))
    shared_act = nn.SiLU()
    shared = nn.Sequential(nn.Conv2d(3, 4, 3), shared_act, nn.Conv2d(4, 4, 1), shared_act)
    conv_hooked = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh())
    conv_hooked[0].register_forward_hook(lambda module, inputs, output: None)
    x = torch.randn(1, 3, 6, 6)
    for model in (hooked, shared, conv_hooked):
        expected = copy.deepcopy(model)(x)
        convert(model)
        assert type(model[0]) is ConvBias2d and model[0].activation == "identity", model
        assert type(model[1]) is not nn.Identity, model
        torch.testing.assert_close(model(x), expected)
    assert len(seen) == 2  # the hook still runs, on the activation's own output
    # Opting out keeps every activation module.
    plain = convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), fuse_activations=False)
    assert type(plain[1]) is nn.ReLU and plain[0].activation == "identity"


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_explain_reports_the_activation_on_cuda() -> None:
    x = torch.randn(4, 32, 10, 10, device="cuda").contiguous(memory_format=torch.channels_last)
    w = torch.randn(32, 32, 3, 3, device="cuda").contiguous(memory_format=torch.channels_last)
    b = torch.randn(32, device="cuda")
    info = torch_convbias.explain(x, w, b, padding=1, activation="silu")
    assert info["path"] == "fused" and info["activation"]["name"] == "silu", info
    assert info["activation"]["fused"] is False and "ATen" in info["activation"]["how"], info
    cpu = json.loads(torch.ops.convbias._explain(x.cpu(), w.cpu(), b.cpu(), [1, 1], [1, 1], [1, 1], 1, "silu", 0.01))
    assert cpu["activation"]["name"] == "silu"


class OpRecorder(TorchDispatchMode):
    """Records the ops that run below autograd (name and arguments), to see what backward actually calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls.append((str(func.overloadpacket), args))
        return func(*args, **(kwargs or {}))

    def named(self, name: str) -> list[tuple]:
        return [args for op, args in self.calls if op == name]


@pytest.mark.parametrize("input_requires_grad", [False, True], ids=["params-only", "with-input"])
@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("name", ["identity", "relu", "gelu", "leaky_relu_negative"])
def test_backward_is_one_activation_backward_call_then_the_weight_gradient(
    name: str, device: str, input_requires_grad: bool
) -> None:
    """With an activation: one convbias._activation_backward call giving the gradient at the convolution's output and
    the bias gradient, then param_grad for the weight alone, and the input gradient of the same dz only when the input
    needs one. Identity keeps the path without it (param_grad computes both)."""
    module, slope = ACTIVATIONS[name]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 8, 6, 6, generator=g).to(device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 8, 3, 3, generator=g).div(8).to(device).contiguous(memory_format=torch.channels_last)
    b = torch.randn(8, generator=g).to(device)
    x.requires_grad_(input_requires_grad)
    w.requires_grad_()
    b.requires_grad_()
    out = conv_bias2d(x, w, b, padding=1, activation=op_name(name), negative_slope=slope)
    seed = torch.randn(out.shape, generator=g).to(device)
    with OpRecorder() as recorder:
        out.backward(seed)
    fused = recorder.named("convbias._activation_backward")
    param_grads = recorder.named("convbias.param_grad")
    assert len(param_grads) == 1, recorder.calls
    if name == "identity":
        assert fused == [] and list(param_grads[0][-1]) == [True, True], recorder.calls
    else:
        assert len(fused) == 1 and fused[0][2:] == (op_name(name), slope, True), recorder.calls
        assert list(param_grads[0][-1]) == [True, False], recorder.calls
    assert ("aten.convolution_backward" in [op for op, _ in recorder.calls]) == input_requires_grad
    # And the gradients are nn.Conv2d + the activation module's (float64 on the CPU).
    leaves = [t.detach().cpu().double().requires_grad_() for t in (x, w, b)]
    expected = module(F.conv2d(*leaves, padding=1))
    want = torch.autograd.grad(expected, leaves, seed.cpu().double())
    for what, got, ref in zip(("input", "weight", "bias"), (x.grad, w.grad, b.grad), want):
        if what == "input" and not input_requires_grad:
            assert got is None
            continue
        assert_close(got.cpu().double(), ref, MODES["float32"] if device == "cpu" else MODES["tf32"], f"{name} {what}")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode_name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", ["relu", "leaky_relu", "leaky_relu_negative", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"])
def test_backward_runs_the_fused_kernel_on_cuda(name: str, mode_name: str) -> None:
    """On channels_last CUDA tensors the layer's backward runs the fused derivative + bias-gradient kernel: explain
    says so for the tensors the backward sees, the profiler sees the kernel, and the gradients match nn.Conv2d +
    the activation module."""
    from torch.profiler import ProfilerActivity, profile

    mode = MODES[mode_name]
    module, slope = ACTIVATIONS[name]
    g = torch.Generator().manual_seed(9)
    x64 = torch.randn(4, 16, 12, 12, generator=g, dtype=torch.float64)
    w64 = torch.randn(32, 16, 3, 3, generator=g, dtype=torch.float64) / 12
    b64 = torch.randn(32, generator=g, dtype=torch.float64)
    x, w, b = (t.to("cuda", mode.dtype) for t in (x64, w64, b64))
    x, w = (t.contiguous(memory_format=torch.channels_last) for t in (x, w))
    w.requires_grad_()
    b.requires_grad_()
    with math_mode(mode):
        out = conv_bias2d(x, w, b, padding=1, activation=op_name(name), negative_slope=slope)
        seed = torch.randn(out.shape, generator=g, dtype=torch.float64).to("cuda", mode.dtype)
        seed = seed.contiguous(memory_format=torch.channels_last)
        # What the backward keeps is the output or the pre-activation: the same layout and alignment as `out`.
        info = torch_convbias.explain_param_grad(
            seed, x, w, padding=1, activation=op_name(name), negative_slope=slope, saved=out.detach()
        )
        assert info["activation_backward"]["way"] == "fused kernel", info
        assert info["bias_grad"]["way"] == "fused", info
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out.backward(seed)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("ActivationGradOf" in k for k in kernels), kernels
    leaves = [t.detach().cpu().double().requires_grad_() for t in (x, w, b)]
    expected = module(F.conv2d(*leaves, padding=1))
    want = torch.autograd.grad(expected, leaves[1:], seed.cpu().double())
    for what, got, ref in zip(("weight", "bias"), (w.grad, b.grad), want):
        assert_close(got.cpu().double(), ref, mode, f"{name} grad {what}")


def test_explain_param_grad_with_an_activation_on_cpu() -> None:
    x, w = torch.randn(2, 4, 6, 6), torch.randn(8, 4, 3, 3)
    grad = torch.randn(2, 8, 6, 6)
    plain = torch_convbias.explain_param_grad(grad, x, w, padding=1)
    assert "activation_backward" not in plain
    info = torch_convbias.explain_param_grad(grad, x, w, padding=1, activation="gelu", saved=torch.randn(2, 8, 6, 6))
    assert info["activation_backward"]["way"] == "aten" and info["activation_backward"]["derivative_from"] == "pre-activation"
    assert info["bias_grad"]["way"] == "aten" and info["weight_grad"]["path"] == "aten", info
