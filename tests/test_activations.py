"""The activation argument of convbias::forward (conv + bias + activation in one call): forward and every gradient
against nn.Conv2d followed by the activation module (float64 on the CPU: an oracle independent of our kernels),
for every activation, dtype and layout; the errors, alike in eager and fake mode; what the backward keeps and what
it calls (one convbias._activation_backward, then the weight gradient; on CUDA the fused kernel, seen by explain
and the profiler); and convert() fusing a Sequential's conv + activation pairs, never one whose modules carry hooks
or are shared. The op _activation_backward itself: tests/test_activation_backward.py."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

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


needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[1]

# The op's reference for each activation name (slope: leaky_relu's).
REFERENCE = {
    "identity": lambda t, slope: t,
    "relu": lambda t, slope: F.relu(t),
    "leaky_relu": lambda t, slope: F.leaky_relu(t, slope),
    "gelu": lambda t, slope: F.gelu(t),
    "gelu_tanh": lambda t, slope: F.gelu(t, approximate="tanh"),
    "silu": lambda t, slope: F.silu(t),
    "sigmoid": lambda t, slope: torch.sigmoid(t),
    "tanh": lambda t, slope: torch.tanh(t),
}
# What the graph's last node must be, per activation (graph_ops in explain).
EPILOGUE_OP = {
    "relu": "RELU_FWD",
    "gelu": "GELU_FWD",
    "gelu_tanh": "GELU_APPROX_TANH_FWD",
    "silu": "SWISH_FWD",
    "sigmoid": "SIGMOID_FWD",
    "tanh": "TANH_FWD",
}


def cuda_problem(n: int, c: int, k: int, hw: int, dtype: torch.dtype, seed: int, bias: bool = True) -> tuple:
    """channels_last tensors with channel counts the fusion engines take (multiples of 8); `hw` picks a key no other
    test builds, so that each test sees its own plan being chosen."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cl = torch.channels_last
    x = torch.randn(n, c, hw, hw, device="cuda", generator=g).to(dtype).contiguous(memory_format=cl)
    w = (torch.randn(k, c, 3, 3, device="cuda", generator=g) / (3 * c**0.5)).to(dtype).contiguous(memory_format=cl)
    b = torch.randn(k, device="cuda", generator=g).to(dtype) if bias else None
    return x, w, b


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, name: str, slope: float) -> torch.Tensor:
    """float32 conv (TF32 off) + activation: what the op's output is compared with (rounded once at the end)."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        out = F.conv2d(x.float(), w.float(), None if b is None else b.float(), padding=1)
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    return REFERENCE[name](out, slope)


def check_output(out: torch.Tensor, expected: torch.Tensor) -> None:
    tolerance = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[out.dtype]
    scale = max(1.0, expected.abs().amax().item())
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance * scale)


# explain's name of the activation pass after a cuDNN graph that does not apply it, for 16-bit dtypes (ours, with the
# cheaper float math) and others (ATen's kernel): activation_pass_name in csrc/cuda/bias_activation.h.
PASS_16BIT = "our activation pass (16-bit math)"
PASS_ATEN = "ATen's pointwise kernel"


def pass_after_graph(info: dict) -> str:
    """The pass explain must name after the graph, from the dtype in its problem description."""
    return PASS_16BIT if any(f" {t}, " in info["problem"] for t in ("Half", "BFloat16")) else PASS_ATEN


def check_consistent(info: dict, name: str, slope: float = 0.01) -> None:
    """explain's activation entry agrees with the graph it reports: the epilogue node last when fused, absent when not
    (then a pass after the graph ran it, ours for 16-bit dtypes, ATen's otherwise, and `why` says why)."""
    act = info["activation"]
    assert act["name"] == name, info
    ops = info["graph_ops"]
    if act["fused"]:
        last = "RELU_FWD(lower_clip_slope=" if name == "leaky_relu" else EPILOGUE_OP[name]
        assert info["path"] in ("fused", "conv") and ops and ops[-1].startswith(last), info
        assert "epilogue" in act["how"], act
    else:
        assert not any(op.endswith("_FWD") or "_FWD(" in op for op in ops), info
        if info["path"] == "conv+bias_add" and not act["keeps_preactivation"]:
            assert act["how"] == ONE_PASS, act  # our bias + activation kernel after the conv graph
        elif info["path"] == "aten" and act["how"] == ONE_PASS_AFTER_ATEN:
            # ATen's convolution chosen (measured fastest), then our bias + activation pass: never with z kept
            assert not act["keeps_preactivation"] and act["why"], act
        elif info["path"] == "aten" or "conv + bias plan" in act["how"]:
            assert act["how"].startswith(PASS_ATEN) and act["why"], act  # after ATen's convolution / NCHW keeping z
        else:
            assert act["how"].startswith(f"{pass_after_graph(info)} over the cuDNN graph's output") and act["why"], act


ONE_PASS = "one pass adding the bias and applying the activation over the conv graph's output"
ONE_PASS_AFTER_ATEN = "one pass adding the bias and applying the activation over ATen's convolution's output"


@needs_cuda
def test_relu_runs_in_the_graphs_epilogue() -> None:
    """relu in fp16 channels_last (the fusion the precompiled engines are made for): one graph conv -> bias add ->
    RELU_FWD, chosen without timing (torch's default), with the result of conv + bias + relu rounded once."""
    x, w, b = cuda_problem(4, 32, 64, 11, torch.float16, seed=1)
    out = conv_bias2d(x, w, b, padding=1, activation="relu")
    info = torch_convbias.explain(x, w, b, padding=1, activation="relu")
    assert info["math"]["tuning"] == "untimed", info["math"]
    assert info["path"] == "fused" and info["activation"]["fused"] is True, info
    assert info["graph_ops"] == ["CONV_FPROP", "ADD", "RELU_FWD"], info
    assert "built and ran" in info["activation"]["why"], info["activation"]
    assert out.is_contiguous(memory_format=torch.channels_last)
    check_output(out, reference(x, w, b, "relu", 0.01))


NO_BIAS_SCRIPT = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_activations import cuda_problem, reference, check_output
import torch_convbias
x, w, _ = cuda_problem(4, 32, 64, 13, torch.float16, seed=2, bias=False)
out = torch_convbias.conv_bias2d(x, w, None, padding=1, activation="relu")
check_output(out, reference(x, w, None, "relu", 0.01))
print(json.dumps(torch_convbias.explain(x, w, None, padding=1, activation="relu")))
"""


@needs_cuda
def test_conv_without_bias_gets_the_epilogue_when_an_engine_builds_it() -> None:
    """conv -> RELU_FWD without a bias add. Untimed (torch's default) only precompiled engines are tried, and on the
    H200 (cuDNN 9.19) none runs this graph: the convolution's graph then ATen's relu, and explain says why. Forced
    (TORCH_CONVBIAS_ACTIVATION=fused, runtime-compiled engines allowed) the graph is conv -> relu, and right."""
    x, w, _ = cuda_problem(4, 32, 64, 13, torch.float16, seed=2, bias=False)
    out = conv_bias2d(x, w, None, padding=1, activation="relu")
    check_output(out, reference(x, w, None, "relu", 0.01))
    info = torch_convbias.explain(x, w, None, padding=1, activation="relu")
    assert info["path"] == "conv", info
    if info["activation"]["fused"]:
        assert info["graph_ops"] == ["CONV_FPROP", "RELU_FWD"], info
    else:
        assert info["graph_ops"] == ["CONV_FPROP"], info
        assert "rejected" in info["activation"]["why"] and "precompiled engines only" in info["activation"]["why"], info

    result = run_with_knobs(NO_BIAS_SCRIPT, TORCH_CONVBIAS_ACTIVATION="fused")
    assert result.returncode == 0, result.stderr[-3000:]
    forced = json.loads(result.stdout.strip().splitlines()[-1])
    assert forced["path"] == "conv" and forced["activation"]["fused"] is True, forced
    assert forced["graph_ops"] == ["CONV_FPROP", "RELU_FWD"], forced


@needs_cuda
def test_leaky_relu_slope_is_in_the_graph_and_the_key() -> None:
    """The slope is the node's relu_lower_clip_slope; two slopes are two plans (never one slope's graph for the
    other), and the output follows each."""
    x, w, b = cuda_problem(4, 32, 64, 9, torch.float16, seed=3)
    for slope in (0.2, -0.3):
        out = conv_bias2d(x, w, b, padding=1, activation="leaky_relu", negative_slope=slope)
        info = torch_convbias.explain(x, w, b, padding=1, activation="leaky_relu", negative_slope=slope)
        check_consistent(info, "leaky_relu", slope)
        if info["activation"]["fused"]:
            assert info["graph_ops"][-1] == "RELU_FWD(lower_clip_slope=%.9g)" % torch.tensor(slope).float().item(), info
        assert f"negative_slope {slope}" in info["problem"], info["problem"]
        check_output(out, reference(x, w, b, "leaky_relu", slope))


@needs_cuda
@pytest.mark.parametrize("timed", [False, True], ids=["untimed", "benchmark"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("name", [name for name in REFERENCE if name != "identity"])
def test_every_activation_is_right_fused_or_not(name: str, dtype: torch.dtype, timed: bool) -> None:
    """Whichever route each activation takes (the epilogue where it builds and, when timed, is faster), the result
    is conv + bias + activation and explain says which route ran and why. Under cudnn.benchmark the epilogue was
    measured against the graph without it: both timings are reported."""
    x, w, b = cuda_problem(4, 32, 64, 15 + timed, dtype, seed=4)
    saved = torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = timed, False
    try:
        out = conv_bias2d(x, w, b, padding=1, activation=name, negative_slope=0.1)
        info = torch_convbias.explain(x, w, b, padding=1, activation=name, negative_slope=0.1)
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = saved
    check_consistent(info, name, 0.1)
    act = info["activation"]
    if timed and info["path"] != "aten" and (act["fused"] or "measured" in act["why"]):
        assert act["epilogue_ms"] > 0 and act["separate_ms"] > 0, act
    check_output(out, reference(x, w, b, name, 0.1))


@needs_cuda
@pytest.mark.parametrize("name", ["relu", "gelu"])
def test_nchw_inputs_with_an_activation(name: str) -> None:
    """NCHW input and weight: the NCHW graph, the channels_last copies or ATen, each with the activation, timed
    against each other under cudnn.benchmark; the output stays NCHW and right."""
    x, w, b = cuda_problem(4, 32, 64, 14, torch.float32, seed=5)
    x, w = x.contiguous(), w.contiguous()
    saved = torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        for benchmark in (False, True):
            torch.backends.cudnn.benchmark = benchmark
            out = conv_bias2d(x, w, b, padding=1, activation=name)
            info = torch_convbias.explain(x, w, b, padding=1, activation=name)
            assert out.is_contiguous(), out.stride()
            check_consistent(info, name)
            check_output(out, reference(x, w, b, name, 0.01))
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = saved


@needs_cuda
def test_a_rejected_epilogue_falls_back_to_the_graph_without_it() -> None:
    """cuDNN refusing the graph with the activation (the test hook refuses it as cuDNN would) leaves the fused
    conv+bias graph and the activation pass after it (ours in fp16): the same result, and explain says which graph was
    refused."""
    x, w, b = cuda_problem(4, 32, 64, 17, torch.float16, seed=6)
    try:
        torch.ops.convbias._inject_epilogue_rejections(1)
        out = conv_bias2d(x, w, b, padding=1, activation="relu")
    finally:
        torch.ops.convbias._inject_epilogue_rejections(0)
    info = torch_convbias.explain(x, w, b, padding=1, activation="relu")  # the plan the call made (cached)
    act = info["activation"]
    assert info["path"] == "fused" and act["fused"] is False, info
    assert info["graph_ops"] == ["CONV_FPROP", "ADD"], info
    assert "fused conv+bias+relu graph rejected" in act["why"] and "test hook" in act["why"], act
    assert act["how"] == f"{PASS_16BIT} over the cuDNN graph's output", act
    check_output(out, reference(x, w, b, "relu", 0.01))


@needs_cuda
def test_an_epilogue_candidate_that_fails_to_execute_is_skipped() -> None:
    """A plan of the epilogue graph that builds but fails to run is skipped like any other candidate: the call is
    right whether another epilogue plan ran or the graph without the epilogue did."""
    x, w, b = cuda_problem(4, 32, 64, 19, torch.float16, seed=7)
    try:
        torch.ops.convbias._inject_execution_failures(1)
        out = conv_bias2d(x, w, b, padding=1, activation="relu")
    finally:
        torch.ops.convbias._inject_execution_failures(0)
    info = torch_convbias.explain(x, w, b, padding=1, activation="relu")
    check_consistent(info, "relu")
    assert info["engine"]["execution_failures"] >= 1 or not info["activation"]["fused"], info
    check_output(out, reference(x, w, b, "relu", 0.01))


@needs_cuda
def test_cuda_graph_capture_with_an_activation() -> None:
    """During capture the plan is chosen untimed and nothing runs outside the captured work; replays are right."""
    x, w, b = cuda_problem(4, 32, 64, 21, torch.float16, seed=8)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            out = conv_bias2d(x, w, b, padding=1, activation="gelu")
    torch.cuda.current_stream().wait_stream(stream)
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    check_output(out, reference(x, w, b, "gelu", 0.01))


def run_with_knobs(code: str, **knobs: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, **knobs}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


KNOB_SCRIPT = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_activations import cuda_problem, reference, check_output
import torch_convbias
rows = {}
for i, name in enumerate(%r):
    x, w, b = cuda_problem(4, 32, 64, 10, torch.float16, seed=20 + i)
    out = torch_convbias.conv_bias2d(x, w, b, padding=1, activation=name, negative_slope=0.2)
    check_output(out, reference(x, w, b, name, 0.2))
    rows[name] = torch_convbias.explain(x, w, b, padding=1, activation=name, negative_slope=0.2)
print(json.dumps(rows))
"""


@needs_cuda
def test_activation_knob_unfused_runs_atens_pass() -> None:
    result = run_with_knobs(KNOB_SCRIPT % (["relu", "gelu"],), TORCH_CONVBIAS_ACTIVATION="unfused")
    assert result.returncode == 0, result.stderr[-3000:]
    for name, info in json.loads(result.stdout.strip().splitlines()[-1]).items():
        assert info["path"] == "fused" and info["graph_ops"] == ["CONV_FPROP", "ADD"], (name, info)
        assert info["activation"]["fused"] is False, (name, info)
        assert info["activation"]["why"] == "TORCH_CONVBIAS_ACTIVATION=unfused", (name, info)


@needs_cuda
def test_activation_knob_fused_builds_every_epilogue() -> None:
    """TORCH_CONVBIAS_ACTIVATION=fused: every activation in the graph's epilogue (runtime-compiled engines allowed),
    or an error naming the graph cuDNN refused. fp16 channels_last, channel counts the fusion engines take."""
    names = list(EPILOGUE_OP) + ["leaky_relu"]
    result = run_with_knobs(KNOB_SCRIPT % (names,), TORCH_CONVBIAS_ACTIVATION="fused")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    for name, info in rows.items():
        assert info["activation"]["fused"] is True, (name, info)
        check_consistent(info, name, 0.2)
        assert "TORCH_CONVBIAS_ACTIVATION=fused" in info["activation"]["why"], (name, info)


@needs_cuda
@pytest.mark.parametrize(
    "knobs,message",
    [
        ({"TORCH_CONVBIAS_ACTIVATION": "epilogue"}, "TORCH_CONVBIAS_ACTIVATION must be auto, fused or unfused, got 'epilogue'"),
        (
            {"TORCH_CONVBIAS_ACTIVATION": "fused", "TORCH_CONVBIAS_PATH": "unfused"},
            "TORCH_CONVBIAS_ACTIVATION=fused needs the bias in the cuDNN graph, which TORCH_CONVBIAS_PATH=unfused excludes",
        ),
    ],
    ids=["unknown", "contradicts-path"],
)
def test_bad_activation_knob_is_reported(knobs: dict, message: str) -> None:
    result = run_with_knobs(KNOB_SCRIPT % (["relu"],), **knobs)
    assert result.returncode != 0 and message in result.stderr and "ValueError" in result.stderr, result.stderr[-3000:]


@needs_cuda
def test_explain_reports_the_activation_on_cuda() -> None:
    x = torch.randn(4, 32, 10, 10, device="cuda").contiguous(memory_format=torch.channels_last)
    w = torch.randn(32, 32, 3, 3, device="cuda").contiguous(memory_format=torch.channels_last)
    b = torch.randn(32, device="cuda")
    info = torch_convbias.explain(x, w, b, padding=1, activation="silu")
    assert info["path"] in ("fused", "conv+bias_add", "aten"), info
    check_consistent(info, "silu")
    identity = torch_convbias.explain(x, w, b, padding=1)
    assert identity["activation"] == {
        "name": "identity", "fused": False, "how": "none", "why": "", "epilogue_ms": -1, "separate_ms": -1,
        "keeps_preactivation": False, "preactivation_output": False,
    }, identity["activation"]
    assert "RELU_FWD" not in identity["graph_ops"] and "activation" not in identity["problem"], identity


def test_explain_on_cpu_reports_atens_activation() -> None:
    x, w, b = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3), torch.randn(3)
    cpu = json.loads(torch.ops.convbias._explain(x, w, b, [1, 1], [1, 1], [1, 1], 1, "silu", 0.01))
    assert cpu["path"] == "aten" and cpu["graph_ops"] == [], cpu
    assert cpu["activation"] == {
        "name": "silu", "fused": False, "how": "ATen, before the result is rounded", "why": "CPU tensors: no cuDNN graph",
        "keeps_preactivation": False,
    }, cpu
    # The test hook is callable anywhere (it only arms the CUDA path's graph building).
    torch.ops.convbias._inject_epilogue_rejections(0)


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
    assert ("convbias._input_grad" in [op for op, _ in recorder.calls]) == input_requires_grad
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


