"""convbias._input_grad, the input gradient of forward's autograd: values against an independent float64 oracle (a
sum over the kernel's taps, einsum and slicing: no convolution kernel), its layout, opcheck, autograd using it (and
ATen's differentiable backward under create_graph), and on CUDA the timed cuDNN conv_dgrad route
(TORCH_CONVBIAS_INPUT_GRAD=timed, the default, against =aten and =graph, in subprocesses: knobs are read once per
process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cases import Case, input_grad_float64
from conftest import DEVICES, MODES, assert_close, math_mode
from torch.utils._python_dispatch import TorchDispatchMode

import torch_convbias

ROOT = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CASES = [
    Case(2, 4, 8, 7, 6, (3, 3), (1, 1), (1, 1), (1, 1), 1, True, True),
    Case(2, 4, 8, 7, 6, (3, 2), (2, 1), (0, 1), (1, 2), 2, False, True),
    Case(1, 4, 6, 6, 4, (3, 3), (1, 1), (1, 1), (1, 1), 4, True, False),
    Case(3, 8, 9, 5, 16, (1, 1), (2, 2), (0, 0), (1, 1), 1, True, True),
    Case(2, 16, 10, 10, 16, (5, 3), (3, 2), (2, 1), (1, 1), 1, True, False),
]


def grad_output_for(case: Case, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ho = (case.h + 2 * case.padding[0] - case.dilation[0] * (case.kernel[0] - 1) - 1) // case.stride[0] + 1
    wo = (case.w + 2 * case.padding[1] - case.dilation[1] * (case.kernel[1] - 1) - 1) // case.stride[1] + 1
    g = torch.Generator().manual_seed(7)
    dy = torch.randn(case.n, case.k, ho, wo, generator=g, dtype=torch.float64).to(device=x.device, dtype=x.dtype)
    return dy.contiguous(memory_format=torch.channels_last if case.channels_last else torch.contiguous_format)


MODES_BY_DEVICE = [
    pytest.param("cpu", "float32", id="cpu-float32"),
    pytest.param("cpu", "bfloat16", id="cpu-bfloat16"),
    pytest.param("cuda", "float32", id="cuda-float32", marks=needs_cuda),
    pytest.param("cuda", "bfloat16", id="cuda-bfloat16", marks=needs_cuda),
]


@pytest.mark.parametrize("device,mode_name", MODES_BY_DEVICE)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_input_grad_matches_float64(device: str, mode_name: str, case: Case) -> None:
    """Values against the float64 oracle, in input's dtype, in the layout F.conv2d gives its output (channels_last
    when input or weight is); an input stand-in of stride 0 (what autograd saves when the weight needs no gradient)
    gives the same result: only its shape is read."""
    mode = MODES[mode_name]
    x, w, _ = case.tensors(device, mode.dtype)
    dy = grad_output_for(case, x, w)
    args = (case.stride, case.padding, case.dilation, case.groups)
    with math_mode(mode):
        got = torch.ops.convbias._input_grad(dy, x, w, *args)
        stand_in = x.new_empty(()).expand(x.shape)
        again = torch.ops.convbias._input_grad(dy, stand_in, w, *args)
    assert got.shape == x.shape and got.dtype == mode.dtype and got.device == x.device
    layout = torch.channels_last if case.channels_last else torch.contiguous_format
    assert got.is_contiguous(memory_format=layout), got.stride()
    assert_close(got.cpu().double(), input_grad_float64(dy, w, x.shape, case), mode, "grad_input")
    torch.testing.assert_close(again, got, rtol=0, atol=0)


def test_input_grad_refuses_bad_arguments() -> None:
    case = CASES[0]
    x, w, _ = case.tensors("cpu", torch.float32)
    dy = grad_output_for(case, x, w)
    with pytest.raises(ValueError, match="stride"):
        torch.ops.convbias._input_grad(dy, x, w, [0, 1], [1, 1], [1, 1], 1)
    with pytest.raises((ValueError, RuntimeError), match="grad_output"):
        torch.ops.convbias._input_grad(dy[:, :3], x, w, [1, 1], [1, 1], [1, 1], 1)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_input_grad(device: str) -> None:
    for case in CASES:
        x, w, _ = case.tensors(device, torch.float32)
        dy = grad_output_for(case, x, w)
        torch.library.opcheck(
            torch.ops.convbias._input_grad.default, (dy, x, w, list(case.stride), list(case.padding),
                                                     list(case.dilation), case.groups))


class OpNames(TorchDispatchMode):
    """The ops dispatched below autograd, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func.overloadpacket._qualified_op_name))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("via", ["op", "function"])
def test_autograd_computes_the_input_gradient_with_the_op(via: str) -> None:
    """forward's C++ autograd and ConvBiasFunction both take the input gradient from convbias._input_grad, right
    against the oracle (the input requiring grad, the weight not: the saved input is a stand-in)."""
    case = CASES[1]
    x, w, b = case.tensors("cpu", torch.float32)
    x.requires_grad_()
    if via == "op":
        y = torch.ops.convbias.forward(x, w, b, *case.conv_args())
    else:
        y = torch_convbias.ConvBiasFunction.apply(x, w, b, *case.conv_args())
    dy = grad_output_for(case, x.detach(), w)
    with OpNames() as seen:
        (grad,) = torch.autograd.grad(y, x, dy)
    assert seen.names.count("convbias::_input_grad") == 1, seen.names
    assert "aten::convolution_backward" not in seen.names, seen.names
    assert_close(grad.double(), input_grad_float64(dy, w, x.shape, case), MODES["float32"], "grad_input")
    info = torch_convbias.explain_param_grad(dy, x.detach(), w, *case.conv_args())["input_grad"]
    assert info["path"] == "aten" and "CPU" in info["notes"][0], info


