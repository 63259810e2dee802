"""The matmul way (csrc/cuda/fprop.cpp: matmul_fits, run_aten's as_matmul): a channels_last float32 1x1 convolution at
stride 1 runs as one cuBLAS matrix multiply (bias and ReLU in its epilogue) where, under cudnn.benchmark, that measured
faster than the cuDNN graph and ATen's convolution (strict fp32 ResNet-50's 1x1 layers: cuDNN transposes to NCHW and
back). The test hook makes the choice; each case equals F.conv2d in float64 (and its gradients, autograd's), explain()
says how it ran, and torch's flags keep their meaning: a strict-fp32 convolution never runs as a TF32 GEMM, not even
from a plan chosen before cuBLAS's TF32 flag was turned on, and deterministic algorithms never take the way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import MODES, assert_close, cuda, run_script_with_knobs

import torch_convbias
from torch_convbias.functional import conv_bias2d

pytestmark = cuda

ACTIVATIONS = {"identity": lambda t: t, "relu": F.relu, "gelu": F.gelu}


@pytest.fixture
def strict_benchmark() -> Iterator[None]:
    """cudnn.benchmark on (timed choices), TF32 off for convolutions and matmuls, an empty plan cache, no hook left."""
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
             torch.are_deterministic_algorithms_enabled())  # fmt: skip
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.ops.convbias._plan_cache_clear()
    try:
        yield
    finally:
        torch.ops.convbias._inject_matmul_preferences(0)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[:3]
        torch.use_deterministic_algorithms(saved[3])
        torch.ops.convbias._plan_cache_clear()


def problem(n: int, c: int, hw: int, k: int, seed: int, kernel: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    cl = torch.channels_last
    x = torch.randn(n, c, hw, hw + 1, device="cuda", generator=g).contiguous(memory_format=cl)
    w = torch.randn(k, c, kernel, kernel, device="cuda", generator=g) / (c * kernel * kernel) ** 0.5
    w = w.contiguous(memory_format=cl)
    b = torch.randn(k, device="cuda", generator=g)
    return x, w, b


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, activation: str, **conv) -> torch.Tensor:
    return ACTIVATIONS[activation](F.conv2d(x.double(), w.double(), None if b is None else b.double(), **conv))


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_matmul_way_equals_conv2d_with_its_gradients(strict_benchmark: None, activation: str, with_bias: bool) -> None:
    """Inference through the way (explain says so), then a training step: the same plan but for gelu, whose derivative
    keeps the pre-activation (a key the way does not fit); output and every gradient against float64 autograd."""
    x, w, b = problem(3, 24, 9, 40, seed=len(activation) * 2 + with_bias)
    bias = b if with_bias else None
    torch.ops.convbias._inject_matmul_preferences(1)
    with torch.no_grad():
        out = conv_bias2d(x, w, bias, activation=activation)
    torch.ops.convbias._inject_matmul_preferences(0)
    info = torch_convbias.explain(x, w, bias, activation=activation)  # the plan the call made (cached)
    assert info["path"] == "aten" and info["matmul"] is True, info
    assert any("_inject_matmul_preferences" in note for note in info["notes"]), info["notes"]
    if activation == "relu" and with_bias:
        assert info["activation"]["how"] == "in cuBLAS's epilogue: matmul -> bias add -> relu", info["activation"]
    elif activation != "identity":
        assert info["activation"]["how"].endswith("over the matmul's output"), info["activation"]
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out.double(), reference(x, w, bias, activation), MODES["float32"], "output")

    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    out = conv_bias2d(leaves[0], leaves[1], leaves[2] if with_bias else None, activation=activation)
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want = reference(*ref_leaves[:2], ref_leaves[2] if with_bias else None, activation)
    assert_close(out.double(), want, MODES["float32"], "output under autograd")
    dy = torch.randn_like(out)
    out.backward(dy)
    want.backward(dy.double())
    for got, ref, name in zip(leaves, ref_leaves, ("input", "weight", "bias")):
        if name != "bias" or with_bias:
            assert_close(got.grad.double(), ref.grad, MODES["float32"], f"{name} gradient")


def test_residual_ending_runs_the_matmul_way_then_the_add(strict_benchmark: None) -> None:
    """A residual problem whose forward route is the matmul way: the product, then the residual add and ReLU."""
    x, w, b = problem(2, 16, 7, 32, seed=11)
    z = torch.randn(2, 32, 7, 8, device="cuda").contiguous(memory_format=torch.channels_last)
    torch.ops.convbias._inject_matmul_preferences(1)
    out = conv_bias2d(x, w, b, activation="relu", residual=z)
    torch.ops.convbias._inject_matmul_preferences(0)
    assert_close(out.double(), F.relu(F.conv2d(x.double(), w.double(), b.double()) + z.double()), MODES["float32"], "output")
    forward_route = torch_convbias.explain(x, w, b)  # the route the residual problem's ATen path runs
    residual = torch_convbias.explain(x, w, b, activation="relu", residual=z)
    assert residual["residual"]["fused"] is True or forward_route["matmul"] is True, (residual, forward_route)


def test_residual_plan_may_take_atens_convolution_without_the_bias_over_the_matmul_way(strict_benchmark: None) -> None:
    """Where forward's own route is the matmul way and the residual's graph is not taken, the residual's plan also
    measures ATen's convolution without the bias + one pass adding the bias and the residual; when that wins (the test
    hook here) the call runs it and explain() no longer reports the matmul way, which that call does not run."""
    x, w, b = problem(2, 16, 7, 32, seed=13)
    z = torch.randn(2, 32, 7, 8, device="cuda").contiguous(memory_format=torch.channels_last)
    torch.ops.convbias._inject_matmul_preferences(1)
    conv_bias2d(x, w, b)  # forward's own plan for conv + bias: the matmul way
    torch.ops.convbias._inject_matmul_preferences(0)
    assert torch_convbias.explain(x, w, b)["matmul"] is True
    try:
        torch.ops.convbias._inject_epilogue_rejections(1)  # the residual's graph
        torch.ops.convbias._inject_aten_preferences(1)  # then the residual plan's measurement of the two passes
        out = conv_bias2d(x, w, b, activation="relu", residual=z)
    finally:
        torch.ops.convbias._inject_epilogue_rejections(0)
        torch.ops.convbias._inject_aten_preferences(0)
    info = torch_convbias.explain(x, w, b, activation="relu", residual=z)
    assert info["residual"]["fused"] is False and info["residual"]["bias_in_pass"] is True, info
    assert info["path"] == "aten" and info["matmul"] is False and "engine" not in info, info
    assert "taken by the test hook" in info["residual"]["why"], info
    want = F.relu(F.conv2d(x.double(), w.double(), b.double()) + z.double())
    assert_close(out.double(), want, MODES["float32"], "output")


def test_matmul_way_is_measured_only_where_it_fits(strict_benchmark: None) -> None:
    """Timed: a 1x1 stride-1 problem measures the way beside the graph and ATen (and takes it only if fastest); a 3x3
    one, a strided 1x1, a bfloat16 1x1 and NCHW tensors (run by a way's channels_last copies) never measure it, even
    with the hook armed."""
    x, w, b = problem(8, 64, 14, 64, seed=21)
    conv_bias2d(x, w, b, activation="relu")
    info = torch_convbias.explain(x, w, b, activation="relu")
    if info["path"] == "aten" and info["matmul"]:
        assert info["matmul_ms"] < min(info["graph_ms"], info["aten_ms"]), info
    else:  # the graph or ATen's convolution, chosen after the three were measured
        assert info["matmul_ms"] > 0 and info["graph_ms"] > 0, info
    x3, w3, b3 = problem(8, 64, 14, 64, seed=22, kernel=3)
    cases = [((x3, w3, b3), {"padding": 1}), ((x, w, b), {"stride": 2}),
             (tuple(t.bfloat16() for t in (x, w, b)), {}), ((x.contiguous(), w.contiguous(), b), {})]  # fmt: skip
    for args, conv in cases:
        torch.ops.convbias._inject_matmul_preferences(1)
        out = conv_bias2d(*args, activation="relu", **conv)
        torch.ops.convbias._inject_matmul_preferences(0)
        want = reference(*args, "relu", **conv)
        assert_close(out.double(), want, MODES["float32" if args[0].dtype == torch.float32 else "bfloat16"], str(conv))
        other = torch_convbias.explain(*args, activation="relu", **conv)
        assert other["matmul"] is False and other["matmul_ms"] == -1, other


def test_strict_fp32_never_runs_as_a_tf32_gemm(strict_benchmark: None) -> None:
    """Strict-fp32 convolutions with cuBLAS's TF32 allowed: the hook cannot take the way, and a plan that took it before
    the flag was turned on runs ATen's convolution instead: the output keeps strict fp32's accuracy (TF32's ~1e-3
    errors fail float32's tolerance)."""
    x, w, b = problem(4, 256, 12, 96, seed=31)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.ops.convbias._inject_matmul_preferences(1)
    conv_bias2d(x, w, b)
    assert torch_convbias.explain(x, w, b)["matmul"] is False
    torch.ops.convbias._inject_matmul_preferences(0)

    x, w, b = problem(4, 256, 12, 96, seed=32)
    x = x[:, :, :11]  # another key
    x = x.contiguous(memory_format=torch.channels_last)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.ops.convbias._inject_matmul_preferences(1)
    conv_bias2d(x, w, b)
    assert torch_convbias.explain(x, w, b)["matmul"] is True
    torch.backends.cuda.matmul.allow_tf32 = True
    out = conv_bias2d(x, w, b)  # the cached plan says matmul; the flags now forbid it
    assert_close(out.double(), F.conv2d(x.double(), w.double(), b.double()), MODES["float32"], "output")
    # The check above can fail: the same product as a TF32 GEMM misses float32's tolerance.
    tf32 = torch.addmm(b, x.permute(0, 2, 3, 1).reshape(-1, 256), w.reshape(96, 256).t())
    with pytest.raises(AssertionError):
        want = F.conv2d(x.double(), w.double(), b.double()).permute(0, 2, 3, 1).reshape(-1, 96)
        assert_close(tf32.double(), want, MODES["float32"], "TF32 GEMM")


def test_deterministic_algorithms_never_take_the_way(strict_benchmark: None) -> None:
    x, w, b = problem(2, 32, 6, 16, seed=41)
    torch.use_deterministic_algorithms(True)
    torch.ops.convbias._inject_matmul_preferences(1)
    out = conv_bias2d(x, w, b)
    info = torch_convbias.explain(x, w, b)
    assert info["matmul"] is False and info["matmul_ms"] == -1, info
    assert_close(out.double(), F.conv2d(x.double(), w.double(), b.double()), MODES["float32"], "output")


STORE_SCRIPT = r"""
import json, sys, torch, torch_convbias
from torch_convbias.functional import conv_bias2d
torch.backends.cudnn.benchmark = True
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
g = torch.Generator(device="cuda").manual_seed(51)
cl = torch.channels_last
x = torch.randn(2, 32, 6, 7, device="cuda", generator=g).contiguous(memory_format=cl)
w = (torch.randn(48, 32, 1, 1, device="cuda", generator=g) / 32**0.5).contiguous(memory_format=cl)
b = torch.randn(48, device="cuda", generator=g)
torch.ops.convbias._inject_matmul_preferences(int(sys.argv[1]))
y = conv_bias2d(x, w, b, activation="relu")
torch.ops.convbias._inject_matmul_preferences(0)
info = torch_convbias.explain(x, w, b, activation="relu")
error = (y.double() - torch.relu(torch.nn.functional.conv2d(x.double(), w.double(), b.double()))).abs().max().item()
print(json.dumps({"matmul": info["matmul"], "notes": info["notes"], "error": error}))
"""


def test_the_way_survives_the_persistent_plan_cache(tmp_path: Path) -> None:
    """A process that took the way stores it; the next one (no hook) loads and runs it."""
    first = run_script_with_knobs(STORE_SCRIPT, "1", plan_cache_dir=str(tmp_path))
    again = run_script_with_knobs(STORE_SCRIPT, "0", plan_cache_dir=str(tmp_path))
    assert first["matmul"] is True and again["matmul"] is True, (first, again)
    assert "loaded from the persistent plan cache" in again["notes"], again["notes"]
    assert first["error"] < 1e-4 and again["error"] < 1e-4, (first, again)
