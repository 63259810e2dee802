"""convbias::_forward_with_preactivation: (act(z), z) for z = conv + bias in one call, what forward's autograd runs for
the activations whose derivative needs the pre-activation (gelu, gelu_tanh, silu, leaky_relu with a negative slope).
On the CPU: both outputs against float64 F.conv2d + the activation, z rounded before the activation (the reference's
rounding), layouts and distinct storages, opcheck, fake mode, autograd calling the op once and keeping z, compile.
On CUDA (skipped without a GPU): the one graph writing both tensors (explain's graph_outputs and activation entry),
its fallback, NCHW tensors, the plan store round trip of the two-output plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, MODES, assert_close, assert_within_one_ulp, tail_accurate
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import torch_convbias
from torch_convbias import conv_bias2d

op = torch.ops.convbias._forward_with_preactivation
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[1]

# name -> (the module nn.Conv2d is followed by, the op's activation name, negative_slope)
KEEPING = {
    "gelu": (nn.GELU(), "gelu", 0.01),
    "gelu_tanh": (nn.GELU(approximate="tanh"), "gelu_tanh", 0.01),
    "silu": (nn.SiLU(), "silu", 0.01),
    "leaky_relu_negative": (nn.LeakyReLU(-0.2), "leaky_relu", -0.2),
}
# The op takes every activation (identity: a copy of z); these keep the output for their backward instead.
OTHERS = {
    "identity": (nn.Identity(), "identity", 0.01),
    "relu": (nn.ReLU(), "relu", 0.01),
    "leaky_relu": (nn.LeakyReLU(0.2), "leaky_relu", 0.2),
    "tanh": (nn.Tanh(), "tanh", 0.01),
}
EPILOGUE_OP = {"gelu": "GELU_FWD", "gelu_tanh": "GELU_APPROX_TANH_FWD", "silu": "SWISH_FWD", "leaky_relu": "RELU_FWD("}


def problem(device: str, dtype: torch.dtype, fmt: torch.memory_format, bias: bool = True, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 8, 7, 9, generator=g, dtype=torch.float64)
    w = torch.randn(16, 8, 3, 3, generator=g, dtype=torch.float64) / 8
    b = torch.randn(16, generator=g, dtype=torch.float64) if bias else None
    x, w = (t.to(device, dtype).contiguous(memory_format=fmt) for t in (x, w))
    return x, w, None if b is None else b.to(device, dtype)


def args(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, name: str, slope: float) -> tuple:
    return (x, w, b, [1, 1], [1, 1], [1, 1], 1, name, slope)


LAYOUTS = [pytest.param(torch.contiguous_format, id="nchw"), pytest.param(torch.channels_last, id="channels_last")]


@pytest.mark.parametrize("fmt", LAYOUTS)
@pytest.mark.parametrize("mode_name", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("key", list(KEEPING) + list(OTHERS))
def test_outputs_match_float64_conv2d_then_activation_on_cpu(
    key: str, bias: bool, mode_name: str, fmt: torch.memory_format
) -> None:
    module, name, slope = {**KEEPING, **OTHERS}[key]
    mode = MODES[mode_name]
    x, w, b = problem("cpu", mode.dtype, fmt, bias)
    out, z = op(*args(x, w, b, name, slope))
    z_ref = F.conv2d(x.double(), w.double(), None if b is None else b.double(), padding=1)
    for what, got in (("output", out), ("preactivation", z)):
        assert got.dtype == mode.dtype and got.shape == z_ref.shape, what
        assert got.is_contiguous(memory_format=fmt), (what, got.stride())
    # Two tensors, never one: autograd keeps z while the next layer may modify the output in place.
    assert out.untyped_storage().data_ptr() != z.untyped_storage().data_ptr()
    assert_close(z.double(), z_ref, mode, f"{key} preactivation")
    assert_close(out.double(), module(z_ref), mode, f"{key} output")
    # The reference's rounding: the activation of z as rounded to the dtype.
    torch.testing.assert_close(out, module(z), rtol=0, atol=0)
    # And forward with the same activation agrees (its CPU route rounds once, after the activation).
    assert_close(out.double(), torch.ops.convbias.forward(*args(x, w, b, name, slope)).double(), mode, key)


@pytest.mark.parametrize("fmt", LAYOUTS)
@pytest.mark.parametrize("key", ["gelu", "leaky_relu_negative", "identity"])
def test_opcheck_on_cpu(key: str, fmt: torch.memory_format) -> None:
    """No autograd of its own (autograd calls it below itself): samples without requires_grad."""
    _, name, slope = {**KEEPING, **OTHERS}[key]
    for bias in (True, False):
        x, w, b = problem("cpu", torch.float32, fmt, bias, seed=1)
        torch.library.opcheck(op.default, args(x, w, b, name, slope))


@pytest.mark.parametrize("fmt", LAYOUTS)
def test_fake_outputs_are_forwards_output_twice(fmt: torch.memory_format) -> None:
    x, w, b = problem("cpu", torch.bfloat16, fmt)
    eager = op(*args(x, w, b, "silu", 0.01))
    with FakeTensorMode() as fake_mode:
        fake = op(*args(*(fake_mode.from_tensor(t) for t in (x, w, b)), "silu", 0.01))
    for e, f in zip(eager, fake):
        assert (f.shape, f.dtype, f.stride()) == (e.shape, e.dtype, e.stride())


def test_bad_activation_is_a_value_error_in_eager_and_fake_mode() -> None:
    x, w, b = problem("cpu", torch.float32, torch.contiguous_format)
    with pytest.raises(ValueError, match="expected `activation` to be one of") as eager:
        op(*args(x, w, b, "swish", 0.01))
    with FakeTensorMode() as fake_mode:
        with pytest.raises(ValueError) as faked:
            op(*args(*(fake_mode.from_tensor(t) for t in (x, w, b)), "swish", 0.01))
    assert str(faked.value).splitlines()[0] == str(eager.value).splitlines()[0]
    with pytest.raises(ValueError, match="finite number"):
        op(*args(x, w, b, "leaky_relu", float("nan")))


class OpRecorder(TorchDispatchMode):
    """The ops that run below autograd, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def grads_against_float64(device: str, key: str, mode_name: str, fmt: torch.memory_format) -> list[str]:
    """The layer's forward under autograd (recorded) and its gradients against float64 nn.Conv2d + the module;
    returns the ops the forward ran."""
    module, name, slope = {**KEEPING, **OTHERS}[key]
    mode = MODES[mode_name]
    x, w, b = problem(device, mode.dtype, fmt, seed=3)
    for t in (x, w, b):
        t.requires_grad_()
    with OpRecorder() as recorder:
        out = conv_bias2d(x, w, b, padding=1, activation=name, negative_slope=slope)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (x, w, b)]
    expected = module(F.conv2d(*leaves, padding=1))
    assert_close(out.detach().cpu().double(), expected.detach(), mode, f"{key} output")
    seed = torch.randn(expected.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grads = torch.autograd.grad(out, [x, w, b], seed.to(device, mode.dtype).contiguous(memory_format=fmt))
    want = torch.autograd.grad(expected, leaves, seed.to(mode.dtype).double())
    for what, got, ref in zip(("input", "weight", "bias"), grads, want):
        assert_close(got.cpu().double(), ref, mode, f"{key} grad {what}")
    return recorder.names


@pytest.mark.parametrize("fmt", LAYOUTS)
@pytest.mark.parametrize("mode_name", ["float64", "float32"])
@pytest.mark.parametrize("key", list(KEEPING))
def test_autograd_runs_the_op_once_and_gradients_match_on_cpu(
    key: str, mode_name: str, fmt: torch.memory_format
) -> None:
    """Under autograd these activations run one convbias._forward_with_preactivation call (no forward, no separate
    activation), and every gradient matches float64 nn.Conv2d + the activation module."""
    names = grads_against_float64("cpu", key, mode_name, fmt)
    assert names.count("convbias._forward_with_preactivation") == 1, names
    assert "convbias.forward" not in names, names


@pytest.mark.parametrize("key", ["relu", "leaky_relu", "tanh"])
def test_activations_differentiated_from_their_output_keep_forward(key: str) -> None:
    names = grads_against_float64("cpu", key, "float32", torch.channels_last)
    assert names.count("convbias.forward") == 1 and "convbias._forward_with_preactivation" not in names, names


def test_the_saved_tensor_is_the_ops_preactivation() -> None:
    """What the backward keeps is z as the op returned it (one tensor beyond input and weight), not the output."""
    x, w, b = problem("cpu", torch.float32, torch.channels_last)
    w.requires_grad_()
    b.requires_grad_()
    pointers: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        pointers.append(t.untyped_storage().data_ptr() if t.numel() else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.ops.convbias.forward(*args(x, w, b, "gelu", 0.01))
    assert len(pointers) == 3 and out.untyped_storage().data_ptr() not in pointers, pointers
    z = op(*args(x.detach(), w.detach(), b.detach(), "gelu", 0.01))[1]
    torch.testing.assert_close(F.gelu(z), out.detach(), rtol=0, atol=0)


def test_explain_for_backward_on_cpu() -> None:
    x, w, b = problem("cpu", torch.float32, torch.contiguous_format)
    plain = torch_convbias.explain(x, w, b, padding=1, activation="gelu")
    assert plain["activation"]["keeps_preactivation"] is False, plain
    kept = torch_convbias.explain(x, w, b, padding=1, activation="gelu", for_backward=True)
    assert kept["activation"]["keeps_preactivation"] is True and "both kept" in kept["activation"]["how"], kept
    relu = torch_convbias.explain(x, w, b, padding=1, activation="relu", for_backward=True)
    assert relu["activation"]["keeps_preactivation"] is False, relu


def test_compile_fullgraph_forward_and_backward() -> None:
    """torch.compile traces forward's autograd through the op's fake kernel: same output and gradients."""
    layer = torch_convbias.ConvBias2d(8, 16, 3, padding=1, activation="silu")
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 8, 7, 9)
    out = compiled(x)
    torch.testing.assert_close(out, layer(x))
    (gw,) = torch.autograd.grad(out.sum(), [layer.weight])
    (want,) = torch.autograd.grad(layer(x).sum(), [layer.weight])
    torch.testing.assert_close(gw, want)


def test_autocast_then_autograd_on_cpu() -> None:
    """Under autocast forward casts to bfloat16 first; its autograd then runs the op on the cast tensors."""
    x, w, b = problem("cpu", torch.float32, torch.channels_last)
    w.requires_grad_()
    b.requires_grad_()
    with OpRecorder() as recorder, torch.autocast("cpu", dtype=torch.bfloat16):
        out = conv_bias2d(x, w, b, padding=1, activation="gelu")
    assert out.dtype == torch.bfloat16 and recorder.names.count("convbias._forward_with_preactivation") == 1
    out.float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32 and b.grad is not None


# ---- CUDA (not yet run on a GPU) ----

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def cuda_problem(dtype: torch.dtype, hw: int, bias: bool = True, fmt: torch.memory_format = torch.channels_last) -> tuple:
    """Channel counts the fusion engines take (multiples of 8); `hw` picks a key of its own per test."""
    g = torch.Generator(device="cuda").manual_seed(hw)
    x = torch.randn(4, 32, hw, hw, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    w = (torch.randn(64, 32, 3, 3, device="cuda", generator=g) / 17).to(dtype).contiguous(memory_format=fmt)
    b = torch.randn(64, device="cuda", generator=g).to(dtype) if bias else None
    return x, w, b


def check_both(out: torch.Tensor, z: torch.Tensor, x, w, b, name: str, slope: float) -> None:  # type: ignore[no-untyped-def]
    """z against a float32 conv (TF32 off) + bias, out against the activation of that (not of z rounded: the graph's
    activation may read the FP32 sum)."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        z_ref = F.conv2d(x.float(), w.float(), None if b is None else b.float(), padding=1)
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    module = {**KEEPING, **OTHERS}[name if name != "leaky_relu" else "leaky_relu_negative"][0]
    if name == "leaky_relu":
        module = nn.LeakyReLU(slope)
    tolerance = TOLERANCE[out.dtype]
    for got, ref in ((z, z_ref), (out, module(z_ref))):
        scale = max(1.0, ref.abs().amax().item())
        assert got.dtype == x.dtype and got.is_contiguous(memory_format=torch.channels_last) == x.is_contiguous(
            memory_format=torch.channels_last
        )
        torch.testing.assert_close(got.float(), ref, rtol=tolerance, atol=tolerance * scale)
    assert out.untyped_storage().data_ptr() != z.untyped_storage().data_ptr()


def consistent(info: dict, name: str) -> None:
    """explain for_backward agrees with itself: the two-output graph ends with the epilogue node and writes both,
    otherwise the graph writes one tensor and ATen's pass runs the activation."""
    act = info["activation"]
    assert act["keeps_preactivation"] is True, info
    if act["fused"]:
        assert act["preactivation_output"] is True and info["graph_outputs"] == ["output", "preactivation"], info
        assert info["graph_ops"][-1].startswith(EPILOGUE_OP[name]) and "two output writes" in act["how"], info
    else:
        assert act["preactivation_output"] is False and info["graph_outputs"] in ([], ["output"]), info
        assert "both kept" in act["how"] and act["why"], act


@needs_cuda
@pytest.mark.parametrize("timed", [False, True], ids=["untimed", "benchmark"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("key", list(KEEPING))
def test_cuda_op_is_right_and_explain_says_which_graph_ran(key: str, dtype: torch.dtype, timed: bool) -> None:
    _, name, slope = KEEPING[key]
    x, w, b = cuda_problem(dtype, 15 + timed)
    saved = torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = timed, False
    try:
        out, z = op(*args(x, w, b, name, slope))
        info = torch_convbias.explain(x, w, b, padding=1, activation=name, negative_slope=slope, for_backward=True)
        plain = torch_convbias.explain(x, w, b, padding=1, activation=name, negative_slope=slope)
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = saved
    check_both(out, z, x, w, b, name, slope)
    consistent(info, name)
    # Its own plan: the key holds keep_preactivation, and the problem says so.
    assert "pre-activation kept" in info["problem"] and "pre-activation kept" not in plain["problem"], info
    assert plain["graph_outputs"] in ([], ["output"]) and plain["activation"]["keeps_preactivation"] is False, plain


TWO_OUTPUT_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, "tests")
from test_preactivation import KEEPING, args, check_both, cuda_problem
import torch_convbias
rows = {}
for i, (key, (_, name, slope)) in enumerate(KEEPING.items()):
    for bias in (True, False):
        x, w, b = cuda_problem(torch.float16, 10 + i, bias)
        out, z = torch.ops.convbias._forward_with_preactivation(*args(x, w, b, name, slope))
        check_both(out, z, x, w, b, name, slope)
        rows[f"{key}-{bias}"] = torch_convbias.explain(
            x, w, b, padding=1, activation=name, negative_slope=slope, for_backward=True)
print(json.dumps(rows))
"""


def run_script(code: str, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full = {**os.environ, "PYTHONPATH": path, **env}
    return subprocess.run([sys.executable, "-c", code], env=full, cwd=ROOT, capture_output=True, text=True, timeout=600)


@needs_cuda
def test_cuda_two_output_graph_builds_for_every_keeping_activation() -> None:
    """TORCH_CONVBIAS_ACTIVATION=fused (an error where cuDNN refuses the graph): one graph writing the pre-activation
    and the activation for gelu, gelu_tanh, silu and leaky_relu(-0.2), with and without bias, fp16 channels_last."""
    result = run_script(TWO_OUTPUT_SCRIPT, TORCH_CONVBIAS_ACTIVATION="fused")
    assert result.returncode == 0, result.stderr[-3000:]
    for row, info in json.loads(result.stdout.strip().splitlines()[-1]).items():
        assert info["activation"]["fused"] is True, (row, info)
        assert info["graph_outputs"] == ["output", "preactivation"], (row, info)
        assert info["path"] == ("fused" if row.endswith("True") else "conv"), (row, info)
        consistent(info, info["activation"]["name"])


@needs_cuda
def test_cuda_autograd_runs_the_op_once_and_gradients_match() -> None:
    for key in KEEPING:
        names = grads_against_float64("cuda", key, "tf32", torch.channels_last)
        assert names.count("convbias._forward_with_preactivation") == 1 and "convbias.forward" not in names, names


@needs_cuda
def test_cuda_rejected_two_output_graph_falls_back_to_the_graph_without_the_activation() -> None:
    x, w, b = cuda_problem(torch.float16, 17)
    try:
        torch.ops.convbias._inject_epilogue_rejections(1)
        out, z = op(*args(x, w, b, "gelu", 0.01))
    finally:
        torch.ops.convbias._inject_epilogue_rejections(0)
    info = torch_convbias.explain(x, w, b, padding=1, activation="gelu", for_backward=True)
    assert info["activation"]["fused"] is False and info["graph_ops"] == ["CONV_FPROP", "ADD"], info
    assert "writing the pre-activation too rejected" in info["activation"]["why"], info["activation"]
    consistent(info, "gelu")
    check_both(out, z, x, w, b, "gelu", 0.01)
    # The activation of the returned z, by our 16-bit pass after the graph: within one ulp of float64 gelu(z).
    assert_within_one_ulp(out, tail_accurate("gelu")(z.double()), "gelu(z) after the graph", max_mismatch=5e-3)


@needs_cuda
@pytest.mark.parametrize("timed", [False, True], ids=["untimed", "benchmark"])
def test_cuda_nchw_and_aten_routes(timed: bool) -> None:
    """NCHW tensors run conv + bias's own plan, then the activation; float64 runs ATen's convolution: both right,
    in NCHW."""
    x, w, b = cuda_problem(torch.float32, 14, fmt=torch.contiguous_format)
    saved = torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = timed, False
    try:
        out, z = op(*args(x, w, b, "silu", 0.01))
        info = torch_convbias.explain(x, w, b, padding=1, activation="silu", for_backward=True)
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = saved
    check_both(out, z, x, w, b, "silu", 0.01)
    assert info["activation"]["fused"] is False and info["activation"]["keeps_preactivation"] is True, info
    out64, z64 = op(*args(x.double(), w.double(), b.double(), "silu", 0.01))
    torch.testing.assert_close(out64, F.silu(z64))
    torch.testing.assert_close(z64, F.conv2d(x.double(), w.double(), b.double(), padding=1))


@needs_cuda
def test_cuda_opcheck() -> None:
    for fmt in (torch.channels_last, torch.contiguous_format):
        x, w, b = cuda_problem(torch.float16, 12, fmt=fmt)
        torch.library.opcheck(op.default, args(x, w, b, "gelu", 0.01))


@needs_cuda
def test_cuda_graph_capture_of_the_op() -> None:
    """During capture the plan is chosen untimed and nothing runs outside the captured work; replays are right."""
    x, w, b = cuda_problem(torch.float16, 21)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            out, z = op(*args(x, w, b, "silu", 0.01))
    torch.cuda.current_stream().wait_stream(stream)
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    check_both(out, z, x, w, b, "silu", 0.01)


STORE_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, "tests")
from test_preactivation import args, check_both, cuda_problem
import torch_convbias
rows = []
for i, (name, slope, dtype, bias) in enumerate([("gelu", 0.01, torch.float16, True), ("silu", 0.01, torch.bfloat16, False),
                                                 ("leaky_relu", -0.2, torch.float16, True)]):
    x, w, b = cuda_problem(dtype, 20 + i, bias)
    out, z = torch.ops.convbias._forward_with_preactivation(*args(x, w, b, name, slope))
    check_both(out, z, x, w, b, name, slope)
    info = torch_convbias.explain(x, w, b, padding=1, activation=name, negative_slope=slope, for_backward=True)
    rows.append({"fused": info["activation"]["fused"], "outputs": info["graph_outputs"], "ops": info["graph_ops"],
                 "engine": (info.get("engine") or {}).get("name"), "from_disk": (info.get("engine") or {}).get("from_disk")})
print(json.dumps({"cache": torch_convbias.cache_info(), "rows": rows}))
"""


@needs_cuda
def test_cuda_two_output_plans_are_stored_and_loaded(tmp_path: Path) -> None:
    """A timed two-output plan is written under its own key and the next process loads the same route, outputs,
    operations and engine (the stored graph checked to have the pre-activation tensor)."""
    env = {"TORCH_CONVBIAS_PLAN_CACHE_DIR": str(tmp_path), "TORCH_CONVBIAS_AUTOTUNE": "quick"}
    reports = []
    for _ in range(2):
        result = run_script(STORE_SCRIPT, **env)
        assert result.returncode == 0, result.stderr[-3000:]
        reports.append(json.loads(result.stdout.strip().splitlines()[-1]))
    built, loaded = reports
    assert built["cache"]["disk_writes"] >= 3 and built["cache"]["disk_rejected"] == 0, built["cache"]
    second = loaded["cache"]
    assert second["disk_hits"] >= 3 and second["disk_rejected"] == 0 and second["disk_writes"] == 0, second
    strip = lambda rows: [{k: v for k, v in r.items() if k != "from_disk"} for r in rows]  # noqa: E731
    assert strip(loaded["rows"]) == strip(built["rows"])
    assert all(r["from_disk"] in (True, None) for r in loaded["rows"]), loaded["rows"]