def test_create_graph_keeps_second_order_gradients_of_the_input() -> None:
    """With create_graph=True the input gradient stays differentiable (ATen's convolution backward): gradgradcheck's
    numerical second derivatives agree with the analytical ones."""
    case = CASES[0]
    x, w, b = case.tensors("cpu", torch.float64)
    x.requires_grad_()

    def fn(inp: torch.Tensor) -> torch.Tensor:
        return torch.ops.convbias.forward(inp, w, b, *case.conv_args()).tanh()

    assert torch.autograd.gradgradcheck(fn, (x,))


SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, "tests")
from cases import Case, input_grad_float64
from test_input_grad import CASES, grad_output_for, input_grad_float64
import torch_convbias

benchmark = sys.argv[1] == "timed"
torch.backends.cudnn.benchmark = benchmark
torch.backends.cudnn.allow_tf32 = False
report = []
for case in CASES:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, w, _ = case.tensors("cuda", dtype)
        dy = grad_output_for(case, x, w)
        got = torch.ops.convbias._input_grad(dy, x, w, *case.conv_args())
        want = input_grad_float64(dy, w, x.shape, case)
        error = ((got.cpu().double() - want).norm() / want.norm()).item()
        info = torch_convbias.explain_param_grad(dy, x, w, *case.conv_args())["input_grad"]
        report.append({"case": case.id, "dtype": str(dtype), "error": error, "channels_last": case.channels_last,
                       "layout_kept": got.is_contiguous(memory_format=torch.channels_last) == case.channels_last,
                       "info": info})
print(json.dumps({"rows": report, "cache": torch_convbias.cache_info()}))
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


TOLERANCE = {"torch.float32": 1e-5, "torch.bfloat16": 1e-2, "torch.float16": 2e-3}


@needs_cuda
def test_cuda_timed_dgrad_graph_or_aten_whichever_measured_faster() -> None:
    """By default (TORCH_CONVBIAS_INPUT_GRAD=timed) under cudnn.benchmark: channels_last problems build a conv_dgrad
    graph and time it against ATen's input gradient, keeping the faster (explain_param_grad says which, with both
    times); NCHW ones run ATen's; every result right against float64, in the input's layout."""
    report = run_script(None, "timed")
    for row in report["rows"]:
        assert row["error"] <= TOLERANCE[row["dtype"]] and row["layout_kept"], row
        info = row["info"]
        if not row["channels_last"]:
            assert info["path"] == "aten" and "NCHW" in info["notes"][0], row
            continue
        assert info["path"] in ("cudnn graph", "aten"), row
        if info["graph_ms"] > 0:  # the graph built and both were measured: the faster one runs
            assert info["aten_ms"] > 0, row
            assert (info["path"] == "cudnn graph") == (info["graph_ms"] < info["aten_ms"]), row
        else:
            assert info["path"] == "aten" and info["notes"], row
    assert report["cache"]["input_grad_plans"] >= 1, report["cache"]


@needs_cuda
@pytest.mark.parametrize("timing", ["untimed", "timed"])
def test_cuda_forced_dgrad_graph_matches_float64(timing: str) -> None:
    """TORCH_CONVBIAS_INPUT_GRAD=graph (the conv_dgrad graph wherever it builds, unmeasured): the graph's own numerics,
    which the timed test checks only where it measured faster; every channels_last problem runs it (or explain says
    cuDNN rejected it), NCHW ones ATen's; all against float64 in the input's layout."""
    report = run_script("graph", timing)
    ran = 0
    for row in report["rows"]:
        assert row["error"] <= TOLERANCE[row["dtype"]] and row["layout_kept"], row
        info = row["info"]
        if not row["channels_last"]:
            assert info["path"] == "aten" and "NCHW" in info["notes"][0], row
        elif info["path"] == "cudnn graph":
            assert any("TORCH_CONVBIAS_INPUT_GRAD=graph" in note for note in info["notes"]), row
            ran += 1
        else:
            assert "rejected" in " ".join(info["notes"]), row
    assert ran > 0, report["rows"]


@needs_cuda
@pytest.mark.parametrize("knob,timing,note", [
    ("aten", "timed", "TORCH_CONVBIAS_INPUT_GRAD=aten"),
    (None, "untimed", "choices untimed"),
])
def test_cuda_aten_input_gradient_when_asked_and_untimed(knob: str | None, timing: str, note: str) -> None:
    """Under TORCH_CONVBIAS_INPUT_GRAD=aten, and by default with choices untimed, ATen's input gradient runs, explain
    saying why; the results are right either way."""
    report = run_script(knob, timing)
    for row in report["rows"]:
        assert row["error"] <= TOLERANCE[row["dtype"]] and row["layout_kept"], row
        if row["channels_last"] or knob == "aten":
            assert row["info"]["path"] == "aten" and note in row["info"]["notes"][0], row
    assert report["cache"]["input_grad_plans"] == 0, report["cache"]
