"""PyTorch's numeric, determinism and cuDNN flags mean to the convbias ops what they mean to ATen's convolution.

TF32 for convolutions is set by the legacy ``torch.backends.cudnn.allow_tf32`` and by the ``fp32_precision`` of
``torch.backends.cudnn.conv``, ``torch.backends.cudnn`` and ``torch.backends``, in any mix; determinism by
``torch.backends.cudnn.deterministic`` or ``torch.use_deterministic_algorithms``; ``cudnn.benchmark`` decides whether
new shapes are timed; ``cudnn.enabled = False`` means no cuDNN at all. The oracle is PyTorch itself: its own
reading of the flags (CPU), and F.conv2d's numerics under the same flags (GPU).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import cuda

import torch_convbias

PRECISIONS = (None, "ieee", "tf32")  # None: leave the setting alone


def math_flags() -> dict[str, Any]:
    return json.loads(torch.ops.convbias._math_flags())


def legacy_allow_tf32() -> bool | None:
    """torch.backends.cudnn.allow_tf32, or None where PyTorch refuses to say (conv and RNN precisions differ)."""
    try:
        return bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        return None


@contextlib.contextmanager
def restored_flags() -> Iterator[None]:
    """Every flag these tests touch, restored afterwards: the legacy switch first (it sets the conv and RNN
    precisions and a flag of its own), then the new API from the outside in."""
    backends, cudnn = torch.backends, torch.backends.cudnn
    legacy = legacy_allow_tf32()
    saved = (
        backends.fp32_precision, cudnn.fp32_precision, cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision,
        cudnn.deterministic, cudnn.benchmark, cudnn.enabled, torch.are_deterministic_algorithms_enabled(),
    )
    try:
        yield
    finally:
        if legacy is not None:
            cudnn.allow_tf32 = legacy
        backends.fp32_precision, cudnn.fp32_precision = saved[0], saved[1]
        cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = saved[2], saved[3]
        cudnn.deterministic, cudnn.benchmark, cudnn.enabled = saved[4], saved[5], saved[6]
        torch.use_deterministic_algorithms(saved[7])
        assert legacy_allow_tf32() == legacy, "the flags were not restored"


def conv_tf32_by_pytorch() -> bool:
    """Whether PyTorch's convolution may use TF32 now, from its own settings: the convolution's fp32_precision, else
    cuDNN's, else the generic one ("none" inherits; "none" all the way, as the legacy allow_tf32 = False leaves the
    convolution's, means no TF32)."""
    for value in (
        torch.backends.cudnn.conv.fp32_precision,
        torch.backends.cudnn.fp32_precision,
        torch.backends.fp32_precision,
    ):
        if value != "none":
            return value == "tf32"
    return False


def apply(legacy: bool | None, generic: str | None, cudnn: str | None, conv: str | None, rnn: str | None) -> None:
    """Set the flags in the order a user might: the legacy switch, then the new API from the outside in."""
    if legacy is not None:
        torch.backends.cudnn.allow_tf32 = legacy
    if generic is not None:
        torch.backends.fp32_precision = generic
    if cudnn is not None:
        torch.backends.cudnn.fp32_precision = cudnn
    if conv is not None:
        torch.backends.cudnn.conv.fp32_precision = conv
    if rnn is not None:
        torch.backends.cudnn.rnn.fp32_precision = rnn


COMBINATIONS = list(itertools.product((None, True, False), PRECISIONS, PRECISIONS, PRECISIONS, PRECISIONS))


def test_tf32_is_read_for_convolutions_under_every_mix_of_the_apis() -> None:
    """243 ways of setting the flags, among them conv and RNN precisions that differ (where PyTorch refuses to say
    whether "cuDNN" allows TF32 without naming the op): the op reads the convolution's own setting, never raises."""
    mixed = 0
    for combination in COMBINATIONS:
        with restored_flags():
            apply(*combination)
            mixed += torch.backends.cudnn.conv.fp32_precision != torch.backends.cudnn.rnn.fp32_precision
            assert math_flags()["allow_tf32"] is conv_tf32_by_pytorch(), combination
    assert mixed > 0  # the combinations that broke every call before


