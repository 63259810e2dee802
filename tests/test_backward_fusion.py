"""The convbias backend's activation-backward pass (torch_convbias/_backward_fusion.py): in the backward graph Inductor
compiles, ``convbias._activation_backward`` becomes ATen's derivative and a bias sum where the incoming gradient is
computed by Inductor's own code (a max-pool's backward), so that one generated kernel does both; where it is our own
input gradient (a convolution directly above), the two merge into ``convbias._input_grad_activation``; where it is
the graph's input, our kernel stays.

On the CPU (``convbias.devices`` including "cpu", Inductor's C++ backend): which nodes are handed over (the pass's
report, and the generated code's calls of the op), and every gradient against the same model run eagerly in float64
(an oracle independent of both the op and Inductor). On CUDA (skipped without a GPU): the same in bfloat16 against
the eager model.
"""

from __future__ import annotations

import copy
import operator
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import cuda
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

import torch_convbias
from torch_convbias import compiler

CPU = ("cpu", "cuda")
OP_CALL = re.compile(r"torch\.ops\.convbias\._activation_backward\.default\(")
MERGED_CALL = re.compile(r"torch\.ops\.convbias\._input_grad_activation\.default\(")


@pytest.fixture(autouse=True)
def fresh_compiles() -> Iterator[None]:
    """The pass reports when Inductor compiles a backward graph: no graph may come from Inductor's caches."""
    torch._dynamo.reset()
    compiler.reports.clear()
    compiler.backward_reports.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def pooled_network(activation: Callable[[], nn.Module] = nn.ReLU, bias: bool = True) -> nn.Sequential:
    """Three convolutions with an activation each: the first and third followed by a max-pool (the gradient reaching
    their activation is the pool's backward), the second by the third convolution (its input gradient)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=bias),
        activation(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1, bias=bias),
        activation(),
        nn.Conv2d(8, 8, 3, padding=1, bias=bias),
        activation(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 2 * 2, 5),
    )


def train_against_float64(
    model: nn.Module, compiled: Any, x: torch.Tensor, tol: float = 1e-4, capture: bool = True
) -> list[str]:
    """One forward and backward of ``compiled`` (gradients of the input and every parameter) against a float64 eager
    copy of ``model``; returns the code Inductor generated for it (with ``capture``, which resets Dynamo first: the
    call compiles anew; without it, nothing)."""
    reference = copy.deepcopy(model).double()
    x64 = x.detach().double().requires_grad_()
    x32 = x.detach().clone().requires_grad_()
    expected = reference(x64)
    seed = torch.randn_like(expected)
    expected.backward(seed)

    def step() -> torch.Tensor:
        actual = compiled(x32)
        actual.backward(seed.to(actual.dtype))
        return actual

    actual, code = run_and_get_code(step) if capture else (step(), [])
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=tol, atol=tol)
    for (name, p), p64 in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.double(), p64.grad, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")
    return code


def op_calls(code: list[str], pattern: re.Pattern[str] = OP_CALL) -> int:
    """How many times the generated code calls our activation-backward kernel (or, with MERGED_CALL, the op it is
    merged into with the input gradient)."""
    return sum(len(pattern.findall(source)) for source in code)


def compile_with(model: nn.Module, policy: str | None = None, **kwargs: Any) -> Any:
    options: dict[str, Any] = {"convbias.devices": CPU}
    if policy is not None:
        options["convbias.activation_backward"] = policy
    return torch.compile(model, backend="convbias", options=options, fullgraph=True, **kwargs)


def test_auto_hands_over_the_activations_below_a_pool_and_merges_the_one_below_a_convolution() -> None:
    torch.manual_seed(0)
    model = pooled_network()
    code = train_against_float64(model, compile_with(model), torch.randn(2, 3, 8, 8))
    assert compiler.reports[-1].count(activation="relu") == 3
    (report,) = compiler.backward_reports
    assert len(report.handed) == 2 and len(report.merged) == 1 and report.kept == [], report
    # The next convolution's input gradient (convbias._input_grad) and this derivative: one op.
    assert "into convbias._input_grad_activation" in report.merged[0]["reason"], report
    assert all("Inductor generates code for" in entry["reason"] for entry in report.handed), report
    assert op_calls(code) == 0 and op_calls(code, MERGED_CALL) == 1


def test_a_gradient_that_is_the_graph_input_keeps_our_kernel() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
    code = train_against_float64(model, compile_with(model), torch.randn(2, 3, 6, 6))
    (report,) = compiler.backward_reports
    assert report.handed == [] and len(report.kept) == 1
    assert "an input of the backward graph" in report.kept[0]["reason"]
    assert op_calls(code) == 1


ACTIVATIONS = {
    "relu": nn.ReLU,
    "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "leaky_relu_negative": lambda: nn.LeakyReLU(-0.2),
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_a_convolution_directly_above_an_activation_merges_for_every_activation(name: str) -> None:
    """conv -> act -> conv -> act: the lower activation's backward takes the upper convolution's input gradient and
    nothing else does, so the two are one _input_grad_activation (the top one's gradient is the graph's input: kept);
    every gradient equals float64 autograd of nn.Conv2d + the activation."""
    torch.manual_seed(0)
    act = ACTIVATIONS[name]
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), act(), nn.Conv2d(8, 4, 3, padding=1, stride=2), act())
    code = train_against_float64(model, compile_with(model), torch.randn(2, 3, 7, 6))
    (report,) = compiler.backward_reports
    assert len(report.merged) == 1 and len(report.kept) == 1 and report.handed == [], report
    assert op_calls(code) == 1 and op_calls(code, MERGED_CALL) == 1
    # The merged op's problem, for explain_input_grad_activation (bench_models' merged_paths): the upper convolution.
    slope = report.merged[0]["problem"].pop("negative_slope")
    assert report.merged[0]["problem"] == {
        "grad_output": [2, 4, 4, 3], "input": [2, 8, 7, 6], "weight": [4, 8, 3, 3], "stride": [2, 2],
        "padding": [1, 1], "dilation": [1, 1], "groups": 1,
    }, report  # fmt: skip
    assert slope == (model[1].negative_slope if isinstance(model[1], nn.LeakyReLU) else 0.01)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_every_activation_handed_to_inductor_matches_float64(name: str) -> None:
    """Policy "inductor": every activation's backward becomes ATen's derivative (from the output or the
    pre-activation, as the forward kept it); gradients equal float64 autograd of nn.Conv2d + the activation."""
    torch.manual_seed(0)
    model = pooled_network(ACTIVATIONS[name])
    code = train_against_float64(model, compile_with(model, "inductor"), torch.randn(2, 3, 8, 8))
    assert compiler.reports[-1].count() == 3 and compiler.reports[-1].count(activation="identity") == 0
    (report,) = compiler.backward_reports
    assert len(report.handed) == 3 and report.kept == []
    assert op_calls(code) == 0


def test_policy_ours_keeps_every_activation_on_our_kernel() -> None:
    torch.manual_seed(0)
    model = pooled_network()
    code = train_against_float64(model, compile_with(model, "ours"), torch.randn(2, 3, 8, 8))
    assert len(compiler.backward_reports) == 0  # the pass is not installed at all
    assert op_calls(code) == 3


def test_bias_free_convolutions_hand_over_the_derivative_alone() -> None:
    torch.manual_seed(0)
    model = pooled_network(bias=False)
    code = train_against_float64(model, compile_with(model), torch.randn(2, 3, 8, 8))
    (report,) = compiler.backward_reports
    assert len(report.handed) == 2 and len(report.merged) == 1 and report.kept == []
    assert op_calls(code) == 0 and op_calls(code, MERGED_CALL) == 1


class PooledResidual(nn.Module):
    """relu(conv(x) + x), then a max-pool: the residual op's activation backward sits below the pool."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return self.pool(torch.relu(self.conv(y) + y)).sum((2, 3))