ONE_PASS_SCRIPT = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_activations import cuda_problem, reference, check_output
import torch_convbias
torch.backends.cudnn.allow_tf32 = False
rows = {}
for i, name in enumerate(["relu", "leaky_relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"]):
    for j, dtype in enumerate([torch.float32, torch.float16, torch.bfloat16]):
        x, w, b = cuda_problem(2, 16, 24, 9 + j, dtype, seed=40 + i)
        out = torch_convbias.conv_bias2d(x, w, b, padding=1, activation=name, negative_slope=0.2)
        check_output(out, reference(x, w, b, name, 0.2))
        assert out.is_contiguous(memory_format=torch.channels_last)
        rows[f"{name}-{dtype}"] = torch_convbias.explain(x, w, b, padding=1, activation=name, negative_slope=0.2)
# The pre-activation kept (autograd's gelu): ATen's bias add, then our 16-bit activation pass out of place.
x, w, b = cuda_problem(2, 16, 24, 12, torch.float16, seed=60)
out, z = torch.ops.convbias._forward_with_preactivation(x, w, b, [1, 1], [1, 1], [1, 1], 1, "gelu", 0.01)
check_output(z, reference(x, w, b, "identity", 0.01))
check_output(out, reference(x, w, b, "gelu", 0.01))
rows["keeps"] = torch_convbias.explain(x, w, b, padding=1, activation="gelu", for_backward=True)
print(json.dumps(rows))
"""


EVERY_VALUE_SCRIPT = """
import json, os, sys, torch
sys.path.insert(0, "tests")
from conftest import assert_within_one_ulp, every_value, tail_accurate
from test_activations import REFERENCE
import torch_convbias
rows = {}
for dtype in (torch.float16, torch.bfloat16):
    values = every_value(dtype, 16.0)
    values = torch.cat([values, values.new_zeros(-values.numel() % 256)])
    # The identity 1x1 convolution (one product by 1, FP32 accumulation: exact): the pass's input is x itself.
    x = values.view(-1, 2, 2, 64).permute(0, 3, 1, 2).cuda()
    w = torch.eye(64, dtype=dtype, device="cuda").view(64, 64, 1, 1).contiguous(memory_format=torch.channels_last)
    b = torch.zeros(64, dtype=dtype, device="cuda")
    # KEEP=1: a weight needing its gradient, so that autograd's forward keeps the pre-activation where the
    # derivative needs it (gelu, gelu_tanh, silu) and the pass runs out of place over it.
    keep = os.environ["KEEP"] == "1"
    w.requires_grad_(keep)
    for name in ("gelu", "gelu_tanh", "silu", "sigmoid"):
        out = torch_convbias.conv_bias2d(x, w, b, activation=name)
        formula = tail_accurate(name) or (lambda t: REFERENCE[name](t, 0.01))
        want = formula(x.cpu().double())
        assert_within_one_ulp(out, want, f"{name} {dtype}", max_mismatch=5e-3)
        rows[f"{name}-{dtype}"] = torch_convbias.explain(x, w, b, activation=name, for_backward=keep)