def test_either_determinism_flag_makes_the_ops_deterministic() -> None:
    with restored_flags():
        torch.backends.cudnn.deterministic = False
        torch.use_deterministic_algorithms(False)
        assert math_flags()["deterministic"] is False
        torch.backends.cudnn.deterministic = True
        assert math_flags()["deterministic"] is True
        torch.backends.cudnn.deterministic = False
        torch.use_deterministic_algorithms(True)
        assert math_flags()["deterministic"] is True


def test_benchmark_flag_decides_the_tuning() -> None:
    """cudnn.benchmark=False: heuristics, nothing timed (bench_variable_shapes measured the choice); True: timed."""
    with restored_flags():
        torch.backends.cudnn.benchmark = False
        flags = math_flags()
        assert flags["benchmark"] is False and flags["tuning"] == "untimed", flags
        torch.backends.cudnn.benchmark = True
        flags = math_flags()
        assert flags["benchmark"] is True and flags["tuning"] == "exhaustive", flags


def test_cudnn_enabled_flag_is_reported() -> None:
    with restored_flags():
        torch.backends.cudnn.enabled = False
        assert math_flags()["cudnn_enabled"] is False
        torch.backends.cudnn.enabled = True
        assert math_flags()["cudnn_enabled"] is True


# ---------------------------------------------------------------------------------------------------------------
# On the GPU: the flags change what runs, exactly as they change F.conv2d.


def problem(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A channels_last problem large enough for TF32 rounding to show (K*C*9 products per output)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 64, 20, 20, generator=g).to("cuda", dtype).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(64, 64, 3, 3, generator=g) / 24).to("cuda", dtype).contiguous(memory_format=torch.channels_last)
    b = torch.randn(64, generator=g).to("cuda", dtype)
    return x, w, b


def max_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return (y.double() - reference).abs().max().item()


GPU_COMBINATIONS = [
    # (legacy, generic, cudnn, conv, rnn): conv and RNN differ in the first two (the reported breakage)
    (None, None, None, "ieee", None),
    (None, None, None, "tf32", "ieee"),
    (False, None, None, None, None),
    (True, None, None, None, None),
    (None, "ieee", None, None, None),
    (None, None, "tf32", None, None),
    (True, None, None, "ieee", None),
    (None, "tf32", "ieee", None, "tf32"),
]


@cuda
@pytest.mark.parametrize("combination", GPU_COMBINATIONS, ids=str)
def test_tf32_flags_change_our_numerics_as_they_change_f_conv2d(combination: tuple[Any, ...]) -> None:
    """Strict fp32 (no TF32 engine: errors ~1e-6) or TF32 (errors ~1e-3), as F.conv2d under the same flags."""
    x, w, b = problem(seed=1)
    reference = F.conv2d(x.double(), w.double(), b.double(), padding=1)
    with restored_flags():
        apply(*combination)
        ours = torch_convbias.conv_bias2d(x, w, b, padding=1)
        theirs = F.conv2d(x, w, b, padding=1)
        info = torch_convbias.explain(x, w, b, padding=1)
        expect_tf32 = conv_tf32_by_pytorch()
    theirs_tf32 = max_error(theirs, reference) > 1e-4
    assert theirs_tf32 == expect_tf32, (combination, max_error(theirs, reference))
    assert info["math"]["allow_tf32"] is expect_tf32, info["math"]
    assert info["path"] == "fused", info
    ours_error = max_error(ours, reference)
    if expect_tf32:
        assert 1e-4 < ours_error < 5e-2, ours_error
    else:
        assert ours_error < 1e-4, (ours_error, info["engine"]["name"])


