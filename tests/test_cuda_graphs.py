"""The cuDNN graph forward on the GPU: the path each case takes, the plan cache, TF32 and determinism flags,
alignment, CUDA graph capture, threads, and the environment knobs."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA

import torch_convbias
from torch_convbias import conv_bias2d

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[1]


def make(n, c, h, w, k, r=3, dtype=torch.float32, channels_last=True, bias=True, seed=0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(n, c, h, w, generator=g).to("cuda", dtype).contiguous(memory_format=fmt)
    wt = (torch.randn(k, c, r, r, generator=g) / (c * r * r) ** 0.5).to("cuda", dtype).contiguous(memory_format=fmt)
    b = torch.randn(k, generator=g).to("cuda", dtype) if bias else None
    return x, wt, b


def test_seed_case_nchw_fp32_runs_fused_and_explains() -> None:
    """The case this project started from: N=C=H=W=K=16, 3x3, pad 1, FP32, NCHW. With cudnn.benchmark off (the
    default: nothing timed) it runs the fused graph over the NCHW strides; under benchmark the three ways of running
    NCHW tensors are measured once and the fastest kept."""
    x, w, b = make(16, 16, 16, 16, 16, channels_last=False)
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.allow_tf32 = False
    try:
        torch.backends.cudnn.benchmark = False
        out = conv_bias2d(x, w, b, padding=1)
        info = torch_convbias.explain(x, w, b, padding=1)
        torch.backends.cudnn.benchmark = True
        timed_out = conv_bias2d(x, w, b, padding=1)
        timed_info = torch_convbias.explain(x, w, b, padding=1)
    finally:
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = saved
    reference = F.conv2d(x.double(), w.double(), b.double(), padding=1)
    for y in (out, timed_out):
        torch.testing.assert_close(y.double(), reference, rtol=1e-4, atol=1e-4)
        assert y.is_contiguous()
    assert info["output"] == "NCHW" and info["converted_input"] is False
    assert info["path"] == "fused" and info["layout"] == "nchw graph" and info["layout_timings"] == [], info
    assert info["engine"]["name"] and info["engine"]["timings"] == [], info["engine"]
    assert info["math"]["allow_tf32"] is False and info["math"]["tuning"] == "untimed"
    # Under benchmark: NCHW runs one of three ways, each measured once for this key and the fastest kept.
    ways = {"nchw_graph", "channels_last_copies", "aten"}
    timed = dict(timed_info["layout_timings"])
    assert set(timed) == ways and all(ms > 0 for ms in timed.values()), timed_info
    fastest = min(timed, key=timed.__getitem__)
    expected_layout = {"nchw_graph": "nchw graph", "channels_last_copies": "nchw via channels_last copies",
                       "aten": "nchw (aten)"}[fastest]
    assert timed_info["layout"] == expected_layout, timed_info
    assert (timed_info["path"] == "aten") == (fastest == "aten"), timed_info


NCHW_SCRIPT = """
import json, sys, torch, torch.nn.functional as F, torch_convbias
torch.backends.cudnn.allow_tf32 = False
layouts = []
cases = [(16, 16, 16, 16, 16, 3, 1, 1, 1), (4, 32, 13, 11, 64, 3, 2, 1, 1), (2, 64, 9, 9, 32, 1, 1, 0, 1),
         (3, 32, 10, 10, 32, 3, 1, 1, 32), (2, 3, 15, 15, 8, 5, 1, 2, 1)]
