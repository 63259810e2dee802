"""convbias::_activation_backward: the activation's derivative and the bias gradient in one call (one CUDA kernel for
channels_last tensors). Against an independent oracle - autograd of torch.nn.functional's activations in float64 on
the CPU, then .sum((0, 2, 3)) - for every activation x dtype x layout on the CPU and on CUDA, where the tests also
check from explain which way ran (the fused kernel for channels_last, ATen elsewhere); determinism; the argument
errors alike in eager and fake mode; opcheck; and the double-backward refusal."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, MODES, assert_within_one_ulp, every_value, tail_accurate
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_convbias

# name -> (the op's activation, negative_slope, F's function of z, whether the derivative is taken from the output)
ACTIVATIONS = {
    "identity": ("identity", 0.01, lambda z: z, False),
    "relu": ("relu", 0.01, F.relu, True),
    "leaky_relu": ("leaky_relu", 0.2, lambda z: F.leaky_relu(z, 0.2), True),
    "leaky_relu_negative": ("leaky_relu", -0.3, lambda z: F.leaky_relu(z, -0.3), False),
    "gelu": ("gelu", 0.01, F.gelu, False),
    "gelu_tanh": ("gelu_tanh", 0.01, lambda z: F.gelu(z, approximate="tanh"), False),
    "silu": ("silu", 0.01, F.silu, False),
    "sigmoid": ("sigmoid", 0.01, torch.sigmoid, True),
    "tanh": ("tanh", 0.01, torch.tanh, True),
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
# The dtype's tolerances, written down once in conftest (float16 has no CPU mode there: its tolerances are the same).
TOLERANCES = {name: MODES[name] for name in ("float32", "float16", "bfloat16", "float64")}
LAYOUTS = ["channels_last", "nchw", "misaligned"]
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")),
]


def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` channels_last, NCHW, or channels_last one element past a 16-byte boundary (a storage offset)."""
    if layout == "nchw":
        return t.contiguous()
    packed = t.contiguous(memory_format=torch.channels_last)
    if layout == "channels_last":
        return packed
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    shifted = buffer[1:].as_strided(t.shape, packed.stride())
    shifted.copy_(t)
    assert shifted.data_ptr() % 16 != 0
    return shifted


