"""convbias.forward_residual: act(conv + bias + residual), a residual block's ending, against float64 F.conv2d + the
residual + the activation module (an oracle that shares nothing with the op), on the CPU reference path and on CUDA
(the cuDNN graph conv -> residual ADD -> bias ADD -> activation where an engine runs it, else forward's route and one
pass); gradients of every input against autograd through the float64 oracle; bad residuals rejected by name."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, MODES, Mode, assert_close, cuda, math_mode
from test_activations import run_with_knobs
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_convbias
from torch_convbias import conv_bias2d

ACTIVATIONS = {
    "identity": lambda t: t,
    "relu": F.relu,
    "leaky_relu": lambda t: F.leaky_relu(t, 0.2),
    "gelu": F.gelu,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}


def problem(device: str, dtype: torch.dtype, layout: torch.memory_format, seed: int, bias: bool = True,
            residual_layout: torch.memory_format | None = None) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 8, 9, 9, generator=g)
    w = torch.randn(16, 8, 3, 3, generator=g) / 8
    b = torch.randn(16, generator=g) if bias else None
    r = torch.randn(2, 16, 9, 9, generator=g)

    def put(t: torch.Tensor | None, fmt: torch.memory_format) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=dtype).contiguous(memory_format=fmt)

    return (put(x, layout), put(w, layout), None if b is None else b.to(device=device, dtype=dtype),
            put(r, residual_layout or layout))


def oracle(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, r: torch.Tensor, name: str) -> torch.Tensor:
    """float64 on the CPU: F.conv2d + residual, then the activation."""
    d = torch.float64
    z = F.conv2d(x.cpu().to(d), w.cpu().to(d), None if b is None else b.cpu().to(d), padding=1) + r.cpu().to(d)
    return ACTIVATIONS[name](z)


def close(actual: torch.Tensor, expected: torch.Tensor, mode: Mode, what: str = "") -> None:
    assert_close(actual.cpu().double(), expected, mode, what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_forward_matches_conv_plus_residual_then_activation(device: str, mode_name: str, name: str) -> None:
    mode = MODES[mode_name]
    for i, (layout, bias, residual_layout) in enumerate([
        (torch.channels_last, True, None),
        (torch.contiguous_format, True, None),
        (torch.channels_last, False, torch.contiguous_format),  # the residual in another layout than the output
    ]):
        x, w, b, r = problem(device, mode.dtype, layout, seed=i, bias=bias, residual_layout=residual_layout)
        with math_mode(mode):
            out = conv_bias2d(x, w, b, padding=1, activation=name, negative_slope=0.2, residual=r)
        expected = oracle(x, w, b, r, name)
        close(out, expected, mode, f"{name} {layout} bias={bias}")
        assert out.dtype == mode.dtype and out.device.type == device
        # The output has F.conv2d's memory format (the residual's layout does not change it).
        assert out.stride() == F.conv2d(x, w, b, padding=1).stride()


def test_a_dropped_residual_fails_the_oracle() -> None:
    """The oracle sees the residual: the forward without it is far outside the tolerance."""
    x, w, b, r = problem("cpu", torch.float32, torch.channels_last, seed=3)
    with pytest.raises(AssertionError):
        close(conv_bias2d(x, w, b, padding=1, activation="relu"), oracle(x, w, b, r, "relu"), MODES["float32"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["identity", "relu", "gelu", "sigmoid"])
def test_gradients_of_every_input(device: str, name: str) -> None:
    """Input, weight, bias and residual gradients against autograd through the float64 oracle (relu and sigmoid from
    the output, gelu from the kept pre-activation)."""
    mode = MODES["float32"]
    x, w, b, r = problem(device, torch.float32, torch.channels_last, seed=5)
    leaves = [t.detach().requires_grad_() for t in (x, w, b, r)]
    leaves64 = [t.detach().cpu().double().requires_grad_() for t in (x, w, b, r)]
    seed = torch.randn(2, 16, 9, 9, dtype=torch.float64)
    with math_mode(mode):
        out = conv_bias2d(leaves[0], leaves[1], leaves[2], padding=1, activation=name, residual=leaves[3])
        out.backward(seed.to(device=device, dtype=torch.float32))
    oracle(*leaves64, name).backward(seed)
    for what, got, want in zip(("input", "weight", "bias", "residual"), leaves, leaves64):
        assert got.grad is not None, what
        close(got.grad, want.grad, mode, what)


def test_only_what_needs_a_gradient_gets_one() -> None:
    x, w, b, r = problem("cpu", torch.float32, torch.channels_last, seed=6)
    r = r.detach().requires_grad_()
    w = w.detach().requires_grad_()
    conv_bias2d(x, w, b, padding=1, activation="relu", residual=r).sum().backward()
    assert r.grad is not None and w.grad is not None and x.grad is None and b.grad is None
    # The residual's gradient is the gradient at the sum: relu'(z) here.
    expected = (oracle(x, w, b, r.detach(), "relu") > 0).float()
    torch.testing.assert_close(r.grad, expected)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
def test_bad_residual_is_rejected_by_name(fake: bool) -> None:
    x, w, b, r = problem("cpu", torch.float32, torch.channels_last, seed=7)
    cases = [
        (r[:, :8], ValueError, r"convbias.forward_residual: expected `residual` of shape \[2, 16, 9, 9\]"),
        (r.double(), TypeError, r"convbias.forward_residual: expected `residual` to have the dtype of `input`"),
        (r.unsqueeze(0), ValueError, r"expected `residual` of shape"),
    ]
    op = torch.ops.convbias.forward_residual
    for bad, error, message in cases:
        args = [x, w, b, bad]
        if fake:
            with FakeTensorMode(allow_non_fake_inputs=False) as mode:
                args = [mode.from_tensor(t) for t in args]
                with pytest.raises(error, match=message):
                    op(*args, [1, 1], [1, 1], [1, 1], 1, "relu")
        else:
            with pytest.raises(error, match=message):
                op(*args, [1, 1], [1, 1], [1, 1], 1, "relu")
    with pytest.raises(ValueError, match="expected `activation` to be one of"):
        op(x, w, b, r, [1, 1], [1, 1], [1, 1], 1, "swish")
    with pytest.raises(TypeError, match="expected `residual` to be a tensor or None"):
        conv_bias2d(x, w, b, padding=1, residual=1.0)  # type: ignore[arg-type]


def test_opcheck_compile_and_unbatched() -> None:
    x, w, b, r = problem("cpu", torch.float32, torch.channels_last, seed=8)
    args = (x, w, b, r.detach().requires_grad_(), [1, 1], [1, 1], [1, 1], 1, "relu", 0.01)
    torch.library.opcheck(torch.ops.convbias.forward_residual, args)

    def block(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return conv_bias2d(x, w, b, padding=1, activation="relu", residual=r)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, r), block(x, r))
    single = conv_bias2d(x[0], w, b, padding=1, activation="relu", residual=r[0])
    torch.testing.assert_close(single, block(x, r)[0])


def test_autocast_on_the_cpu_casts_every_input() -> None:
    x, w, b, r = problem("cpu", torch.float32, torch.channels_last, seed=9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = conv_bias2d(x, w, b, padding=1, activation="relu", residual=r)
    assert out.dtype == torch.bfloat16
    close(out, oracle(x, w, b, r, "relu"), MODES["bfloat16"])


def test_explain_on_the_cpu_says_aten() -> None:
    x, w, b, r = problem("cpu", torch.float32, torch.channels_last, seed=10)
    info = torch_convbias.explain(x, w, b, padding=1, activation="relu", residual=r)
    assert info["path"] == "aten" and info["residual"]["fused"] is False, info
    assert info["residual"]["bias_in_pass"] is False, info
    with pytest.raises(ValueError, match="for_backward"):
        torch_convbias.explain(x, w, b, padding=1, residual=r, for_backward=True)


# ------------------------------------------------------------------------------------------------------------------
# CUDA: the residual's graph


def cuda_problem(dtype: torch.dtype, hw: int, seed: int, bias: bool = True) -> tuple:
    """channels_last, channel counts the fusion engines take; `hw` gives each test its own plan key."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cl = torch.channels_last
    x = torch.randn(4, 32, hw, hw, device="cuda", generator=g).to(dtype).contiguous(memory_format=cl)
    w = (torch.randn(64, 32, 3, 3, device="cuda", generator=g) / 17).to(dtype).contiguous(memory_format=cl)
    b = torch.randn(64, device="cuda", generator=g).to(dtype) if bias else None
    r = torch.randn(4, 64, hw, hw, device="cuda", generator=g).to(dtype).contiguous(memory_format=cl)
    return x, w, b, r


