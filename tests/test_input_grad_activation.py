"""convbias._input_grad_activation: a layer's input gradient times the derivative of the activation of the layer below,
and that gradient's bias sum, in one call (what the convbias backend merges our input gradient and activation backward
into, tests/test_backward_fusion.py). Against float64 oracles independent of the op and of ATen's convolutions (the
tap-sum input gradient of tests/cases.py, then autograd of torch.nn.functional's activation), on the CPU and on CUDA:
there as the two steps with choices untimed or under TORCH_CONVBIAS_INPUT_GRAD=aten, and by default (=timed) with
cudnn.benchmark as one conv_dgrad graph with the derivative in it where that measured faster (explain says which,
with both times; in subprocesses: knobs are read once per process). Argument errors alike in eager and fake mode;
opcheck."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cases import Case, input_grad_float64
from conftest import DEVICES, MODES, math_mode
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_convbias

ROOT = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# name -> (the op's activation, negative_slope, F's function of z, whether the backward keeps the output)
ACTIVATIONS = {
    "relu": ("relu", 0.01, F.relu, True),
    "leaky_relu": ("leaky_relu", 0.2, lambda z: F.leaky_relu(z, 0.2), True),
    "leaky_relu_negative": ("leaky_relu", -0.3, lambda z: F.leaky_relu(z, -0.3), False),
    "gelu": ("gelu", 0.01, F.gelu, False),
    "gelu_tanh": ("gelu_tanh", 0.01, lambda z: F.gelu(z, approximate="tanh"), False),
    "silu": ("silu", 0.01, F.silu, False),
    "sigmoid": ("sigmoid", 0.01, torch.sigmoid, True),
    "tanh": ("tanh", 0.01, torch.tanh, True),
    "identity": ("identity", 0.01, lambda z: z, False),
}
# The input's channels (C) are the channels of the activation below: a multiple of 8 keeps channels_last cases on
# the cuDNN graph's alignment.
CASES = [
    Case(2, 16, 7, 6, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1, True, True),
    Case(3, 8, 9, 8, 16, (3, 3), (2, 2), (1, 1), (1, 1), 1, True, True),
    Case(2, 8, 8, 7, 8, (3, 2), (1, 2), (0, 1), (2, 1), 2, True, False),
]


def problem(case: Case, name: str, device: str, dtype: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    """(dy, x, w, saved, z): the layer's output gradient, input and weight, and the activation below's saved tensor
    (its output or pre-activation z, in x's layout) with the float64 z it was made from."""
    x, w, _ = case.tensors(device, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    ho = (case.h + 2 * case.padding[0] - case.dilation[0] * (case.kernel[0] - 1) - 1) // case.stride[0] + 1
    wo = (case.w + 2 * case.padding[1] - case.dilation[1] * (case.kernel[1] - 1) - 1) // case.stride[1] + 1
    layout = torch.channels_last if case.channels_last else torch.contiguous_format
    dy = torch.randn(case.n, case.k, ho, wo, generator=g, dtype=torch.float64).to(device, dtype).contiguous(
        memory_format=layout)
    z = (2 * torch.randn(x.shape, generator=g, dtype=torch.float64)).to(dtype).double()
    fn, from_output = ACTIVATIONS[name][2], ACTIVATIONS[name][3]
    saved = (fn(z) if from_output else z).to(device, dtype).contiguous(memory_format=layout)
    return dy, x, w, saved, z


def oracle(case: Case, name: str, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, z: torch.Tensor):  # type: ignore[no-untyped-def]
    """(dz, grad_bias) in float64: the tap-sum input gradient, then autograd of F's activation at z."""
    grad_input = input_grad_float64(dy, w, x.shape, case)
    leaf = z.clone().requires_grad_()
    (dz,) = torch.autograd.grad(ACTIVATIONS[name][2](leaf), [leaf], grad_input)
    return dz, dz.sum((0, 2, 3))


def call(case: Case, name: str, dy, x, w, saved, bias_grad: bool = True):  # type: ignore[no-untyped-def]
    activation, slope = ACTIVATIONS[name][:2]
    return torch.ops.convbias._input_grad_activation(dy, x, w, *case.conv_args(), saved, activation, slope, bias_grad)


def assert_matches(dtype_name: str, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    mode = MODES[dtype_name]
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.cpu().double(), want, rtol=mode.rtol, atol=mode.atol * scale,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("device", DEVICES)
def test_matches_float64(device: str, name: str, dtype_name: str) -> None:
    """grad_z and grad_bias against the float64 oracle, in input's dtype, grad_z in the layout of F.conv2d's output
    (channels_last when the input is); without bias_grad, grad_bias is None and grad_z as right (bitwise the same on
    the CPU)."""
    dtype = MODES[dtype_name].dtype
    for case in CASES:
        dy, x, w, saved, z = problem(case, name, device, dtype)
        want_dz, want_db = oracle(case, name, dy, x, w, z)
        with math_mode(MODES[dtype_name]):  # float32 without TF32
            grad_z, grad_bias = call(case, name, dy, x, w, saved)
            alone, none = call(case, name, dy, x, w, saved, bias_grad=False)
        assert grad_z.dtype == dtype and grad_bias is not None and grad_bias.dtype == dtype
        assert grad_z.shape == x.shape and grad_bias.shape == (case.c,)
        layout = torch.channels_last if case.channels_last else torch.contiguous_format
        assert grad_z.is_contiguous(memory_format=layout), (case.id, grad_z.stride())
        assert_matches(dtype_name, f"{case.id} {name} grad_z", grad_z, want_dz)
        assert_matches(dtype_name, f"{case.id} {name} grad_bias", grad_bias, want_db)
        assert none is None
        # Without the bias gradient grad_z is as right; on CUDA another kernel computes it (the derivative alone rather
        # than fused with the bias sum: within rounding, measured on the GPU), on the CPU the same one (bitwise).
        assert_matches(dtype_name, f"{case.id} {name} grad_z without the bias gradient", alone, want_dz)
        if device == "cpu":
            torch.testing.assert_close(alone, grad_z, rtol=0, atol=0)


BAD = [
    (lambda s: s[:, :4], ValueError, r"convbias\._input_grad_activation: expected `saved` of the shape of `input`"),
    (lambda s: s.double(), TypeError, r"convbias\._input_grad_activation: expected `saved` to have the dtype of `input`"),
]


@pytest.mark.parametrize("mangle,error,message", BAD)
def test_bad_saved_fails_alike_in_eager_and_fake_mode(mangle, error, message) -> None:  # type: ignore[no-untyped-def]
    case = CASES[0]
    dy, x, w, saved, _ = problem(case, "relu", "cpu", torch.float32)
    bad = mangle(saved)
    with pytest.raises(error, match=message):
        call(case, "relu", dy, x, w, bad)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (dy, x, w, bad)]
        with pytest.raises(error, match=message):
            call(case, "relu", *fakes)


def test_bad_activation_and_convolution_arguments_are_named() -> None:
    case = CASES[0]
    dy, x, w, saved, _ = problem(case, "relu", "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"convbias\._input_grad_activation: expected `activation` to be one of"):
        torch.ops.convbias._input_grad_activation(dy, x, w, *case.conv_args(), saved, "swish", 0.01, True)
    with pytest.raises(ValueError, match="stride"):
        torch.ops.convbias._input_grad_activation(dy, x, w, [0, 1], [1, 1], [1, 1], 1, saved, "relu", 0.01, True)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str) -> None:
    for case, name, bias_grad in ((CASES[0], "relu", True), (CASES[1], "gelu", False), (CASES[2], "tanh", True)):
        dy, x, w, saved, _ = problem(case, name, device, torch.float32)
        activation, slope = ACTIVATIONS[name][:2]
        torch.library.opcheck(
            torch.ops.convbias._input_grad_activation.default,
            (dy, x, w, *case.conv_args(), saved, activation, slope, bias_grad),
        )


def test_explain_on_the_cpu_is_the_two_steps() -> None:
    case = CASES[0]
    dy, x, w, saved, _ = problem(case, "silu", "cpu", torch.float32)
    info = torch_convbias.explain_input_grad_activation(
        dy, x, w, saved, "silu", stride=case.stride, padding=case.padding, dilation=case.dilation, groups=case.groups)
    assert info["path"] == "separate" and info["activation"] == "silu" and info["derivative_from"] == "pre-activation"
    assert "CPU tensors" in info["notes"][0]


SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, "tests")
import torch_convbias
from test_input_grad_activation import ACTIVATIONS, CASES, assert_matches, call, oracle, problem
from conftest import MODES

torch.backends.cudnn.benchmark = sys.argv[1] == "timed"
torch.backends.cudnn.allow_tf32 = False  # float32 rows against float32 tolerances (bfloat16 rows are unaffected)
rows = []
for dtype_name in ("float32", "bfloat16"):
    for case in CASES:
        for name in ("relu", "leaky_relu", "leaky_relu_negative", "gelu", "gelu_tanh", "silu", "tanh"):
            dy, x, w, saved, z = problem(case, name, "cuda", MODES[dtype_name].dtype)
            want_dz, want_db = oracle(case, name, dy, x, w, z)
            grad_z, grad_bias = call(case, name, dy, x, w, saved)
            error = ""
            try:
                assert_matches(dtype_name, "grad_z", grad_z, want_dz)
                assert_matches(dtype_name, "grad_bias", grad_bias, want_db)
            except AssertionError as e:
                error = str(e)[:500]
            activation, slope = ACTIVATIONS[name][:2]
            info = torch_convbias.explain_input_grad_activation(
                dy, x, w, saved, activation, slope, stride=case.stride, padding=case.padding,
                dilation=case.dilation, groups=case.groups)
            rows.append({"case": case.id, "channels_last": case.channels_last, "name": name, "dtype": dtype_name,
                         "error": error, "info": info})
print(json.dumps({"rows": rows, "cache": torch_convbias.cache_info()}))
"""


def run_script(knob: str | None, timing: str) -> dict:
    env = {**os.environ}
    env.pop("TORCH_CONVBIAS_INPUT_GRAD", None)
    if knob is not None:
        env["TORCH_CONVBIAS_INPUT_GRAD"] = knob
    result = subprocess.run([sys.executable, "-c", SCRIPT, timing], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@needs_cuda
def test_cuda_timed_graph_or_two_steps_whichever_measured_faster() -> None:
    """By default (TORCH_CONVBIAS_INPUT_GRAD=timed) under cudnn.benchmark: channels_last problems whose derivative
    cuDNN has a node for build the conv_dgrad + derivative graph and time it against the two steps, keeping the faster
    (explain says which, with both times); tanh (its backward keeps the output, cuDNN's TANH_BWD reads the input) and
    NCHW problems take the two steps, saying why; every result right against float64."""
    report = run_script(None, "timed")
    built = 0
    for row in report["rows"]:
        assert not row["error"], row
        info = row["info"]
        if row["name"] == "tanh":  # checked before the layout: no graph could take it in any layout
            assert info["path"] == "separate" and "no cuDNN derivative node" in info["notes"][0], row
        elif not row["channels_last"]:
            assert info["path"] == "separate" and "NCHW" in info["notes"][0], row
        elif info["graph_ms"] > 0:  # the graph built and both ways were measured: the faster one runs
            built += 1
            assert info["separate_ms"] > 0, row
            assert (info["path"] == "cudnn graph") == (info["graph_ms"] < info["separate_ms"]), row
            if info["path"] == "cudnn graph":
                assert info["engine"]["name"], row
        else:
            assert info["path"] == "separate" and info["notes"], row
    assert built > 0, "no conv_dgrad + derivative graph built for any problem"
    assert report["cache"]["input_grad_activation_plans"] >= 1, report["cache"]


@needs_cuda
@pytest.mark.parametrize("timing", ["untimed", "timed"])
def test_cuda_forced_graph_matches_float64_for_every_derivative(timing: str) -> None:
    """TORCH_CONVBIAS_INPUT_GRAD=graph (the graph wherever it builds, unmeasured, whatever the timing): the graph's own
    numerics, which the timed test checks only where the graph measured faster. Every channels_last problem whose
    derivative cuDNN has a node for runs the conv_dgrad + derivative graph unless cuDNN rejects it (explain says so):
    relu and leaky_relu from the output, leaky_relu with a negative slope, gelu, gelu_tanh and silu from the
    pre-activation; each result equals float64. ReLU's graph (built on the H200 by bench/probe_dgrad_epilogue) runs."""
    report = run_script("graph", timing)
    ran = set()
    for row in report["rows"]:
        assert not row["error"], row
        info = row["info"]
        if row["name"] == "tanh" or not row["channels_last"]:
            assert info["path"] == "separate", row
        elif info["path"] == "cudnn graph":
            assert any("TORCH_CONVBIAS_INPUT_GRAD=graph" in note for note in info["notes"]), row
            assert info["graph_ms"] == -1 and info["engine"]["name"], row
            ran.add(row["name"])
        else:
            assert "rejected" in " ".join(info["notes"]), row
    assert "relu" in ran, ran


@needs_cuda
@pytest.mark.parametrize("knob,timing,note", [
    ("aten", "timed", "TORCH_CONVBIAS_INPUT_GRAD=aten"),
    (None, "untimed", "choices untimed"),
])
def test_cuda_two_steps_when_asked_and_untimed(knob: str | None, timing: str, note: str) -> None:
    """Under TORCH_CONVBIAS_INPUT_GRAD=aten, and by default with choices untimed, the two steps run, explain saying
    why; the results are right either way."""
    report = run_script(knob, timing)
    for row in report["rows"]:
        assert not row["error"], row
        if row["channels_last"] and row["name"] != "tanh" or knob == "aten":
            assert row["info"]["path"] == "separate" and note in row["info"]["notes"][0], row
    assert report["cache"]["input_grad_activation_plans"] == 0, report["cache"]