for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)):
    for n, c, h, w_, k, r, stride, pad, groups in cases:
        g = torch.Generator().manual_seed(n * c + k)
        x = torch.randn(n, c, h, w_, generator=g).to('cuda', dtype)
        w = (torch.randn(k, c // groups, r, r, generator=g) / (c * r * r / groups) ** 0.5).to('cuda', dtype)
        b = torch.randn(k, generator=g).to('cuda', dtype)
        for bias in (b, None):
            try:
                out = torch_convbias.conv_bias2d(x, w, bias, stride=stride, padding=pad, groups=groups)
            except RuntimeError as e:
                # Forcing the NCHW graph must fail loudly (not silently run ATen) where no NCHW graph builds.
                if "TORCH_CONVBIAS_NCHW=graph but no cuDNN graph over NCHW strides builds" not in str(e):
                    raise
                layouts.append([str(dtype), c, groups, "refused", None])
                continue
            ref = F.conv2d(x.double(), w.double(), None if bias is None else bias.double(), stride=stride,
                           padding=pad, groups=groups)
            assert out.dtype == dtype and out.is_contiguous(), (out.dtype, out.stride())
            scale = max(1.0, ref.abs().max().item())
            torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * scale)
            info = torch_convbias.explain(x, w, bias, stride=stride, padding=pad, groups=groups)
            layouts.append([str(dtype), c, groups, info['layout'], info['path']])
print(json.dumps(layouts))
"""


@pytest.mark.parametrize(
    "way,layouts",
    [
        ("graph", {"nchw graph"}),
        ("copy", {"nchw via channels_last copies"}),
        ("aten", {"nchw (aten)"}),
        ("auto", {"nchw graph", "nchw via channels_last copies", "nchw (aten)"}),
    ],
)
def test_nchw_ways_match_conv2d(way: str, layouts: set[str]) -> None:
    """Every way of running NCHW tensors (forced by TORCH_CONVBIAS_NCHW) matches F.conv2d, and NCHW comes back."""
    result = subprocess.run(
        [sys.executable, "-c", NCHW_SCRIPT], env={**os.environ, "TORCH_CONVBIAS_NCHW": way}, cwd=ROOT,
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    ran = [row for row in seen if row[3] != "refused"]
    assert {layout for *_, layout, _path in ran} <= layouts, seen
    if way == "graph":
        # Most of the grid has an NCHW graph; the rest was refused with the message above, never run another way.
        assert len(ran) >= 2 * len(seen) // 3, seen
    else:
        assert len(ran) == len(seen), seen


def test_seed_case_fuses_over_nchw_strides() -> None:
    """The seed's failure (fused conv+bias NOT_SUPPORTED on NCHW): the graph over NCHW strides now builds."""
    script = (
        "import json, torch, torch_convbias\n"
        "torch.backends.cudnn.allow_tf32 = False\n"
        "x = torch.randn(16, 16, 16, 16, device='cuda'); w = torch.randn(16, 16, 3, 3, device='cuda')\n"
        "b = torch.randn(16, device='cuda')\n"
        "print(json.dumps(torch_convbias.explain(x, w, b, padding=1)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, "TORCH_CONVBIAS_NCHW": "graph"}, cwd=ROOT,
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["layout"] == "nchw graph" and info["path"] == "fused", info
    assert "(all NCHW)" in info["problem"], info


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_channels_last_takes_fused_graph(dtype: torch.dtype) -> None:
    x, w, b = make(8, 32, 12, 12, 64, dtype=dtype)
    info = torch_convbias.explain(x, w, b, padding=1)
    assert info["path"] == "fused", info
    assert info["layout"] == "channels_last" and info["output"] == "channels_last"
    x, w, _ = make(8, 32, 12, 12, 64, dtype=dtype)
    assert torch_convbias.explain(x, w, None, padding=1)["path"] == "conv"


def test_benchmark_mode_measures_aten_too() -> None:
    """Under cudnn.benchmark the graph path is measured against nn.Conv2d's own (ATen) path; the faster one runs."""
    x, w, b = make(8, 32, 12, 12, 32, seed=7)
    torch_convbias.cache_clear()
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        out = conv_bias2d(x, w, b, padding=1)
        info = torch_convbias.explain(x, w, b, padding=1)
    finally:
        torch.backends.cudnn.benchmark = saved
    torch.testing.assert_close(out, F.conv2d(x, w, b, padding=1), rtol=5e-3, atol=5e-3)
    assert info["math"]["benchmark"] is True and info["graph_ms"] > 0 and info["aten_ms"] > 0, info
    assert (info["path"] == "aten") == (info["aten_ms"] < info["graph_ms"]), info


def test_odd_channels_and_float64_still_work() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x, w, b = make(4, 3, 17, 15, 5, r=5, dtype=dtype)
        out = conv_bias2d(x, w, b, stride=2, padding=(2, 1))
        tol = {torch.float32: 5e-3, torch.bfloat16: 5e-2, torch.float64: 1e-10}[dtype]
        torch.testing.assert_close(out, F.conv2d(x, w, b, stride=2, padding=(2, 1)), rtol=tol, atol=tol)
        assert torch_convbias.explain(x, w, b, stride=2, padding=(2, 1))["path"] in ("fused", "conv+bias_add", "aten")
    assert torch_convbias.explain(x, w, b)["path"] == "aten"  # float64 has no graph engines


def test_plan_cache_hits_and_clear() -> None:
    torch_convbias.cache_clear()
    x, w, b = make(2, 8, 9, 9, 8)
    for _ in range(3):
        conv_bias2d(x, w, b, padding=1)
    info = torch_convbias.cache_info()
    assert info["misses"] == 1 and info["hits"] == 2 and info["size"] == info["forward_plans"] == 1, info
    assert info["build_seconds"] > 0
    conv_bias2d(x, w, b, padding=0)  # another key
    assert torch_convbias.cache_info()["size"] == 2
    torch_convbias.cache_clear()
    assert torch_convbias.cache_info() == {
        **info, "hits": 0, "misses": 0, "size": 0, "forward_plans": 0, "build_seconds": 0, "capture_plans": 0
    }


def test_tf32_flag_is_respected() -> None:
    x, w, b = make(4, 64, 16, 16, 64, seed=3)
    expected = F.conv2d(x.double(), w.double(), b.double(), padding=1)
    saved = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = False
        strict = conv_bias2d(x, w, b, padding=1)
        torch.backends.cudnn.allow_tf32 = True
        tf32 = conv_bias2d(x, w, b, padding=1)
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    strict_error = (strict.double() - expected).abs().max().item()
    tf32_error = (tf32.double() - expected).abs().max().item()
    assert strict_error < 1e-4, strict_error
    assert tf32_error > strict_error  # TF32 tensor cores round the inputs to 10 mantissa bits


def test_deterministic_mode_is_bitwise_repeatable() -> None:
    x, w, b = make(16, 32, 16, 16, 32, seed=4)
    torch.use_deterministic_algorithms(True)
    try:
        first = conv_bias2d(x, w, b, padding=1)
        second = conv_bias2d(x, w, b, padding=1)
        assert torch_convbias.explain(x, w, b, padding=1)["math"]["deterministic"] is True
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(first, second)


def test_misaligned_pointers_are_realigned() -> None:
    n, c, h, w_, k = 2, 8, 6, 6, 8
    storage = torch.randn(n * c * h * w_ + 1, device="cuda")
    x = storage[1:].as_strided((n, c, h, w_), (c * h * w_, 1, w_ * c, c))  # channels_last, 4-byte aligned
    _, w, b = make(n, c, h, w_, k)
    out = conv_bias2d(x, w, b, padding=1)
    torch.testing.assert_close(out, F.conv2d(x, w, b, padding=1), rtol=5e-3, atol=5e-3)
    info = torch_convbias.explain(x, w, b, padding=1)
    # cuDNN's engines need 16-byte aligned pointers: the input is copied to an aligned buffer first.
    assert info["realigned"] is True and info["alignment"]["input"] == 16, info
    assert info["path"] == "fused", info


def test_cuda_graph_capture_and_replay() -> None:
    x, w, b = make(4, 16, 10, 10, 32)
    static_x = x.clone()
    conv_bias2d(static_x, w, b, padding=1)  # plan built (and timed) before capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        conv_bias2d(static_x, w, b, padding=1)
        with torch.cuda.graph(graph, stream=stream):
            static_out = conv_bias2d(static_x, w, b, padding=1)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(3):
        static_x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to("cuda"))
        graph.replay()
        torch.testing.assert_close(static_out, F.conv2d(static_x, w, b, padding=1), rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_step_captured_in_a_cuda_graph_matches_eager(dtype: torch.dtype) -> None:
    """A whole layer-wise step (forward, param_grad through autograd, SGD with momentum) captured once and replayed
    gives the parameters that the same steps run eagerly give (the benchmark's graphed figure relies on it)."""
    torch.manual_seed(0)
    eager = torch_convbias.ConvBias2d(16, 32, 3, padding=1, device="cuda", dtype=dtype)
    eager = eager.to(memory_format=torch.channels_last)
    graphed = copy.deepcopy(eager)
    initial = eager.weight.detach().clone()
    x = torch.randn(8, 16, 12, 12, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    seed = (torch.randn(8, 32, 12, 12, device="cuda", dtype=dtype) / 100).contiguous(memory_format=torch.channels_last)
    optimizers = {m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (eager, graphed)}

    def step(module: torch.nn.Module) -> None:
        module(x).backward(seed)
        optimizers[module].step()
        optimizers[module].zero_grad(set_to_none=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(graphed)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(2):
        step(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records, runs nothing
        graphed(x).backward(seed)
        optimizers[graphed].step()
    for _ in range(3):
        graph.replay()
        step(eager)
    torch.cuda.synchronize()
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-3}
    torch.testing.assert_close(graphed.weight, eager.weight, **tol)
    torch.testing.assert_close(graphed.bias, eager.bias, **tol)
    # Five updates moved the parameters: the comparison is not between two untouched copies.
    assert not torch.equal(graphed.weight, initial)


def capture(fn):  # type: ignore[no-untyped-def]
    """fn() captured into a CUDA graph on a side stream; returns (graph, fn's result)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


def test_plan_built_during_capture_serves_the_capture_only() -> None:
    """A new key met during capture gets an untimed plan (nothing may synchronise) that serves captures; the next
    eager call of the key chooses as usual - timed, under cudnn.benchmark."""
    torch_convbias.cache_clear()
    x, w, b = make(3, 16, 11, 11, 16)
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        graph, out = capture(lambda: conv_bias2d(x, w, b, padding=1))
        during = torch_convbias.cache_info()
        graph.replay()
        torch.testing.assert_close(out, F.conv2d(x, w, b, padding=1), rtol=5e-3, atol=5e-3)
        eager = conv_bias2d(x, w, b, padding=1)
        info = torch_convbias.explain(x, w, b, padding=1)
    finally:
        torch.backends.cudnn.benchmark = saved
    assert during["forward_plans"] == 0 and during["capture_plans"] == 1, during
    assert info["tuned"] is True and info["math"]["tuning"] == "exhaustive" and len(info["engine"]["timings"]) >= 1, info
    torch.testing.assert_close(eager, F.conv2d(x, w, b, padding=1), rtol=5e-3, atol=5e-3)


def test_nchw_capture_on_a_cold_cache_runs_the_nchw_graph_without_copies() -> None:
    """NCHW tensors captured on a cold cache take the graph over their own strides: the channels_last plan (and the
    copies it would need) is not even built, so no copy kernel lands in the captured graph."""
    torch_convbias.cache_clear()
    x, w, b = make(4, 16, 12, 12, 16, channels_last=False)
    graph, out = capture(lambda: conv_bias2d(x, w, b, padding=1))
    during = torch_convbias.cache_info()
    graph.replay()
    torch.testing.assert_close(out, F.conv2d(x, w, b, padding=1), rtol=5e-3, atol=5e-3)
    assert out.is_contiguous()
    assert during["capture_plans"] == 1 and during["forward_plans"] == 0, during
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels and not any("copy" in k.lower() or "elementwise" in k.lower() for k in kernels), kernels


def test_one_build_per_key_when_threads_miss_it_together() -> None:
    """Eight threads needing one new key at once: one builds (and times, under cudnn.benchmark), the others wait
    for its plan instead of building and timing the same candidates again on the same GPU."""
    x, w, b = make(8, 32, 14, 14, 32, seed=11)
    expected = F.conv2d(x, w, b, padding=1)
    torch.cuda.synchronize()
    torch_convbias.cache_clear()
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True

    def work() -> None:
        try:
            barrier.wait()
            torch.testing.assert_close(conv_bias2d(x, w, b, padding=1), expected, rtol=5e-3, atol=5e-3)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.backends.cudnn.benchmark = saved
    assert not errors, errors[0]
    info = torch_convbias.cache_info()
    assert info["misses"] == 1 and info["hits"] == 7 and info["forward_plans"] == 1, info


def test_threads_share_the_cache() -> None:
    shapes = [(2, 8, 8, 8, 8), (3, 16, 10, 9, 8), (1, 4, 12, 12, 16), (2, 32, 7, 7, 32)]
    cases = []
    for i in range(8):
        x, w, b = make(*shapes[i % len(shapes)], seed=i)
        cases.append((x, w, b, F.conv2d(x, w, b, padding=1)))
    torch.cuda.synchronize()
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            x, w, b, expected = cases[i]
            for _ in range(20):
                torch.testing.assert_close(conv_bias2d(x, w, b, padding=1), expected, rtol=5e-3, atol=5e-3)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    torch_convbias.cache_clear()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert torch_convbias.cache_info()["size"] == len(shapes)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_input_on_another_gpu() -> None:
    x, w, b = (t.to("cuda:1") if t is not None else None for t in make(2, 8, 8, 8, 8))
    torch.testing.assert_close(conv_bias2d(x, w, b, padding=1), F.conv2d(x, w, b, padding=1), rtol=5e-3, atol=5e-3)
    # The bias-gradient ways by name run on grad_output's GPU too, whichever is current (device guard).
    dy = torch.randn(2, 8, 8, 8, device="cuda:1").contiguous(memory_format=torch.channels_last)
    for way in ("kernel", "aten"):
        got = torch.ops.convbias._bias_grad(dy, way)
        assert got.device == dy.device
        torch.testing.assert_close(got, dy.sum((0, 2, 3)), rtol=1e-5, atol=1e-5)
    # The backend's merged input gradient + activation backward too (cuda:0 current), against the CPU's two steps.
    saved = torch.relu(torch.randn_like(x)).contiguous(memory_format=torch.channels_last)
    args = (dy, x, w.contiguous(memory_format=torch.channels_last), [1, 1], [1, 1], [1, 1], 1, saved, "relu", 0.01, True)
    grad_z, grad_bias = torch.ops.convbias._input_grad_activation(*args)
    want_z, want_bias = torch.ops.convbias._input_grad_activation(*(a.cpu() if torch.is_tensor(a) else a for a in args))
    assert grad_z.device == grad_bias.device == dy.device
    torch.testing.assert_close(grad_z.cpu(), want_z, rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(grad_bias.cpu(), want_bias, rtol=5e-3, atol=5e-2)



def one_training_call(device: str) -> dict[str, int]:
    """conv + bias + relu forward and backward on ``device`` (strict fp32) against float64 autograd on the CPU; returns
    the plan cache's size and hits after it."""
    x, w, b = (t.to(device) for t in make(4, 16, 12, 12, 16, seed=7))
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    out = conv_bias2d(*leaves, padding=1, activation="relu")
    seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(device)
    out.backward(seed)
    assert out.device == torch.device(device) and all(t.grad.device == out.device for t in leaves)
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in (x, w, b)]
    expected = F.relu(F.conv2d(*ref_leaves, padding=1))
    expected.backward(seed.cpu().double())
    for what, got, want in zip(("output", "grad x", "grad w", "grad b"), (out, *(t.grad for t in leaves)),
                               (expected, *(t.grad for t in ref_leaves))):
        torch.testing.assert_close(got.detach().cpu().double(), want.detach(), rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{device} {what}: {m}")
    info = torch_convbias.cache_info()
    return {"size": int(info["size"]), "hits": int(info["hits"])}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_alternating_devices_keep_a_plan_per_device() -> None:
    """Issue 15: one problem's training call on cuda:0 and cuda:1 alternately, cuda:0 current throughout: right on
    each device every time, and the plans are per device (the cache holds each GPU's own, built with its handle,
    stream and workspace: twice the plans of one device, then only hits)."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch_convbias.cache_clear()
    try:
        with torch.cuda.device(0):
            one_device = one_training_call("cuda:0")["size"]
            assert one_device > 0
            both = one_training_call("cuda:1")
            assert both["size"] == 2 * one_device, both
            for _ in range(3):
                for device in ("cuda:0", "cuda:1"):
                    after = one_training_call(device)
                    assert after["size"] == 2 * one_device and after["hits"] > both["hits"], after
                    both = after
    finally:
        torch.backends.cudnn.allow_tf32 = saved
        torch_convbias.cache_clear()

SCRIPT = """
import json, torch, torch.nn.functional as F, torch_convbias
# Strict fp32 on both sides: with TF32 the sweep may pick another TF32 engine than F.conv2d's (errors ~1e-2).
torch.backends.cudnn.allow_tf32 = False
x = torch.randn(2, 8, 9, 9, device='cuda').contiguous(memory_format=torch.channels_last)
w = torch.randn(8, 8, 3, 3, device='cuda').contiguous(memory_format=torch.channels_last)
b = torch.randn(8, device='cuda')
out = torch_convbias.conv_bias2d(x, w, b, padding=1)
torch.testing.assert_close(out, F.conv2d(x, w, b, padding=1), rtol=5e-3, atol=5e-3)
for _ in range(3):
    torch_convbias.conv_bias2d(x, w, b, padding=0)
print(json.dumps({"explain": torch_convbias.explain(x, w, b, padding=1), "cache": torch_convbias.cache_info()}))
"""


def run_with_env(**env: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**os.environ, **env}, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("path,expected", [("unfused", "conv+bias_add"), ("aten", "aten"), ("fused", "fused")])
def test_path_knob(path: str, expected: str) -> None:
    assert run_with_env(TORCH_CONVBIAS_PATH=path)["explain"]["path"] == expected


def test_autotune_on_sweeps_and_times_every_engine() -> None:
    """TORCH_CONVBIAS_AUTOTUNE=on: heuristics' configurations plus every other engine are built and timed."""
    engine = run_with_env(TORCH_CONVBIAS_AUTOTUNE="on", TORCH_CONVBIAS_PATH="fused")["explain"]["engine"]
    # The sweep added engines heuristics did not offer (6-11 per shape on the H200 suite at 6fa1ec3).
    assert engine["swept"] > 0, engine
    assert len(engine["timings"]) > 3, engine  # more than the default policy's three candidates
    assert engine["measured_ms"] == min(ms for _, ms in engine["timings"]), engine


def test_cache_size_knob_evicts() -> None:
    cache = run_with_env(TORCH_CONVBIAS_CACHE_SIZE="1")["cache"]
    assert cache["capacity"] == 1 and cache["size"] == 1 and cache["evictions"] >= 1, cache


@pytest.mark.parametrize(
    "knob,value,message",
    [
        ("TORCH_CONVBIAS_PATH", "fastest", "TORCH_CONVBIAS_PATH must be auto, fused, unfused or aten"),
        ("TORCH_CONVBIAS_CACHE_SIZE", "0", "TORCH_CONVBIAS_CACHE_SIZE must be a positive integer"),
        ("TORCH_CONVBIAS_CACHE_SIZE", "many", "TORCH_CONVBIAS_CACHE_SIZE must be a positive integer, got 'many'"),
        ("TORCH_CONVBIAS_AUTOTUNE", "max", "TORCH_CONVBIAS_AUTOTUNE must be auto, off, quick or on"),
        ("TORCH_CONVBIAS_PARAM_GRAD", "cuda", "TORCH_CONVBIAS_PARAM_GRAD must be aten or cudnn"),
        ("TORCH_CONVBIAS_INPUT_GRAD", "cudnn", "TORCH_CONVBIAS_INPUT_GRAD must be aten, timed or graph, got 'cudnn'"),
        ("TORCH_CONVBIAS_NCHW", "native", "TORCH_CONVBIAS_NCHW must be auto, graph, copy or aten, got 'native'"),
        ("TORCH_CONVBIAS_PAD_CHANNELS", "always", "TORCH_CONVBIAS_PAD_CHANNELS must be auto, on or off, got 'always'"),
        ("TORCH_CONVBIAS_BIAS_GRAD", "sum", "TORCH_CONVBIAS_BIAS_GRAD must be kernel, cudnn or aten, got 'sum'"),
        ("TORCH_CONVBIAS_WORKSPACE_FALLBACK", "maybe", "TORCH_CONVBIAS_WORKSPACE_FALLBACK must be on or off, got 'maybe'"),
        ("TORCH_CONVBIAS_RUNTIME_COMPILATION", "always",
         "TORCH_CONVBIAS_RUNTIME_COMPILATION must be fallback, timed or off, got 'always'"),
    ],
)
def test_bad_knob_is_reported(knob: str, value: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**os.environ, knob: value}, cwd=ROOT,
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0 and message in result.stderr and "ValueError" in result.stderr


def test_runtime_compilation_timed_contradicting_no_runtime_compilation_is_reported() -> None:
    env = {**os.environ, "TORCH_CONVBIAS_RUNTIME_COMPILATION": "timed", "TORCH_CONVBIAS_NO_RUNTIME_COMPILATION": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    message = "TORCH_CONVBIAS_RUNTIME_COMPILATION=timed contradicts TORCH_CONVBIAS_NO_RUNTIME_COMPILATION=1"
    assert result.returncode != 0 and message in result.stderr and "ValueError" in result.stderr


def test_doctor_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torch_convbias.doctor"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cudnn_loaded" in result.stdout and "seed case on cuda: path=" in result.stdout
    assert "layout=nchw" in result.stdout, result.stdout