def make(name: str, dtype: torch.dtype, device: str, layout: str, shape=(2, 16, 5, 6), seed: int = 0):  # type: ignore[no-untyped-def]
    """(grad_output, saved, z) in `dtype` on `device`: z the pre-activation, saved what the derivative needs."""
    _, _, fn, from_output = ACTIVATIONS[name]
    g = torch.Generator().manual_seed(seed)
    z = (2 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    grad = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    saved = fn(z.double()).to(dtype) if from_output else z
    return laid_out(grad.to(device), layout), laid_out(saved.to(device), layout), z


def oracle(name: str, grad: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dz, grad_bias) in float64 on the CPU by autograd of F's activation, from the same rounded values."""
    fn = ACTIVATIONS[name][2]
    leaf = z.detach().cpu().double().requires_grad_()
    (dz,) = torch.autograd.grad(fn(leaf), [leaf], grad.detach().cpu().double())
    return dz, dz.sum((0, 2, 3))


def call(name: str, grad: torch.Tensor, saved: torch.Tensor, bias_grad: bool = True):  # type: ignore[no-untyped-def]
    activation, slope, _, _ = ACTIVATIONS[name]
    return torch.ops.convbias._activation_backward(grad, saved, activation, slope, bias_grad)


def assert_matches(name: str, dtype_name: str, grad_z: torch.Tensor, grad_bias: torch.Tensor, want_dz, want_db) -> None:  # type: ignore[no-untyped-def]
    mode = TOLERANCES[dtype_name]
    dtype = DTYPES[dtype_name]
    assert grad_z.dtype == dtype and grad_bias.dtype == dtype and grad_bias.shape == want_db.shape
    for what, got, want in (("grad_z", grad_z, want_dz), ("grad_bias", grad_bias, want_db)):
        scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
        torch.testing.assert_close(
            got.cpu().double(), want, rtol=mode.rtol, atol=mode.atol * scale, msg=lambda m: f"{name} {what}: {m}"
        )
    # grad_bias is the sum of grad_z as written, accumulated wide and rounded once: within the accumulation's error
    # bound (terms x the accumulator's epsilon x the largest term) and one rounding to the dtype.
    written = grad_z.cpu().double().sum((0, 2, 3))
    terms = grad_z.numel() // max(1, grad_z.shape[1])
    accumulator = torch.float64 if dtype == torch.float64 else torch.float32
    largest = grad_z.abs().max().item() if grad_z.numel() else 0.0
    torch.testing.assert_close(
        grad_bias.cpu().double(), written, rtol=torch.finfo(dtype).eps,
        atol=terms * torch.finfo(accumulator).eps * largest + 1e-300,
        msg=lambda m: f"{name}: grad_bias is not the sum of grad_z: {m}",
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("device", DEVICES)
def test_matches_float64_autograd_of_the_activation(device: str, name: str, dtype_name: str, layout: str) -> None:
    dtype = DTYPES[dtype_name]
    grad, saved, z = make(name, dtype, device, layout)
    want_dz, want_db = oracle(name, grad, z)
    grad_z, grad_bias = call(name, grad, saved)
    assert_matches(name, dtype_name, grad_z, grad_bias, want_dz, want_db)
    # grad_z in grad_output's layout (channels_last for the misaligned channels_last tensors too).
    expected_format = torch.contiguous_format if layout == "nchw" else torch.channels_last
    assert grad_z.is_contiguous(memory_format=expected_format), grad_z.stride()
    # Without the bias gradient (ATen's pointwise backward on CUDA too): the same grad_z, up to contraction into FMAs.
    grad_z_only, none = call(name, grad, saved, bias_grad=False)
    assert none is None
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(grad_z_only, grad_z, rtol=eps, atol=eps)
    info = torch_convbias.explain_activation_backward(grad, saved, *ACTIVATIONS[name][:2])
    assert info["activation"] == ACTIVATIONS[name][0]
    assert info["derivative_from"] == (
        "nothing" if name == "identity" else "output" if ACTIVATIONS[name][3] else "pre-activation"
    ), info
    if device == "cpu":
        assert info["way"] == "aten" and info["bias_grad"]["way"] == "aten", info
    elif name == "identity":
        assert info["way"] == "aten" and "identity" in info["notes"][0], info
    elif layout == "channels_last":
        # Proof that the kernel ran: the way the call takes is the fused kernel, and the results above are its.
        assert info["way"] == "fused kernel" and info["notes"] == [], info
        assert info["bias_grad"]["way"] == "fused" and info["launch"]["loads_in_flight"] in (4, 16), info
    else:
        assert info["way"] == "aten", info
        assert ("channels_last" if layout == "nchw" else "aligned") in info["notes"][0], info


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_layouts_and_expanded_grads(device: str) -> None:
    """An expanded grad_output (from out.sum()) or one in another layout than saved: ATen, grad_z channels_last when
    either tensor is, results as the oracle's."""
    grad, saved, z = make("silu", torch.float32, device, "channels_last")
    for g in (grad.contiguous(), torch.ones(1, 1, 1, 1, device=device).expand(grad.shape)):
        grad_z, grad_bias = call("silu", g, saved)
        want_dz, want_db = oracle("silu", g, z)
        assert_matches("silu", "float32", grad_z, grad_bias, want_dz, want_db)
        assert grad_z.is_contiguous(memory_format=torch.channels_last)
        assert torch_convbias.explain_activation_backward(g, saved, "silu")["way"] == "aten"


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_odd_channel_counts(device: str) -> None:
    for shape in ((0, 16, 3, 3), (2, 5, 3, 3), (3, 8, 1, 1)):
        grad, saved, z = make("gelu", torch.float32, device, "channels_last", shape=shape)
        grad_z, grad_bias = call("gelu", grad, saved)
        want_dz, want_db = oracle("gelu", grad, z)
        assert_matches("gelu", "float32", grad_z, grad_bias, want_dz, want_db)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("timed", [False, True], ids=["untimed", "timed"])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", ["relu", "gelu", "silu"])
def test_fused_kernel_is_deterministic_on_cuda(name: str, dtype_name: str, timed: bool) -> None:
    """Two runs of the fused kernel give bitwise equal grad_z and grad_bias (fixed order, no atomics), on a tensor
    large enough for many bands, with the launch configuration untimed and timed."""
    saved_flag = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = timed
    try:
        grad, saved, z = make(name, DTYPES[dtype_name], "cuda", "channels_last", shape=(64, 64, 32, 32), seed=3)
        info = torch_convbias.explain_activation_backward(grad, saved, *ACTIVATIONS[name][:2])
        assert info["way"] == "fused kernel", info
        first = call(name, grad, saved)
        second = call(name, grad, saved)
    finally:
        torch.backends.cudnn.benchmark = saved_flag
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    want_dz, want_db = oracle(name, grad, z)
    assert_matches(name, dtype_name, first[0], first[1], want_dz, want_db)


def channels_last_grid(values: torch.Tensor, channels: int = 64) -> torch.Tensor:
    """``values`` (1-D) zero-padded and laid out as a channels_last (n, channels, 2, 2) tensor, in order."""
    per_row = 4 * channels
    padded = torch.cat([values, values.new_zeros(-values.numel() % per_row)])
    return padded.view(-1, 2, 2, channels).permute(0, 3, 1, 2)


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh"])
def test_tail_accurate_oracles_hold_where_F_cancels(name: str) -> None:
    """The oracle the 16-bit tests use down to the far negative tail: value and derivative within 1e-12 relative of
    1000-digit mpmath over [-30, 8], where F's own float64 formula is off by more than 0.1% (1 + erf(x), 1 + tanh(u))."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(1000):  # 1 + tanh(u) at x = -30 is ~1e-857: enough digits to hold it
        beta = mpmath.sqrt(2 / mpmath.pi)
        exact = {
            "gelu": lambda v: v * mpmath.ncdf(v),
            "gelu_tanh": lambda v: v / 2 * (1 + mpmath.tanh(beta * (v + mpmath.mpf("0.044715") * v**3))),
        }[name]
        x = torch.linspace(-30, 8, 77, dtype=torch.float64)
        want = torch.tensor([float(exact(mpmath.mpf(v))) for v in x.tolist()], dtype=torch.float64)
        want_grad = torch.tensor([float(mpmath.diff(exact, mpmath.mpf(v))) for v in x.tolist()], dtype=torch.float64)
    # Relative error where float64 holds the value (not at 0, nor where gelu_tanh's tail is below 1e-300).
    keep = (want.abs() > 1e-300) & (want_grad.abs() > 1e-300)
    x, want, want_grad = x[keep], want[keep], want_grad[keep]
    assert x.min() < -8  # the far tail is in

    def worst_relative_error(formula: Callable[[torch.Tensor], torch.Tensor]) -> float:
        leaf = x.clone().requires_grad_()
        value = formula(leaf)
        (grad,) = torch.autograd.grad(value, [leaf], torch.ones_like(leaf))
        return max(((got - ref).abs() / ref.abs()).max().item() for got, ref in ((value, want), (grad, want_grad)))

    assert worst_relative_error(tail_accurate(name)) < 1e-12
    assert worst_relative_error(ACTIVATIONS[name][2]) > 1e-3  # why the oracle is not F's formula


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu"])
def test_fused_16bit_derivative_within_one_ulp_of_every_value_on_cuda(name: str, dtype_name: str) -> None:
    """float16 / bfloat16 derivatives take cheaper float math in the fused kernel (__expf, a fitted normal tail;
    csrc/cuda/activation_math.cuh): over every value of the dtype in [-16, 16] as z, with grad_output 1, dz is within
    one ulp of float64 autograd's and is its correct rounding in all but a few per thousand values."""
    dtype = DTYPES[dtype_name]
    z = channels_last_grid(every_value(dtype, 16.0)).cuda()
    grad = torch.ones_like(z)
    assert torch_convbias.explain_activation_backward(grad, z, name)["way"] == "fused kernel"
    grad_z, grad_bias = call(name, grad, z)
    want_dz, want_db = oracle(name, grad, z)
    assert_matches(name, dtype_name, grad_z, grad_bias, want_dz, want_db)
    # Down to the tails (bfloat16 reaches 1e-38): an oracle whose float64 formula does not cancel there.
    formula = tail_accurate(name) or ACTIVATIONS[name][2]
    leaf = z.detach().cpu().double().requires_grad_()
    (accurate,) = torch.autograd.grad(formula(leaf), [leaf], torch.ones_like(leaf))
    assert_within_one_ulp(grad_z, accurate, f"{name} {dtype_name} dz", max_mismatch=5e-3)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_fused_kernel_agrees_with_the_aten_way_on_cuda() -> None:
    """The fused pass against ATen's pointwise backward then the bias kernel (the way before it), on the same tensors:
    grad_z within the derivative's rounding (formulas as ATen's), grad_bias close."""
    for name in ("relu", "leaky_relu", "leaky_relu_negative", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"):
        grad, saved, _ = make(name, torch.float32, "cuda", "channels_last", shape=(8, 32, 16, 16))
        fused_z, fused_b = call(name, grad, saved)
        aten_z, aten_b = call(name, grad.contiguous(), saved.contiguous())  # NCHW: the ATen way
        torch.testing.assert_close(fused_z, aten_z, rtol=2e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(fused_b, aten_b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_bias_grad_knob_turns_the_fused_kernel_off() -> None:
    """TORCH_CONVBIAS_BIAS_GRAD names the bias gradient's way; anything but the kernel runs ATen (in a subprocess:
    the knobs are read once)."""
    code = (
        "import torch, torch_convbias\n"
        "g = torch.randn(2, 16, 4, 4, device='cuda').contiguous(memory_format=torch.channels_last)\n"
        "info = torch_convbias.explain_activation_backward(g, g.clone(), 'relu')\n"
        "assert info['way'] == 'aten' and info['notes'] == ['TORCH_CONVBIAS_BIAS_GRAD=aten'], info\n"
        "assert info['bias_grad']['way'] == 'aten', info\n"
    )
    env = {**os.environ, "TORCH_CONVBIAS_BIAS_GRAD": "aten"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


BAD = [
    (lambda g: (g[0], g), ValueError, "expected `grad_output` to be a 4-D tensor (N, K, H, W), got a 3-D tensor"),
    (lambda g: (g.long(), g.long()), TypeError, "expected `grad_output` to have a floating-point dtype"),
    (lambda g: (g, g.double()), TypeError, "expected `saved` to have the dtype of `grad_output` (torch.float32), got torch.float64"),
    (lambda g: (g, g[:, :3]), ValueError, "expected `saved` of the shape of `grad_output` ([2, 4, 3, 3]), got [2, 3, 3, 3]"),
]


@pytest.mark.parametrize("make_args,error,message", BAD, ids=["rank", "dtype", "saved-dtype", "saved-shape"])
def test_bad_arguments_fail_alike_in_eager_and_fake_mode(make_args, error, message) -> None:  # type: ignore[no-untyped-def]
    g = torch.randn(2, 4, 3, 3)
    grad, saved = make_args(g)
    with pytest.raises(error) as eager:
        torch.ops.convbias._activation_backward(grad, saved, "relu", 0.01, True)
    assert str(eager.value).startswith(f"convbias._activation_backward: {message}"), str(eager.value)
    with FakeTensorMode() as fake_mode:
        fakes = [fake_mode.from_tensor(t) for t in (grad, saved)]
        with pytest.raises(error) as faked:
            torch.ops.convbias._activation_backward(*fakes, "relu", 0.01, True)
    assert str(faked.value).splitlines()[0] == str(eager.value).splitlines()[0]


@pytest.mark.parametrize("activation,slope,message", [("swish", 0.01, "to be one of"), ("leaky_relu", float("inf"), "finite")])
def test_bad_activation_fails_alike_in_eager_and_fake_mode(activation: str, slope: float, message: str) -> None:
    g = torch.randn(2, 4, 3, 3)
    with pytest.raises(ValueError, match=message) as eager:
        torch.ops.convbias._activation_backward(g, g, activation, slope, True)
    assert str(eager.value).startswith("convbias._activation_backward: ")
    with FakeTensorMode() as fake_mode:
        fake = fake_mode.from_tensor(g)
        with pytest.raises(ValueError) as faked:
            torch.ops.convbias._activation_backward(fake, fake, activation, slope, True)
    assert str(faked.value).splitlines()[0] == str(eager.value).splitlines()[0]


def opcheck_samples(device: str) -> list[tuple]:
    samples = []
    for name, layout, bias_grad in (
        ("relu", "channels_last", True),
        ("leaky_relu_negative", "channels_last", True),
        ("gelu", "nchw", True),
        ("silu", "channels_last", False),
        ("tanh", "misaligned", True),
        ("identity", "channels_last", True),
    ):
        grad, saved, _ = make(name, torch.float32, device, layout)
        activation, slope, _, _ = ACTIVATIONS[name]
        samples.append((grad, saved, activation, slope, bias_grad))
    return samples


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str) -> None:
    for sample in opcheck_samples(device):
        torch.library.opcheck(torch.ops.convbias._activation_backward.default, sample)


def test_differentiating_the_op_is_refused() -> None:
    grad = torch.randn(2, 4, 3, 3, requires_grad=True)
    saved = torch.randn(2, 4, 3, 3)
    grad_z, grad_bias = torch.ops.convbias._activation_backward(grad, saved, "gelu", 0.01, True)
    assert grad_z.requires_grad and grad_bias is not None and grad_bias.requires_grad
    with pytest.raises(NotImplementedError, match="double backward"):
        grad_z.sum().backward()


def test_compiles_fullgraph() -> None:
    def f(grad: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        grad_z, grad_bias = torch.ops.convbias._activation_backward(grad, saved, "silu", 0.01, True)
        return grad_z.sum() + grad_bias.sum()

    grad, saved, _ = make("silu", torch.float32, "cpu", "channels_last")
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(grad, saved), f(grad, saved))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_layer_backward_matches_eager(device: str) -> None:
    """torch.compile(fullgraph) of a layer with an activation traces its backward through the op's fake kernel."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch_convbias.ConvBias2d(4, 8, 3, padding=1, activation="silu"),
        torch_convbias.ConvBias2d(8, 8, 1, activation="relu"),
    ).to(device)
    x = torch.randn(2, 4, 7, 7, device=device).contiguous(memory_format=torch.channels_last)
    model(x).square().sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(x).square().sum().backward()
    for got, want in zip((p.grad for p in model.parameters()), eager):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