def check_consistent(info: dict, name: str, bias: bool) -> None:
    """explain agrees with the route it reports: the graph's operations when the residual is fused, else why not."""
    residual = info["residual"]
    if residual["fused"]:
        last = {"identity": [], "relu": ["RELU_FWD"], "gelu": ["GELU_FWD"]}[name]
        assert info["graph_ops"] == ["CONV_FPROP", "ADD", *(["ADD"] if bias else []), *last], info
        nodes = ["conv", "residual add", *(["bias add"] if bias else []), *last]
        assert residual["how"].startswith("in the cuDNN graph: " + " -> ".join(nodes) + ","), info
    else:
        assert "one pass after forward's route" in residual["how"] and residual["why"], info


@cuda
@pytest.mark.parametrize("timed", [False, True], ids=["untimed", "benchmark"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_cuda_right_and_explained_by_either_route(dtype: torch.dtype, timed: bool) -> None:
    mode = {torch.float32: MODES["float32"], torch.float16: MODES["float16"], torch.bfloat16: MODES["bfloat16"]}[dtype]
    x, w, b, r = cuda_problem(dtype, 11 + timed, seed=1)
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = timed
    try:
        with math_mode(mode):
            out = conv_bias2d(x, w, b, padding=1, activation="relu", residual=r)
            info = torch_convbias.explain(x, w, b, padding=1, activation="relu", residual=r)
    finally:
        torch.backends.cudnn.benchmark = saved
    check_consistent(info, "relu", bias=True)
    if timed and info["residual"]["fused"] and info["residual"]["graph_ms"] > 0:
        assert info["residual"]["separate_ms"] > 0, info
    close(out, oracle(x, w, b, r, "relu"), mode)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_untimed_residual_graph_runs_on_a_precompiled_engine(dtype: torch.dtype) -> None:
    """The residual added right after the convolution, then the bias, then relu (cudnnConvolutionBiasActivationForward's
    order, as in ATen's fused graph) is the pattern cuDNN's precompiled conv+add+bias+activation engines take: untimed
    (runtime-compiled engines are not built then) the residual is in the graph on a precompiled engine. With the bias
    added first no precompiled engine built it, and the residual took forward's route and a pass (before e050867)."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("cuDNN's precompiled fused convolution engines need sm80 or later")
    mode = MODES["float16" if dtype == torch.float16 else "bfloat16"]
    x, w, b, r = cuda_problem(dtype, 29, seed=31)
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        out = conv_bias2d(x, w, b, padding=1, activation="relu", residual=r)
        info = torch_convbias.explain(x, w, b, padding=1, activation="relu", residual=r)
    finally:
        torch.backends.cudnn.benchmark = saved
    assert info["residual"]["fused"] is True and info["engine"]["runtime_compiled"] is False, info
    check_consistent(info, "relu", bias=True)
    close(out, oracle(x, w, b, r, "relu"), mode)


FORCED_SCRIPT = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_residual import cuda_problem, oracle, close
from conftest import MODES
import torch_convbias
rows = {}
for i, (name, bias) in enumerate([("relu", True), ("identity", True), ("gelu", True), ("relu", False)]):
    x, w, b, r = cuda_problem(torch.float16, 13 + i, seed=20 + i, bias=bias)
    out = torch_convbias.conv_bias2d(x, w, b, padding=1, activation=name, residual=r)
    close(out, oracle(x, w, b, r, name), MODES["float16"])
    rows[f"{name}-{bias}"] = torch_convbias.explain(x, w, b, padding=1, activation=name, residual=r)
print(json.dumps(rows))
"""


@cuda
def test_cuda_forced_graph_adds_the_residual_in_the_graph() -> None:
    """TORCH_CONVBIAS_PATH=fused (runtime-compiled engines allowed; an error where cuDNN refuses): one graph conv ->
    residual ADD -> [bias ADD] -> [activation], right, fp16 channels_last."""
    result = run_with_knobs(FORCED_SCRIPT, TORCH_CONVBIAS_PATH="fused")
    assert result.returncode == 0, result.stderr[-3000:]
    for row, info in json.loads(result.stdout.strip().splitlines()[-1]).items():
        name, bias = row.split("-")
        assert info["residual"]["fused"] is True, (row, info)
        check_consistent(info, name, bias == "True")
        assert info["path"] == ("fused" if bias == "True" else "conv"), (row, info)


@cuda
def test_cuda_refused_residual_graph_takes_forwards_route() -> None:
    """cuDNN refusing the residual's graph (the test hook refuses it as cuDNN would): forward's route, then one pass
    adding the residual and applying the activation; the same result, and explain says which graph was refused."""
    x, w, b, r = cuda_problem(torch.float16, 19, seed=5)
    try:
        torch.ops.convbias._inject_epilogue_rejections(1)
        out = conv_bias2d(x, w, b, padding=1, activation="relu", residual=r)
    finally:
        torch.ops.convbias._inject_epilogue_rejections(0)
    info = torch_convbias.explain(x, w, b, padding=1, activation="relu", residual=r)  # the plan the call made (cached)
    residual = info["residual"]
    assert residual["fused"] is False and "rejected" in residual["why"] and "test hook" in residual["why"], residual
    check_consistent(info, "relu", bias=True)
    close(out, oracle(x, w, b, r, "relu"), MODES["float16"])


REFUSED_WHEN_FORCED_SCRIPT = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_residual import cuda_problem, oracle, close
from conftest import MODES
import torch_convbias
x, w, b, r = cuda_problem(torch.float16, 21, seed=7)
torch.ops.convbias._inject_epilogue_rejections(1)
try:
    torch_convbias.conv_bias2d(x, w, b, padding=1, activation="relu", residual=r)
    refused = None
except RuntimeError as error:
    refused = str(error)
# The refusal is not cached: the next call builds the graph.
out = torch_convbias.conv_bias2d(x, w, b, padding=1, activation="relu", residual=r)
close(out, oracle(x, w, b, r, "relu"), MODES["float16"])
info = torch_convbias.explain(x, w, b, padding=1, activation="relu", residual=r)
print(json.dumps({"refused": refused, "info": info}))
"""


@cuda
def test_cuda_forced_graph_refused_raises_saying_why() -> None:
    """TORCH_CONVBIAS_PATH=fused where cuDNN refuses the residual's graph: an error naming the knob, the graph and
    cuDNN's reason, never a silent fallback; once cuDNN accepts it again, the graph runs."""
    result = run_with_knobs(REFUSED_WHEN_FORCED_SCRIPT, TORCH_CONVBIAS_PATH="fused")
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(result.stdout.strip().splitlines()[-1])
    refused = row["refused"]
    assert refused is not None, row
    assert "TORCH_CONVBIAS_PATH=fused but cuDNN rejected the" in refused and "test hook" in refused, refused
    assert row["info"]["residual"]["fused"] is True, row["info"]


@cuda
def test_cuda_nchw_and_unfused_knob_take_forwards_route() -> None:
    x, w, b, r = cuda_problem(torch.float16, 15, seed=3)
    x, w, r = x.contiguous(), w.contiguous(), r.contiguous()
    out = conv_bias2d(x, w, b, padding=1, activation="relu", residual=r)
    info = torch_convbias.explain(x, w, b, padding=1, activation="relu", residual=r)
    assert info["residual"]["fused"] is False and "NCHW" in info["residual"]["why"], info
    assert out.is_contiguous()
    close(out, oracle(x, w, b, r, "relu"), MODES["float16"])
    result = run_with_knobs(FORCED_SCRIPT, TORCH_CONVBIAS_PATH="unfused")
    assert result.returncode == 0, result.stderr[-3000:]
    for row, info in json.loads(result.stdout.strip().splitlines()[-1]).items():
        assert info["residual"]["fused"] is False and "TORCH_CONVBIAS_PATH=unfused" in info["residual"]["why"], info


@cuda
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize(
    "dtype, name, residual_layout",
    [(torch.float32, "relu", torch.channels_last), (torch.bfloat16, "gelu", torch.contiguous_format)],
    ids=["fp32-relu", "bf16-gelu-nchw_residual"],
)
def test_cuda_aten_route_adds_bias_and_residual_in_one_pass(
    dtype: torch.dtype, name: str, residual_layout: torch.memory_format, bias: bool
) -> None:
    """Where the residual's graph is not taken and forward's own route is ATen's convolution (cudnn.benchmark; the test
    hooks refuse the residual's graph and make ATen's convolution measure faster), the convolution runs without its
    bias and one pass adds the bias and the residual and applies the activation: one kernel of ours after the
    convolution, no ATen add. Right against the float64 oracle; explain says so (bias_in_pass)."""
    mode = MODES["float32"] if dtype == torch.float32 else MODES["bfloat16"]
    hw = 25 + 2 * (dtype == torch.bfloat16) + bias  # a plan key of its own
    x, w, b, r = cuda_problem(dtype, hw, seed=30 + hw, bias=bias)
    r = r.contiguous(memory_format=residual_layout)
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        with math_mode(mode):
            torch.ops.convbias._inject_epilogue_rejections(1)  # the residual's graph, built first
            torch.ops.convbias._inject_aten_preferences(1)  # then forward's own plan for conv + bias
            conv_bias2d(x, w, b, padding=1, activation=name, residual=r)  # builds both plans
            torch.ops.convbias._inject_epilogue_rejections(0)
            torch.ops.convbias._inject_aten_preferences(0)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                out = conv_bias2d(x, w, b, padding=1, activation=name, residual=r)
                torch.cuda.synchronize()
            info = torch_convbias.explain(x, w, b, padding=1, activation=name, residual=r)  # the cached plans
    finally:
        torch.ops.convbias._inject_epilogue_rejections(0)
        torch.ops.convbias._inject_aten_preferences(0)
        torch.backends.cudnn.benchmark = saved
    residual = info["residual"]
    assert info["path"] == "aten" and residual["fused"] is False and "test hook" in residual["why"], info
    assert residual["bias_in_pass"] is bias, info
    check_consistent(info, name, bias)
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ours = [k for k in kernels if "AddTwoActivation" in k or "AddActivation" in k]
    assert len(ours) == 1 and ("AddTwoActivation" in ours[0]) is bias, kernels
    assert not any("CUDAFunctor_add" in k or "add_kernel" in k for k in kernels), kernels
    assert out.is_contiguous(memory_format=torch.channels_last)
    close(out, oracle(x, w, b, r, name), mode)


@cuda
def test_cuda_residual_plan_measures_aten_without_the_bias_against_a_graph_route() -> None:
    """Timed, where the residual's graph is not taken and forward's own route for conv + bias is a cuDNN graph, the
    residual's plan also measures ATen's convolution without the bias + one pass adding the bias and the residual
    (Inductor's block ending) and takes it where faster (the test hook makes it win here): the call then runs it (one
    kernel of ours after the convolution, no ATen add), explain says so, and the result is right."""
    mode = MODES["bfloat16"]
    x, w, b, r = cuda_problem(torch.bfloat16, 31, seed=61)
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        with math_mode(mode):
            conv_bias2d(x, w, b, padding=1)  # forward's own plan for conv + bias, timed, untouched by the hooks
            own = torch_convbias.explain(x, w, b, padding=1)
            torch.ops.convbias._inject_epilogue_rejections(1)  # the residual's graph
            torch.ops.convbias._inject_aten_preferences(1)  # then the residual plan's measurement of the two passes
            conv_bias2d(x, w, b, padding=1, activation="relu", residual=r)  # builds the residual's plan
            torch.ops.convbias._inject_epilogue_rejections(0)
            torch.ops.convbias._inject_aten_preferences(0)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                out = conv_bias2d(x, w, b, padding=1, activation="relu", residual=r)
                torch.cuda.synchronize()
            info = torch_convbias.explain(x, w, b, padding=1, activation="relu", residual=r)
    finally:
        torch.ops.convbias._inject_epilogue_rejections(0)
        torch.ops.convbias._inject_aten_preferences(0)
        torch.backends.cudnn.benchmark = saved
    assert own["path"] != "aten", own  # what this test is about: forward's own route is a graph
    residual = info["residual"]
    assert info["path"] == "aten" and info["graph_ops"] == [] and "engine" not in info, info
    assert residual["fused"] is False and residual["bias_in_pass"] is True, info
    assert "taken by the test hook" in residual["why"] and "adding the bias and the residual" in residual["why"], info
    check_consistent(info, "relu", True)
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ours = [k for k in kernels if "AddTwoActivation" in k or "AddActivation" in k]
    assert len(ours) == 1 and "AddTwoActivation" in ours[0], kernels
    assert not any("CUDAFunctor_add" in k or "add_kernel" in k for k in kernels), kernels
    assert out.is_contiguous(memory_format=torch.channels_last)
    close(out, oracle(x, w, b, r, "relu"), mode)


RUNTIME_COMPILATION_SCRIPT = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_residual import cuda_problem, oracle, close
from conftest import MODES
import torch_convbias
x, w, b, r = cuda_problem(torch.bfloat16, 23, seed=71)
out = torch_convbias.conv_bias2d(x, w, b, padding=1, activation="relu", residual=r)
close(out, oracle(x, w, b, r, "relu"), MODES["bfloat16"])
print(json.dumps(torch_convbias.explain(x, w, b, padding=1, activation="relu", residual=r)))
"""


@cuda
def test_cuda_runtime_compilation_timed_times_nvrtc_engines_beside_precompiled_ones() -> None:
    """TORCH_CONVBIAS_RUNTIME_COMPILATION=timed: a timed choice (AUTOTUNE=on) of the residual's graph also builds and
    times the runtime-compiled engines heuristics offer, beside the same precompiled ones the default (fallback: only
    where no precompiled engine builds) times; the fastest of all is kept; `off` builds none of them; the result is
    right each way."""
    engines = {}
    for mode in ("fallback", "timed", "off"):
        result = run_with_knobs(
            RUNTIME_COMPILATION_SCRIPT, TORCH_CONVBIAS_PATH="fused", TORCH_CONVBIAS_AUTOTUNE="on",
            TORCH_CONVBIAS_RUNTIME_COMPILATION=mode,
        )
        if mode == "off" and result.returncode != 0:
            # No precompiled engine builds this graph: forced, it is refused, saying why (checked below).
            assert "TORCH_CONVBIAS_PATH=fused but cuDNN rejected the" in result.stderr, result.stderr[-3000:]
            engines[mode] = None
            continue
        assert result.returncode == 0, result.stderr[-3000:]
        info = json.loads(result.stdout.strip().splitlines()[-1])
        assert info["residual"]["fused"] is True, info
        engines[mode] = info["engine"]
    fallback, timed = engines["fallback"], engines["timed"]
    precompiled = fallback["built"] - fallback["runtime_compiled_built"]
    if precompiled > 0:
        assert fallback["runtime_compiled_built"] == 0, fallback
    assert timed["runtime_compiled_built"] > 0, timed
    assert timed["built"] - timed["runtime_compiled_built"] == precompiled, (fallback, timed)
    assert len(timed["timings"]) > len(fallback["timings"]) or precompiled == 0, (fallback, timed)
    assert timed["measured_ms"] == min(ms for _, ms in timed["timings"]), timed
    off = engines["off"]
    assert (off is None) == (precompiled == 0), (fallback, off)
    assert off is None or (off["runtime_compiled_built"] == 0 and off["built"] == precompiled), off


@cuda
def test_cuda_graph_capture() -> None:
    mode = MODES["float32"]
    x, w, b, r = cuda_problem(torch.float32, 17, seed=4)
    with math_mode(mode):
        expected = conv_bias2d(x, w, b, padding=1, activation="relu", residual=r)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            conv_bias2d(x, w, b, padding=1, activation="relu", residual=r)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = conv_bias2d(x, w, b, padding=1, activation="relu", residual=r)
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(captured, expected)


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_module_takes_a_residual(padding_mode: str) -> None:
    """ConvBias2d(..., activation=...)(x, residual=r) is the block ending; without it the module is nn.Conv2d's."""
    torch.manual_seed(11)
    conv = torch.nn.Conv2d(8, 16, 3, padding=1, padding_mode=padding_mode)
    module = torch_convbias.ConvBias2d.from_conv(conv, activation="relu")
    x, r = torch.randn(2, 8, 9, 9), torch.randn(2, 16, 9, 9)
    with torch.no_grad():
        expected = F.relu(conv(x) + r)
        torch.testing.assert_close(module(x, residual=r), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(module(x), F.relu(conv(x)), rtol=1e-5, atol=1e-5)