print(json.dumps(rows))
"""

# Routes that run a 16-bit activation pass of ours: (knobs, the path explain must report, its activation `how`).
EVERY_VALUE_ROUTES = {
    # The conv graph, then one pass adding the bias and applying the activation.
    "one_pass": ({"TORCH_CONVBIAS_PATH": "unfused", "KEEP": "0"}, "conv+bias_add", ONE_PASS),
    # The fused conv+bias graph, then the activation pass in place.
    "after_graph": ({"TORCH_CONVBIAS_ACTIVATION": "unfused", "KEEP": "0"}, "fused",
                    f"{PASS_16BIT} over the cuDNN graph's output"),
    # The fused conv+bias graph writing the pre-activation, then the activation pass out of place (autograd's).
    "after_graph_kept": ({"TORCH_CONVBIAS_ACTIVATION": "unfused", "KEEP": "1"}, "fused",
                         f"{PASS_16BIT} over the cuDNN graph's output"),
}


@needs_cuda
@pytest.mark.parametrize("route", list(EVERY_VALUE_ROUTES))
def test_16bit_activation_pass_within_one_ulp_of_every_value(route: str) -> None:
    """float16 / bfloat16: our activation passes (one bias + activation pass after the conv graph; the pass after the
    fused conv+bias graph, in place or out of place over a kept pre-activation) compute gelu, gelu_tanh, silu and
    sigmoid with cheaper float math (csrc/cuda/activation_math.cuh); over every value of the dtype in [-16, 16]
    (through an identity 1x1 convolution) the output is within one ulp of float64's and is its correct rounding in all
    but a few per thousand values; explain names the route that ran."""
    knobs, path, how = EVERY_VALUE_ROUTES[route]
    result = run_with_knobs(EVERY_VALUE_SCRIPT, **knobs)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(rows) == 8, rows.keys()
    for row, info in rows.items():
        act = info["activation"]
        assert info["path"] == path and act["fused"] is False and act["how"].startswith(how), (row, info)
        kept = knobs["KEEP"] == "1" and not row.startswith("sigmoid")  # sigmoid's derivative needs the output only
        assert act["keeps_preactivation"] is kept and ("both kept" in act["how"]) is kept, (row, info)


@needs_cuda
def test_conv_graph_then_one_bias_activation_pass() -> None:
    """TORCH_CONVBIAS_PATH=unfused: the conv graph, then one pass of ours adding the bias and applying the activation
    (what Inductor runs after nn.Conv2d's convolution), right for every activation and dtype, explain saying so; with
    the pre-activation kept, ATen's bias add and the activation out of place (our pass: float16)."""
    result = run_with_knobs(ONE_PASS_SCRIPT, TORCH_CONVBIAS_PATH="unfused")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    keeps = rows.pop("keeps")
    for row, info in rows.items():
        assert info["path"] == "conv+bias_add" and info["graph_ops"] == ["CONV_FPROP"], (row, info)
        assert info["activation"]["fused"] is False and info["activation"]["how"] == ONE_PASS, (row, info)
        check_consistent(info, info["activation"]["name"], 0.2)
    assert keeps["path"] == "conv+bias_add" and keeps["activation"]["keeps_preactivation"] is True, keeps
    assert keeps["activation"]["how"] == (
        f"{PASS_16BIT} over the cuDNN graph's output, out of place over the pre-activation (both kept)"), keeps


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_activation_pass_ways_agree_on_every_value(dtype: torch.dtype) -> None:
    """convbias._activation_pass, the benchmarks' handle on the pass after a graph: every way, on every value of the
    dtype in [-16, 16] in a channels_last tensor, is within one ulp of float64 (the tail-accurate oracle), keeps the
    layout, and 'graph' is the 'fast' way (what the forward runs after a graph for 16-bit dtypes)."""
    from conftest import assert_within_one_ulp, every_value, tail_accurate

    values = every_value(dtype, 16.0)
    values = torch.cat([values, values.new_zeros(-values.numel() % 64)])
    z = values.view(-1, 2, 2, 16).permute(0, 3, 1, 2).cuda()  # channels_last [M, 16, 2, 2]
    for name in ("identity", "relu", "leaky_relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"):
        want = (tail_accurate(name) or (lambda t: REFERENCE[name](t, 0.2)))(z.cpu().double())
        outs = {way: torch.ops.convbias._activation_pass(z, name, 0.2, way) for way in ("graph", "aten", "fast", "exact")}
        if name == "identity":  # every way is a copy: the values exactly
            for way, out in outs.items():
                torch.testing.assert_close(out, z, rtol=0, atol=0, msg=f"identity {way}")
        for way, out in outs.items():
            assert out.is_contiguous(memory_format=torch.channels_last) and out.dtype == dtype, (name, way)
            # ATen's float formulas lose the far negative tail of gelu / gelu_tanh (1 + erf(x) cancels): not there.
            if not (way in ("aten", "exact") and name in ("gelu", "gelu_tanh")):
                assert_within_one_ulp(out, want, f"{name} {way} {dtype}", max_mismatch=5e-3)
        torch.testing.assert_close(outs["graph"], outs["fast"], rtol=0, atol=0)


@needs_cuda
def test_activation_pass_refuses_bad_arguments() -> None:
    z = torch.randn(2, 4, 3, 3, device="cuda")
    with pytest.raises(ValueError, match="expected `way` to be 'graph', 'aten', 'fast' or 'exact', got 'other'"):
        torch.ops.convbias._activation_pass(z, "gelu", 0.0, "other")
    with pytest.raises(ValueError, match="expected `activation` to be one of"):
        torch.ops.convbias._activation_pass(z, "swish", 0.0, "graph")
    with pytest.raises(RuntimeError, match="our activation pass takes float16 / bfloat16 CUDA tensors, got Float"):
        torch.ops.convbias._activation_pass(z, "gelu", 0.0, "fast")
    # float32 after a graph: ATen's kernel, exactly
    torch.testing.assert_close(torch.ops.convbias._activation_pass(z, "gelu", 0.0, "graph"), F.gelu(z), rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("name", ["identity", "relu", "gelu"])
def test_aten_convolution_then_one_bias_activation_pass(name: str) -> None:
    """Where ATen's convolution measures faster than the cuDNN graph (cudnn.benchmark; the test hook makes it so), the
    call runs it, then one pass of ours adding the bias and applying the activation (Inductor's route for nn.Conv2d +
    the activation; identity: ATen's own bias add), right against float32 math, explain saying so."""
    x, w, b = cuda_problem(2, 16, 40, 23, torch.bfloat16, seed=70)
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        torch.ops.convbias._inject_aten_preferences(1)
        out = conv_bias2d(x, w, b, padding=1, activation=name)
        torch.ops.convbias._inject_aten_preferences(0)
        info = torch_convbias.explain(x, w, b, padding=1, activation=name)  # the plan the call made (cached)
    finally:
        torch.ops.convbias._inject_aten_preferences(0)
        torch.backends.cudnn.benchmark = saved
    assert info["path"] == "aten" and any("test hook" in note for note in info["notes"]), info
    assert out.is_contiguous(memory_format=torch.channels_last)
    check_output(out, reference(x, w, b, name, 0.01))
    if name != "identity":
        assert info["activation"]["how"] == ONE_PASS_AFTER_ATEN, info
        check_consistent(info, name)
