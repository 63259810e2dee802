"""Seeded random calls of ``conv_bias2d`` against ``F.conv2d`` as the oracle: shapes, conv parameters, dtypes,
layouts, bias, input gradient, and deliberately broken arguments.

For every drawn case: where F.conv2d accepts the arguments, ours must too and match it (output, and the
gradients of input, weight and bias against autograd through F.conv2d); where F.conv2d rejects them, ours must
raise a Python exception of its own (ValueError / TypeError naming the argument, message starting with
``convbias`` or ``conv_bias2d``), never crash, hang or return a result. The numbers come from an independent oracle:
F.conv2d in float64 on the CPU, NCHW, whatever the case's device, dtype and layout (our CPU kernels run ATen in the
case's dtype; our CUDA kernels cuDNN graphs), with tolerances from the dtype. On CUDA the draw favours what our graphs
and bias kernel take (channels_last, channel counts in 16-byte rows, larger images), every valid case records the
path it took (explain / explain_param_grad), and the coverage is printed and asserted: at least half of the valid
cases run our graphs, a fifth our bias kernel. The seed makes every run draw the same cases; a failure names its
case number, and ``FUZZ_CASES`` / ``FUZZ_SEED`` change the count and the draw. Half of the draws also apply an activation (relu,
leaky_relu with a positive or negative slope, gelu, gelu_tanh, silu, sigmoid, tanh), which the oracle applies in
float64 after its convolution; on CUDA, how many of those ran in the forward graph's epilogue is counted. A third of
the cases also add a residual of the output's shape (``conv_bias2d(..., residual=r)``, convbias.forward_residual; the
oracle adds it in float64 before the activation, and its gradient is checked too), one in nine a residual of a wrong
shape, which ours must reject; which cases do is decided by the case number, so the other fields are drawn as before.
Where relu's or leaky_relu's pre-activation lies within rounding of the kink, the gradient seed is zero there: the
case's dtype may round it to either side, and either derivative is right.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, HAS_CUDA, MODES, assert_close, math_mode

import torch_convbias
from torch_convbias import conv_bias2d

CASES = int(os.environ.get("FUZZ_CASES", "2000"))
SEED = int(os.environ.get("FUZZ_SEED", "20261202"))

CPU_DTYPES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16"}
CUDA_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
OUR_ERRORS = (ValueError, TypeError)
# Breakages that F.conv2d does not always reject on CUDA (torch 2.11, H200: a grouped bf16 problem with dilation
# (1, 0) returned a result). They are invalid all the same (F.conv2d rejects them on the CPU), so ours must reject
# them on every device.
ATEN_LENIENT_BREAKAGES = {"zero-dilation"}
# Breakages of the activation alone, which F.conv2d does not take: invalid for the forward, irrelevant to param_grad.
ACTIVATION_BREAKAGES = {"unknown-activation", "non-finite-slope"}


@dataclass
class Case:
    """One call: tensor shapes and how the tensors are laid out, conv parameters, and what is deliberately broken."""

    n: int
    c: int
    h: int
    w: int
    k: int
    kh: int
    kw: int
    groups: int
    stride: Any
    padding: Any
    dilation: Any
    dtype: torch.dtype
    layout: str  # "contiguous", "channels_last" or "strided" (a non-contiguous view)
    bias: bool
    input_grad: bool
    # The activation applied by the op (and, in float64, after the oracle's convolution) and leaky_relu's slope.
    activation: str = "identity"
    negative_slope: float = 0.01
    # What is broken on purpose (None for a valid draw) and the tensors' overrides that break it.
    broken: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)


def draw(rng: random.Random, dtypes: dict[torch.dtype, str], device: str = "cpu") -> Case:
    """A case; on CUDA shaped towards what our graphs and bias kernel take: mostly channels_last, channel counts of
    whole 16-byte rows for half the draws, images up to 16x16."""
    groups = rng.choice([1, 1, 1, 2, 3, 4])
    if device == "cuda":
        per_group = rng.choice([1, 2, 3, 4, 8, 16]) if rng.random() < 0.5 else 8 * rng.randint(1, 4)
        layout = rng.choices(["channels_last", "contiguous", "strided"], weights=[6, 2, 2])[0]
        sides = (rng.randint(1, 16), rng.randint(1, 16))
        n = rng.randint(1, 4)
    else:
        per_group = rng.randint(1, 3)
        layout = rng.choice(["contiguous", "channels_last", "strided"])
        sides = (rng.randint(1, 10), rng.randint(1, 10))
        n = rng.randint(1, 3)
    case = Case(
        n=n,
        c=groups * rng.choice([1, 2, 3, per_group]),
        h=sides[0],
        w=sides[1],
        k=groups * per_group,
        kh=rng.randint(1, 4),
        kw=rng.randint(1, 4),
        groups=groups,
        stride=rng.choice([1, 2, 3, (1, 2), (2, 1)]),
        padding=rng.choice([0, 1, 2, (0, 1), (2, 0), "same", "valid"]),
        dilation=rng.choice([1, 1, 2, (1, 2), 3]),
        dtype=rng.choice(list(dtypes)),
        layout=layout,
        bias=rng.random() < 0.8,
        input_grad=rng.random() < 0.4,
    )
    if rng.random() < 0.5:
        case.activation = rng.choice(sorted(ORACLE_ACTIVATIONS))
        case.negative_slope = rng.choice([0.01, 0.2, -0.3]) if case.activation == "leaky_relu" else 0.01
    if case.padding == "same" and case.stride != 1:
        case.stride = 1  # a valid draw; strided 'same' is among the broken ones below
    return breakage(rng, case) if rng.random() < 0.3 else case


# The op's activations (besides identity) as the oracle applies them, in float64 after F.conv2d.
ORACLE_ACTIVATIONS: dict[str, Any] = {
    "relu": lambda t, slope: F.relu(t),
    "leaky_relu": lambda t, slope: F.leaky_relu(t, slope),
    "gelu": lambda t, slope: F.gelu(t),
    "gelu_tanh": lambda t, slope: F.gelu(t, approximate="tanh"),
    "silu": lambda t, slope: F.silu(t),
    "sigmoid": lambda t, slope: torch.sigmoid(t),
    "tanh": lambda t, slope: torch.tanh(t),
}


def activated(case: Case, t: torch.Tensor) -> torch.Tensor:
    return t if case.activation == "identity" else ORACLE_ACTIVATIONS[case.activation](t, case.negative_slope)


# name -> how to break a valid case (F.conv2d then rejects it; ours must too).
BREAKAGES = {
    "kernel-larger-than-padded-input": lambda rng, c: replace(c, h=1, w=1, kh=3, kw=3, padding=0, dilation=1),
    "groups-not-dividing-channels": lambda rng, c: replace(c, groups=2, c=3, k=4),
    "negative-padding": lambda rng, c: replace(c, padding=-1),
    "zero-stride": lambda rng, c: replace(c, stride=0),
    "zero-dilation": lambda rng, c: replace(c, dilation=(1, 0)),
    "strided-same-padding": lambda rng, c: replace(c, stride=2, padding="same"),
    "unknown-padding-string": lambda rng, c: replace(c, padding="full"),
    "weight-in-channels": lambda rng, c: replace(c, overrides={"weight_in": c.c // c.groups + 1}),
    "bias-shape": lambda rng, c: replace(c, bias=True, overrides={"bias_len": c.k + 1}),
    "weight-dtype": lambda rng, c: replace(c, overrides={"weight_dtype": torch.float64 if c.dtype != torch.float64 else torch.float32}),
    "integer-input": lambda rng, c: replace(c, overrides={"int_input": True}),
    "weight-rank": lambda rng, c: replace(c, overrides={"weight_rank3": True}),
    "input-rank-5": lambda rng, c: replace(c, overrides={"input_rank5": True}),
    "unknown-activation": lambda rng, c: replace(c, activation=rng.choice(["swish", "RELU", "hardtanh"])),
    "non-finite-slope": lambda rng, c: replace(c, activation="leaky_relu", negative_slope=rng.choice([float("nan"), float("inf")])),
}


def breakage(rng: random.Random, case: Case) -> Case:
    name = rng.choice(sorted(BREAKAGES))
    return replace(BREAKAGES[name](rng, case), broken=name)


def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_last" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "strided":
        # The same values as a non-contiguous view: every other element of a tensor twice as wide.
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        return wide[..., ::2]
    return t


def tensors(case: Case, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    o = case.overrides
    weight_in = o.get("weight_in", case.c // case.groups)
    x = torch.randn(case.n, case.c, case.h, case.w, generator=gen, dtype=torch.float64)
    w = torch.randn(case.k, weight_in, case.kh, case.kw, generator=gen, dtype=torch.float64) / (weight_in * case.kh * case.kw) ** 0.5
    b = torch.randn(o.get("bias_len", case.k), generator=gen, dtype=torch.float64) if case.bias else None
    x = x.to(device, torch.int64 if o.get("int_input") else case.dtype)
    w = w.to(device, o.get("weight_dtype", case.dtype))
    b = b.to(device, case.dtype) if b is not None else None
    if o.get("weight_rank3"):
        w = w[0]
    if o.get("input_rank5"):
        x = x.unsqueeze(0)
    x, w = laid_out(x, case.layout), laid_out(w, case.layout)
    if case.input_grad and x.is_floating_point():
        x.requires_grad_()
    w.requires_grad_(w.is_floating_point())
    if b is not None:
        b.requires_grad_()
    return x, w, b


def call(fn: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, case: Case, dilation: Any = None,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """``fn`` (F.conv2d, or conv_bias2d with the case's activation and the residual, if any) on the case's conv
    parameters."""
    dilation = case.dilation if dilation is None else dilation
    extra = {"activation": case.activation, "negative_slope": case.negative_slope} if fn is conv_bias2d else {}
    if fn is conv_bias2d and residual is not None:
        extra["residual"] = residual
    return fn(x, w, b, stride=case.stride, padding=case.padding, dilation=dilation, groups=case.groups, **extra)


def residual_kind(number: int) -> str:
    """Whether case `number` adds a residual: "right" for a third of the cases, "wrong" (a residual of another shape
    than the output's) for one in nine, else "none". From the number, not the draw, so that the seed's cases stay."""
    return ("right", "none", "none", "right", "none", "wrong", "right", "none", "none")[number % 9]


def oracle_dilation(case: Case, w: torch.Tensor) -> Any:
    """The dilation F.conv2d gets on the CPU: 1 along a kernel axis of size 1, where every dilation gives the same
    convolution (ATen's CPU convolution segfaults on a larger one there with channels_last tensors, torch 2.14.1).
    Broken dilations (< 1, not a pair) are passed as they are."""
    pair = [case.dilation] * 2 if isinstance(case.dilation, int) else list(case.dilation)
    if w.dim() != 4 or len(pair) != 2 or min(pair) < 1:
        return case.dilation
    return [1 if w.shape[2 + d] == 1 else pair[d] for d in range(2)]


def oracle_leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    """What F.conv2d gets on the CPU: 16-bit tensors as float32 leaves. ATen's CPU convolution segfaults on some
    valid 16-bit problems (torch 2.14.1; see csrc/cpu/reference_kernels.cpp, whose workarounds this mirrors), which
    would end the run; in float32 the oracle gives what a float32-accumulating 16-bit convolution rounds to."""
    if t is None or t.dtype not in (torch.float16, torch.bfloat16):
        return t
    return t.detach().float().requires_grad_(t.requires_grad)


def grads(out: torch.Tensor, seed: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return list(torch.autograd.grad(out, params, seed, allow_unused=True))


def float64_oracle(case: Case, ts: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """F.conv2d in float64 on the CPU (NCHW leaves copied from the case's tensors: input, weight, bias and the
    residual, if any, added before the activation), the leaves that need grads, and the pre-activation's distance
    from the activation's kink (see `near_kink`)."""
    leaves = [t.detach().cpu().double().contiguous().requires_grad_(t.requires_grad) if t is not None else None for t in ts]
    conv = call(F.conv2d, *leaves[:3], case, oracle_dilation(case, leaves[1]))
    residual = leaves[3] if len(leaves) > 3 else None
    pre = conv if residual is None else conv + residual
    expected = activated(case, pre)
    return expected, [t for t in leaves if t is not None and t.requires_grad], near_kink(case, leaves, pre.detach())


# Rounding of the pre-activation per mode, in units of the magnitude of its terms: the storage dtype's unit
# roundoff (TF32's for tf32), and for float32 a margin for cuDNN's algorithms (Winograd, FFT).
PRE_ACTIVATION_ROUNDOFF = {"float32": 2.0**-20, "tf32": 2.0**-11, "float16": 2.0**-11, "bfloat16": 2.0**-8}
KINKED_ACTIVATIONS = {"relu", "leaky_relu"}


def near_kink(case: Case, leaves: list[torch.Tensor | None], pre: torch.Tensor) -> torch.Tensor:
    """Where the float64 pre-activation lies within rounding of relu's / leaky_relu's kink (at 0): there the case's
    dtype may land on either side, and either derivative is right. The bound is 8 roundoffs of the magnitude of the
    terms summed (|x| * |w| + |b| + |residual|, in float64), from the oracle's own tensors."""
    if case.activation not in KINKED_ACTIVATIONS:
        return torch.zeros_like(pre, dtype=torch.bool)
    x, w, b = (t.detach().abs() if t is not None else None for t in leaves[:3])
    scale = call(F.conv2d, x, w, b, case, oracle_dilation(case, w))
    if len(leaves) > 3 and leaves[3] is not None:
        scale = scale + leaves[3].detach().abs()
    roundoff = PRE_ACTIVATION_ROUNDOFF[{torch.float32: "tf32" if torch.backends.cudnn.allow_tf32 else "float32",
                                        torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(case.dtype, "float32")]
    return pre.abs() <= 8 * roundoff * scale


def record_path(case: Case, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, grad_output: torch.Tensor,
                coverage: dict[str, int], residual: torch.Tensor | None = None) -> None:
    """What a valid CUDA case ran: a cuDNN graph for the forward, the conv_wgrad graph, our bias kernel (and, with a
    residual, whether it was added in the graph)."""
    if residual is not None:
        info = torch_convbias.explain(x.detach(), w.detach(), b.detach() if b is not None else None, stride=case.stride,
                                      padding=case.padding, dilation=case.dilation, groups=case.groups,
                                      activation=case.activation, negative_slope=case.negative_slope,
                                      residual=residual.detach())  # fmt: skip
        coverage["residual_cases"] += 1
        coverage["residual_graph"] += bool(info["residual"]["fused"])
    info = torch_convbias.explain(x.detach(), w.detach(), b.detach() if b is not None else None, stride=case.stride,
                                  padding=case.padding, dilation=case.dilation, groups=case.groups)  # fmt: skip
    coverage["graph_forward"] += info["path"] != "aten"
    if case.activation != "identity":
        info = torch_convbias.explain(x.detach(), w.detach(), b.detach() if b is not None else None, stride=case.stride,
                                      padding=case.padding, dilation=case.dilation, groups=case.groups,
                                      activation=case.activation, negative_slope=case.negative_slope)  # fmt: skip
        coverage["activation_cases"] += 1
        coverage["activation_epilogue"] += bool(info["activation"]["fused"])
    if isinstance(case.padding, str) and case.padding != "valid":
        return  # 'same' may pad the input first: param_grad then sees another input than this one
    grad = torch_convbias.explain_param_grad(grad_output, x.detach(), w.detach(), stride=case.stride,
                                             padding=0 if case.padding == "valid" else case.padding,
                                             dilation=case.dilation, groups=case.groups)  # fmt: skip
    coverage["graph_weight_grad"] += grad["weight_grad"]["path"] == "cudnn graph"
    coverage["bias_kernel"] += b is not None and grad["bias_grad"]["way"] == "kernel"


def run_case(number: int, case: Case, device: str, dtypes: dict[torch.dtype, str],
             coverage: dict[str, int] | None = None) -> str:
    """Checks one case; returns 'valid' or 'rejected' for the counts, and adds a valid CUDA case's paths to
    `coverage`."""
    gen = torch.Generator().manual_seed(SEED + number)
    x, w, b = tensors(case, device, gen)
    ox, ow, ob = (oracle_leaf(t) for t in (x, w, b)) if device == "cpu" else (x, w, b)
    kind = residual_kind(number)
    try:
        if case.broken in ATEN_LENIENT_BREAKAGES | ACTIVATION_BREAKAGES:
            raise ValueError(f"{case.broken} is invalid, whatever F.conv2d does with it")
        probe = call(F.conv2d, ox, ow, ob, case, oracle_dilation(case, w) if device == "cpu" else None)
    except Exception:  # noqa: BLE001 - whatever F.conv2d rejects, ours must reject with its own error
        # With a residual too (of no particular shape: the call is invalid before it matters).
        stray = torch.zeros(1, device=device, dtype=case.dtype) if kind != "none" else None
        with pytest.raises(OUR_ERRORS) as info:
            call(conv_bias2d, x, w, b, case, residual=stray)
        message = str(info.value)
        assert message.startswith(("convbias", "conv_bias2d")), f"case {number} {case}: unclear error: {message}"
        return "rejected"
    residual = None
    if kind != "none":
        shape = list(probe.shape)
        shape[1] += kind == "wrong"
        residual = laid_out(torch.randn(shape, generator=gen, dtype=torch.float64).to(device, case.dtype), case.layout)
        if kind == "wrong":
            with pytest.raises(ValueError, match=r"convbias.forward_residual: expected `residual` of shape"):
                call(conv_bias2d, x, w, b, case, residual=residual)
            return "rejected"
        residual.requires_grad_(case.input_grad)
    del probe
    mode = MODES[dtypes[case.dtype]]
    expected, leaves, kink = float64_oracle(case, (x, w, b, residual))
    actual = call(conv_bias2d, x, w, b, case, residual=residual)
    assert actual.shape == expected.shape and actual.dtype == case.dtype, f"case {number} {case}: {actual.dtype}"
    assert_close(actual.detach().cpu().double(), expected.detach(), mode, f"case {number} {case}: output")
    named = (("input", x), ("weight", w), ("bias", b), ("residual", residual))
    names = [name for name, t in named if t is not None and t.requires_grad]
    ours = [t for _, t in named if t is not None and t.requires_grad]
    # grad_output in the output's own layout (as autograd hands it over in a model), rounded to the case's dtype.
    # Zero where the pre-activation is within rounding of a kink: there either side's derivative is right, and a
    # flip (seen: fp16, leaky_relu, case 315 at c5d0a69) moves a whole output channel's weight gradient.
    seed = torch.empty_like(actual).copy_(torch.randn(expected.shape, generator=gen, dtype=torch.float64).masked_fill(kink, 0))
    for name, got, want in zip(names, grads(actual, seed, ours), grads(expected, seed.cpu().double(), leaves)):
        assert_close(got.cpu().double() if got is not None else None, want, mode, f"case {number} {case}: grad {name}")
    if coverage is not None and device == "cuda":
        record_path(case, x, w, b, seed, coverage, residual)
    return "valid"


def pair(value: Any) -> list[int]:
    return [value, value] if isinstance(value, int) else list(value)


def run_param_grad_case(number: int, case: Case, device: str, dtypes: dict[torch.dtype, str]) -> str:
    """``convbias.param_grad`` called directly with a case's tensors and a grad_output that is right or, for half
    of the cases, of a wrong shape or dtype. Right calls (the forward valid for F.conv2d, numeric padding) must
    match ATen's convolution_backward; wrong ones must raise our own ValueError/TypeError."""
    if case.padding == "valid":
        case = replace(case, padding=0)  # the same convolution; the op takes numbers only
    gen = torch.Generator().manual_seed(SEED + number)
    x, w, _ = tensors(case, device, gen)
    x, w = x.detach(), w.detach()
    numeric = not isinstance(case.padding, str)
    try:
        if not numeric:
            raise ValueError("padding strings are conv_bias2d's, not the op's")
        if case.broken in ATEN_LENIENT_BREAKAGES:
            raise ValueError(f"{case.broken} is invalid, whatever F.conv2d does with it")
        out_shape = list(F.conv2d(oracle_leaf(x), oracle_leaf(w), None, case.stride, case.padding, oracle_dilation(case, w), case.groups).shape)
        forward_valid = True
    except Exception:  # noqa: BLE001 - an invalid forward makes every param_grad call invalid
        forward_valid, out_shape = False, [case.n, case.k, max(case.h, 1), max(case.w, 1)]
    flaw = ["none", "none", "shape", "dtype"][int(torch.randint(4, (1,), generator=gen))]
    if flaw == "shape":
        out_shape = [*out_shape[:-1], out_shape[-1] + 1]
    dtype = case.dtype if flaw != "dtype" else (torch.float64 if case.dtype != torch.float64 else torch.float32)
    grad_output = laid_out(torch.randn(out_shape, generator=gen, dtype=torch.float64).to(device, dtype), case.layout)
    args = (grad_output, x, w, pair(case.stride), pair(case.padding) if numeric else [0, 0], pair(case.dilation), case.groups, [True, True])
    if not (forward_valid and numeric and flaw == "none"):
        if not numeric:
            return "skipped"
        with pytest.raises(OUR_ERRORS) as info:
            torch.ops.convbias.param_grad(*args)
        assert str(info.value).startswith("convbias"), f"case {number} {case} ({flaw}): unclear error: {info.value}"
        return "rejected"
    grad_weight, grad_bias = torch.ops.convbias.param_grad(*args)
    # The oracle: float64 on the CPU, NCHW.
    cpu64 = [t.detach().cpu().double().contiguous() for t in (grad_output, x, w)]
    ref = torch.ops.aten.convolution_backward(
        *cpu64, [case.k], pair(case.stride), pair(case.padding), oracle_dilation(case, w), False, [0, 0], case.groups,
        [False, True, True],
    )  # fmt: skip
    mode = MODES[dtypes[case.dtype]]
    assert_close(grad_weight.cpu().double(), ref[1], mode, f"case {number} {case}: param_grad weight")
    assert_close(grad_bias.cpu().double(), ref[2], mode, f"case {number} {case}: param_grad bias")
    return "valid"


def fuzz(device: str, dtypes: dict[torch.dtype, str], check: Any = run_case,
         coverage: dict[str, int] | None = None) -> dict[str, int]:
    rng = random.Random(SEED)
    counts = {"valid": 0, "rejected": 0, "skipped": 0}
    for number in range(CASES):
        case = draw(rng, dtypes, device)
        with math_mode(MODES[dtypes[case.dtype]]):
            if coverage is None:
                counts[check(number, case, device, dtypes)] += 1
            else:
                counts[check(number, case, device, dtypes, coverage)] += 1
    return counts


def test_fuzz_cpu(record_property: Any) -> None:
    counts = fuzz("cpu", CPU_DTYPES)
    record_property("fuzz_counts", counts)
    print(f"fuzz cpu: {CASES} cases, {counts}")
    # Both kinds drawn in numbers, so neither side of the property went untested.
    assert counts["valid"] >= CASES * 2 // 5 and counts["rejected"] >= CASES // 10, counts


@pytest.mark.parametrize("device", DEVICES)
def test_fuzz_param_grad(device: str, record_property: Any) -> None:
    counts = fuzz(device, CPU_DTYPES if device == "cpu" else CUDA_DTYPES, check=run_param_grad_case)
    record_property("fuzz_counts", counts)
    print(f"fuzz param_grad {device}: {CASES} cases, {counts}")
    assert counts["valid"] >= CASES // 8 and counts["rejected"] >= CASES // 4, counts


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_fuzz_cuda(record_property: Any) -> None:
    coverage = {"graph_forward": 0, "graph_weight_grad": 0, "bias_kernel": 0, "activation_cases": 0,
                "activation_epilogue": 0, "residual_cases": 0, "residual_graph": 0}
    counts = fuzz("cuda", CUDA_DTYPES, coverage=coverage)
    record_property("fuzz_counts", {**counts, **coverage})
    print(f"fuzz cuda: {CASES} cases, {counts}, paths of the valid ones: {coverage}")
    assert counts["valid"] >= CASES * 2 // 5 and counts["rejected"] >= CASES // 10, counts
    # The cases exercise our code, not ATen's: graphs for at least half of the valid ones, our bias kernel a fifth.
    assert coverage["graph_forward"] >= counts["valid"] // 2, coverage
    assert coverage["graph_weight_grad"] >= counts["valid"] // 4, coverage
    assert coverage["bias_kernel"] >= counts["valid"] // 5, coverage
    # Activations drawn in numbers, and some of them run in the forward graph's epilogue.
    assert coverage["activation_cases"] >= counts["valid"] // 4 and coverage["activation_epilogue"] > 0, coverage
    # Residuals drawn in numbers (whether a precompiled engine runs their graph is recorded, not required).
    assert coverage["residual_cases"] >= counts["valid"] // 5, coverage


# Problems on which ATen's CPU convolution (torch 2.14.1) segfaults, found by the fuzzing above: ours must run
# them (csrc/cpu/reference_kernels.cpp, csrc/autograd.cpp) and match a float64 NCHW oracle.
CRASHERS = {
    "channels-last-dilated-unit-kernel-fp32": (torch.float32, "channels_last", (3, 3, 5, 1), (3, 3, 3, 1), (1, 2), (0, 1), (1, 2)),
    "channels-last-dilated-unit-kernel-bf16": (torch.bfloat16, "channels_last", (3, 3, 5, 1), (3, 3, 3, 1), (1, 2), (0, 1), (1, 2)),
    "bf16-nchw-dilation-3": (torch.bfloat16, "contiguous", (1, 2, 2, 7), (2, 2, 4, 3), (1, 1), (4, 3), (3, 3)),
    "bf16-input-grad-dilation-3": (torch.bfloat16, "contiguous", (1, 3, 1, 10), (3, 3, 2, 2), (1, 1), (2, 0), (3, 3)),
}


@pytest.mark.parametrize("name", sorted(CRASHERS))
def test_cpu_problems_that_crash_aten_run(name: str) -> None:
    dtype, layout, x_shape, w_shape, stride, padding, dilation = CRASHERS[name]
    gen = torch.Generator().manual_seed(0)
    x64, w64, b64 = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in (x_shape, w_shape, (w_shape[0],)))
    x, w, b = (laid_out(t.to(dtype), layout).requires_grad_() for t in (x64, w64, b64))
    out = conv_bias2d(x, w, b, stride=stride, padding=padding, dilation=dilation)
    # The oracle: float64, NCHW, and dilation 1 along kernel axes of size 1 (the same convolution).
    unit = [1 if w_shape[2 + d] == 1 else dilation[d] for d in range(2)]
    refs = [t.detach().double().contiguous().requires_grad_() for t in (x, w, b)]
    expected = F.conv2d(*refs, stride=stride, padding=padding, dilation=unit)
    mode = MODES[{torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]]
    assert_close(out.detach(), expected.detach().to(dtype), mode, f"{name}: output")
    seed = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    for t_name, got, want in zip(("input", "weight", "bias"), grads(out, seed.to(dtype), [x, w, b]), grads(expected, seed, refs)):
        assert_close(got, want.to(dtype), mode, f"{name}: grad {t_name}")


def test_near_kink_marks_only_what_rounding_can_flip() -> None:
    """The gradient seed is zeroed only within rounding of relu's kink: a pre-activation a roundoff from zero is
    marked, a unit away is not, and smooth activations have no kink."""
    case = Case(n=1, c=1, h=1, w=4, k=1, kh=1, kw=1, groups=1, stride=1, padding=0, dilation=1, dtype=torch.float16,
                layout="contiguous", bias=True, input_grad=False, activation="relu")  # fmt: skip
    x = torch.tensor([[[[1.0, 1.0, 1.0, 1.0]]]], dtype=torch.float64)
    w = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    b = torch.zeros(1, dtype=torch.float64)
    pre = torch.tensor([[[[1e-4, -1e-4, 1.0, -0.5]]]], dtype=torch.float64)
    assert near_kink(case, [x, w, b], pre).flatten().tolist() == [True, True, False, False]
    assert not near_kink(replace(case, activation="gelu"), [x, w, b], pre).any()