@cuda
@pytest.mark.parametrize("flag", ["cudnn.deterministic", "use_deterministic_algorithms"])
def test_repeated_gradients_are_bitwise_equal_under_each_determinism_flag(flag: str) -> None:
    """Weight and bias gradients of a shape whose fastest strict-fp32 wgrad engines include non-deterministic ones,
    with every engine timed (cudnn.benchmark): each call gives the same bits, the bias kernel runs untimed."""
    x, w, _ = problem(seed=2)
    x = x[:, :, :18, :18].contiguous(memory_format=torch.channels_last)  # a key of its own
    dy = torch.randn(8, 64, 18, 18, device="cuda").contiguous(memory_format=torch.channels_last)
    with restored_flags():
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        torch.backends.cudnn.benchmark = True
        if flag == "cudnn.deterministic":
            torch.backends.cudnn.deterministic = True
        else:
            torch.use_deterministic_algorithms(True)
        runs = [torch.ops.convbias.param_grad(dy, x, w, [1, 1], [1, 1], [1, 1], 1, [True, True]) for _ in range(4)]
        info = torch_convbias.explain_param_grad(dy, x, w, padding=1)
    assert info["math"]["deterministic"] is True, info["math"]
    assert info["bias_grad"]["way"] == "kernel" and info["bias_grad"]["launch"]["timed"] is False, info["bias_grad"]
    for grad_weight, grad_bias in runs[1:]:
        assert torch.equal(grad_weight, runs[0][0]) and torch.equal(grad_bias, runs[0][1])
    _, ref_w, ref_b = torch.ops.aten.convolution_backward(
        dy.double(), x.double(), w.double(), [64], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, True]
    )
    torch.testing.assert_close(runs[0][0].double(), ref_w, rtol=1e-4, atol=1e-4 * ref_w.abs().max().item())
    torch.testing.assert_close(runs[0][1].double(), ref_b, rtol=1e-5, atol=1e-5 * ref_b.abs().max().item())


# AlexNet's convolutions at its training batch (bench/bench_models.py): (C, side, K, kernel, stride, padding). On the H100
# at 690a2ff a float32 weight gradient of these under TF32 ran an engine that down-converts to half (an f16 wgrad kernel
# in `models-nvidia-h100-80gb-hbm3.json`'s AlexNet TF32 training row).
ALEXNET_CONVS = [(3, 224, 64, 11, 4, 2), (64, 27, 192, 5, 1, 2), (192, 13, 384, 3, 1, 1), (384, 13, 256, 3, 1, 1),
                 (256, 13, 256, 3, 1, 1)]  # fmt: skip
HALF_KERNEL = re.compile(r"f16|half|fp16", re.IGNORECASE)


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.detach()).norm() / expected.detach().norm()).item()


@cuda
@pytest.mark.parametrize("layer", range(len(ALEXNET_CONVS)))
def test_tf32_never_runs_float32_in_half_precision(layer: int) -> None:
    """TF32 rounds float32's mantissa and keeps its exponent; an engine that down-converts float32 inputs to half
    (cuDNN's DOWN_CONVERT_INPUTS note) keeps neither, and ATen never takes one. With inputs of 1e-9 (below half's
    smallest subnormal, 6e-8) under TF32 and every choice timed: our forward and weight gradient keep float64's values
    to TF32's precision (half would flush them to zero: a relative error of 1), and no kernel with half-precision
    operands runs (the profiler's kernel names)."""
    c, side, k, kernel, stride, padding = ALEXNET_CONVS[layer]
    generator = torch.Generator("cuda").manual_seed(layer)

    def draw(*size: int, scale: float) -> torch.Tensor:
        t = torch.randn(*size, device="cuda", generator=generator) * scale
        return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t

    out = (side + 2 * padding - kernel) // stride + 1
    x, dy = draw(512, c, side, side, scale=1e-9), draw(512, k, out, out, scale=1.0)
    w, b = draw(k, c, kernel, kernel, scale=(c * kernel * kernel) ** -0.5), draw(k, scale=1e-9)
    strides, paddings, ones = [stride] * 2, [padding] * 2, [1, 1]
    with restored_flags():
        torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark = True, True
        torch.backends.cudnn.conv.fp32_precision = "tf32"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            y = torch.ops.convbias.forward(x, w, b, strides, paddings, ones, 1)
            grad_w, _ = torch.ops.convbias.param_grad(dy, x, w, strides, paddings, ones, 1, [True, False])
            torch.cuda.synchronize()
        paths = (torch_convbias.explain(x, w, b, stride, padding), torch_convbias.explain_param_grad(dy, x, w, stride, padding))
    assert paths[0]["math"]["allow_tf32"] is True, paths[0]["math"]
    engines = {"forward": (paths[0]["path"], (paths[0].get("engine") or {}).get("name")),
               "weight_grad": (paths[1]["weight_grad"]["path"], (paths[1]["weight_grad"].get("engine") or {}).get("name"))}
    kernels = {event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA}
    assert not [name for name in kernels if HALF_KERNEL.search(name)], (engines, sorted(kernels))
    x64, w64 = x.double(), w.double().requires_grad_()
    expected = F.conv2d(x64, w64, b.double(), strides, paddings)
    (expected_grad,) = torch.autograd.grad(expected, w64, dy.double())
    assert rel_rms(y, expected) < 1e-2, (rel_rms(y, expected), engines)
    assert rel_rms(grad_w, expected_grad) < 1e-2, (rel_rms(grad_w, expected_grad), engines)