def test_residual_block_below_a_pool_is_handed_over() -> None:
    torch.manual_seed(0)
    model = PooledResidual()
    code = train_against_float64(model, compile_with(model), torch.randn(2, 3, 8, 8))
    assert compiler.reports[-1].count(residual=True) == 1
    (report,) = compiler.backward_reports
    assert [entry["activation"] for entry in report.handed] == ["relu"] and report.kept == []
    assert op_calls(code) == 0


def test_dynamic_batch_sizes_share_one_handed_over_graph() -> None:
    torch.manual_seed(0)
    model = pooled_network()
    compiled = compile_with(model, dynamic=True)
    for batch in (2, 3, 5):
        model.zero_grad(set_to_none=True)
        train_against_float64(model, compiled, torch.randn(batch, 3, 8, 8), capture=False)
    assert len(compiler.reports) == 1
    (report,) = compiler.backward_reports  # one backward graph for every batch size
    assert len(report.handed) == 2
    assert len(report.merged) == 1 and report.merged[0]["problem"] is None  # a symbolic batch: no static problem


class CountingPass(CustomGraphPass):
    """A caller's own post-grad pre-pass: counts the graphs it is given."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1

    def uuid(self) -> Any:
        return "counting"


def test_a_callers_post_grad_pass_still_runs() -> None:
    torch.manual_seed(0)
    model = pooled_network()
    theirs = CountingPass()
    compiled = torch.compile(
        model, backend="convbias", options={"convbias.devices": CPU, "post_grad_custom_pre_pass": theirs}
    )
    train_against_float64(model, compiled, torch.randn(2, 3, 8, 8))
    assert theirs.graphs == 2  # the forward and the backward graph
    assert len(compiler.backward_reports) == 1


def test_unknown_policy_is_refused_naming_the_option() -> None:
    model = pooled_network()
    compiled = compile_with(model, "triton")
    with pytest.raises(Exception, match=r"convbias\.activation_backward.*'auto', 'ours', 'inductor'|convbias\.activation_backward.*auto, ours, inductor"):
        compiled(torch.randn(2, 3, 8, 8))


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=cuda)])
def test_bfloat16_pooled_network_hands_over_and_matches_our_kernel(device: str) -> None:
    """channels_last bfloat16: the pooled activations' backward fused by Inductor; every gradient equal, to bfloat16
    rounding, to the same compiled model's with our kernel kept ('ours'). The forward is the same kernels on both
    sides, so every max-pool picks the same element and only the handed-over derivative differs. (Elementwise against
    eager nn.Conv2d this does not hold in bfloat16: a max-pool whose inputs differ by one rounding picks another element
    and the gradient moves with it; on the H200, 9 of 576 elements of a weight gradient did.)"""
    torch.manual_seed(0)
    options = {"convbias.devices": CPU} if device == "cpu" else {}  # CUDA: the backend's default devices
    model = pooled_network().to(device, torch.bfloat16).to(memory_format=torch.channels_last)
    kept = copy.deepcopy(model)
    x = torch.randn(8, 3, 8, 8, device=device, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    expected = kept(x)
    with_our_kernel = torch.compile(
        kept, backend="convbias", options={**options, "convbias.activation_backward": "ours"}
    )
    _, code = run_and_get_code(lambda: with_our_kernel(x).float().square().sum().backward())
    assert len(compiler.backward_reports) == 0  # 'ours': the pass is not installed
    assert op_calls(code) == 3
    compiled = torch.compile(model, backend="convbias", options=options)

    def step() -> torch.Tensor:
        out = compiled(x)
        out.float().square().sum().backward()
        return out

    actual, code = run_and_get_code(step)
    (report,) = compiler.backward_reports
    # The middle activation's gradient is the next convolution's input gradient (convbias._input_grad): merged.
    assert len(report.handed) == 2 and len(report.merged) == 1 and report.kept == [], report
    assert op_calls(code) == 0 and op_calls(code, MERGED_CALL) == 1, report
    torch.testing.assert_close(actual, expected, rtol=3e-2, atol=3e-2)
    for (name, p), reference in zip(model.named_parameters(), kept.parameters()):
        g = reference.grad
        tolerance = 3e-2 * max(1.0, g.abs().max().item())
        torch.testing.assert_close(p.grad, g, rtol=3e-2, atol=tolerance, msg=lambda m, name=name: f"{name}: {m}")


def test_a_derivative_that_fails_to_trace_keeps_our_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tracing ATen's derivative failing (here forced) is never the user's problem: our kernel stays, and says why."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("forced for the test")

    monkeypatch.setattr(torch_convbias._backward_fusion, "derivative", broken)
    torch.manual_seed(0)
    model = pooled_network()
    code = train_against_float64(model, compile_with(model, "inductor"), torch.randn(2, 3, 8, 8))
    (report,) = compiler.backward_reports
    assert report.handed == [] and len(report.kept) == 3
    assert all("could not trace ATen's derivative (RuntimeError: forced for the test)" in e["reason"] for e in report.kept)
    assert op_calls(code) == 3


@pytest.mark.parametrize(
    ("use", "bias_grad", "reason"),
    [
        ("whole", True, "not an element of its result"),  # the op's result tuple itself escapes: nothing to rewire it to
        ("bias", False, "reads a bias gradient"),  # a graph reading a bias gradient the op was not asked for
    ],
)
def test_uses_other_than_the_ops_two_results_keep_our_kernel(use: str, bias_grad: bool, reason: str) -> None:
    """Graphs Inductor would not give the pass, built by hand: the pass leaves them as they are and says why."""
    graph = torch.fx.Graph()
    grad, saved = graph.placeholder("grad"), graph.placeholder("saved")
    node = graph.call_function(torch.ops.convbias._activation_backward.default, (grad, saved, "relu", 0.01, bias_grad))
    graph.output(node if use == "whole" else graph.call_function(operator.getitem, (node, 1)))
    torch_convbias._backward_fusion.ActivationBackwardPass("inductor")(graph)
    (report,) = compiler.backward_reports
    assert report.handed == [] and len(report.kept) == 1 and reason in report.kept[0]["reason"], report
    assert node in graph.nodes


def test_an_input_gradient_used_elsewhere_is_not_merged() -> None:
    """A hand-built graph where the input gradient is also an output of the graph: merging would lose it, so the
    activation backward stays our kernel and the report says what else uses the gradient."""
    graph = torch.fx.Graph()
    dy, x, w, saved = (graph.placeholder(name) for name in ("dy", "x", "w", "saved"))
    grad = graph.call_function(torch.ops.convbias._input_grad.default, (dy, x, w, [1, 1], [1, 1], [1, 1], 1))
    node = graph.call_function(torch.ops.convbias._activation_backward.default, (grad, saved, "relu", 0.01, True))
    graph.output((graph.call_function(operator.getitem, (node, 0)), grad))
    torch_convbias._backward_fusion.ActivationBackwardPass("auto")(graph)
    (report,) = compiler.backward_reports
    assert report.merged == [] and len(report.kept) == 1, report
    assert f"the input gradient {grad.name} is also used by output" in report.kept[0]["reason"], report
    assert node in graph.nodes and grad in graph.nodes


def test_identity_handed_over_is_the_gradient_itself_and_its_sum() -> None:
    """The op called directly with activation "identity" (the C++ autograd never does): the pass sees it in any graph
    Inductor compiles; handed over, dz is g (a copy in the op's layout) and the bias gradient g summed over N, H, W."""

    def f(g: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.convbias._activation_backward(g, y, "identity", 0.01, True)

    g = torch.randn(2, 4, 3, 3).contiguous(memory_format=torch.channels_last)
    y = torch.randn(2, 4, 3, 3).contiguous(memory_format=torch.channels_last)
    compiled = torch.compile(f, backend="convbias", options={"convbias.activation_backward": "inductor"}, fullgraph=True)
    (grad_z, grad_bias), code = run_and_get_code(compiled, g, y)
    (report,) = compiler.backward_reports
    assert [entry["activation"] for entry in report.handed] == ["identity"] and op_calls(code) == 0
    torch.testing.assert_close(grad_z, g, rtol=0, atol=0)
    assert grad_z.is_contiguous(memory_format=torch.channels_last) and grad_z.data_ptr() != g.data_ptr()
    torch.testing.assert_close(grad_bias.double(), g.double().sum((0, 2, 3)), rtol=1e-6, atol=1e-6)