@cuda
def test_benchmark_off_times_nothing_and_benchmark_on_times() -> None:
    x, w, b = problem(dtype=torch.bfloat16, seed=3)
    with restored_flags():
        torch.backends.cudnn.benchmark = False
        untimed = torch_convbias.explain(x[:4], w, b, padding=1)
        dy = torch.randn(4, 64, 20, 20, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
        untimed_grad = torch_convbias.explain_param_grad(dy, x[:4], w, padding=1)
        torch.backends.cudnn.benchmark = True
        timed = torch_convbias.explain(x[:4], w, b, padding=1)
    assert untimed["math"]["tuning"] == "untimed" and untimed["tuned"] is False, untimed
    assert untimed["engine"]["timings"] == [] and untimed["engine"]["built"] == 1, untimed["engine"]
    assert untimed_grad["weight_grad"]["graph_ms"] == -1 and untimed_grad["weight_grad"]["aten_ms"] == -1
    assert untimed_grad["bias_grad"]["launch"]["timed"] is False
    assert timed["math"]["tuning"] == "exhaustive" and timed["tuned"] is True, timed
    assert len(timed["engine"]["timings"]) >= 1, timed["engine"]


@cuda
def test_cudnn_disabled_runs_aten_and_gives_f_conv2d_layout() -> None:
    x, w, b = problem(seed=4)
    with restored_flags():
        torch.backends.cudnn.enabled = False
        ours = torch_convbias.conv_bias2d(x, w, b, padding=1)
        theirs = F.conv2d(x, w, b, padding=1)
        info = torch_convbias.explain(x, w, b, padding=1)
        dy = torch.randn_like(ours)
        grad_info = torch_convbias.explain_param_grad(dy, x, w, padding=1)
    assert info["path"] == "aten" and "cudnn.enabled" in info["notes"][0], info
    assert grad_info["weight_grad"]["path"] == "aten", grad_info
    assert ours.stride() == theirs.stride(), (ours.stride(), theirs.stride())
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@cuda
def test_an_engine_that_fails_to_execute_is_skipped() -> None:
    """A plan that builds but whose execution fails costs nothing but a candidate: the next one runs, and the plan
    kept is one that ran. When every candidate fails, ATen runs."""
    x, w, b = problem(seed=5)
    x = x[:, :, :17, :17].contiguous(memory_format=torch.channels_last)  # keys no other test builds
    try:
        torch.ops.convbias._inject_execution_failures(1)
        out = torch_convbias.conv_bias2d(x, w, b, padding=1)
        info = torch_convbias.explain(x, w, b, padding=1)
        torch.ops.convbias._inject_execution_failures(10_000)
        x2 = x[:, :, :15, :15].contiguous(memory_format=torch.channels_last)
        out2 = torch_convbias.conv_bias2d(x2, w, b, padding=1)
        torch.ops.convbias._inject_execution_failures(0)
        info2 = torch_convbias.explain(x2, w, b, padding=1)
    finally:
        torch.ops.convbias._inject_execution_failures(0)
    torch.testing.assert_close(out, F.conv2d(x, w, b, padding=1), rtol=5e-3, atol=5e-3)
    assert info["path"] == "fused" and info["engine"]["execution_failures"] == 1, info["engine"]
    assert any("failed to execute" in r and "injected" in r for r in info["engine"]["rejected"]), info["engine"]
    torch.testing.assert_close(out2, F.conv2d(x2, w, b, padding=1), rtol=5e-3, atol=5e-3)
    assert info2["path"] == "aten" and any("no cuDNN graph builds (and runs)" in n for n in info2["notes"]), info2
