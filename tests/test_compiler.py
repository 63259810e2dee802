"""The "convbias" torch.compile backend (torch_convbias.compiler): registration, which convolutions it rewrites and
which it leaves alone (counted in the graph it hands on), and that compiled models match eager nn.Conv2d models in
the forward and every gradient.

CPU convolutions are rewritten only with ``convbias.devices`` including "cpu" (the op's CPU reference path); the
oracle is the same model run eagerly in float64. The compiled graphs go to ``aot_eager`` (AOTAutograd without
Inductor, quick on a CPU) except where Inductor itself is under test.
"""

from __future__ import annotations

import copy
import operator
import os
import subprocess
import sys
import tomllib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import HAS_CUDA, cuda
from torch import nn

import torch_convbias
from torch_convbias import compiler

ROOT = Path(__file__).resolve().parents[1]
CPU_OPTIONS = {"convbias.devices": ("cpu", "cuda"), "convbias.inner": "aot_eager"}


class Recorder:
    """An inner backend that keeps the rewritten graphs it is given, then runs them through aot_eager."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(copy.deepcopy(gm))
        return lookup_backend("aot_eager")(gm, example_inputs)

    def ops(self, name: str = "forward") -> list[torch.fx.Node]:
        """The convbias op nodes of every graph recorded."""
        packet = getattr(torch.ops.convbias, name)
        targets = (packet, packet.default)  # Dynamo records a ConvBias2d's call by the packet
        return [n for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]

    def conv2d_nodes(self) -> list[torch.fx.Node]:
        return [n for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function" and n.target in (torch.conv2d, torch.nn.functional.conv2d)]


def compile_recorded(model: nn.Module, devices: tuple[str, ...] = ("cpu", "cuda"), **options: Any) -> tuple[Any, Recorder]:
    torch._dynamo.reset()
    recorder = Recorder()
    opts = {"convbias.devices": devices, "convbias.inner": recorder, **options}
    return torch.compile(model, backend="convbias", options=opts, fullgraph=True), recorder


def check_against_float64(model: nn.Module, compiled: Any, x: torch.Tensor, *, grads: bool = True, tol: float = 1e-4) -> None:
    """Forward and (with ``grads``) every parameter and input gradient of ``compiled`` equal the float64 eager run
    of a copy of ``model``."""
    model.zero_grad(set_to_none=True)
    reference = copy.deepcopy(model).double()
    x64 = x.detach().double().requires_grad_(grads)
    x32 = x.detach().clone().requires_grad_(grads)
    expected = reference(x64)
    actual = compiled(x32)
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol)
    if not grads:
        return
    seed = torch.randn_like(expected)
    expected.backward(seed)
    actual.backward(seed.to(actual.dtype))
    torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=tol, atol=tol)
    for (name, p), p64 in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.double(), p64.grad, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def activation_stack() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding="same", dilation=2),
        nn.GELU(approximate="tanh"),
        nn.Conv2d(8, 8, 3, padding=1, groups=4),
        nn.SiLU(),
        nn.Conv2d(8, 8, 1, bias=False),
        nn.LeakyReLU(0.2),
        nn.Conv2d(8, 8, 3, stride=2, padding=(1, 0)),
        nn.GELU(),
        nn.Conv2d(8, 8, 1),
        nn.Sigmoid(),
        nn.Conv2d(8, 8, 1),
        nn.Tanh(),
        nn.Conv2d(8, 4, 3),
    )


def test_backend_is_registered_and_declared_as_entry_point() -> None:
    assert "convbias" in torch._dynamo.list_backends()
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["torch_dynamo_backends"]
    assert entry_points == {"convbias": "torch_convbias.compiler:convbias_backend"}


def test_installed_entry_point_finds_the_backend_without_importing_the_package(tmp_path: Path) -> None:
    """As for an installed package: a distribution on the path declares the entry point (pyproject's), Dynamo lists
    the backend before torch_convbias is imported, and torch.compile(backend="convbias") loads it through the entry
    point (whose import of torch_convbias must then leave the registration to Dynamo)."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["torch_dynamo_backends"]
    info = tmp_path / "torch_convbias-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_convbias\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[torch_dynamo_backends]\n" + "".join(f"{name} = {target}\n" for name, target in declared.items())
    )
    script = (
        "import sys, torch\n"
        "assert 'convbias' in torch._dynamo.list_backends()\n"
        "assert 'torch_convbias' not in sys.modules\n"
        "m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())\n"
        "opts = {'convbias.devices': ('cpu', 'cuda'), 'convbias.inner': 'aot_eager'}\n"
        "y = torch.compile(m, backend='convbias', options=opts)(torch.randn(1, 3, 6, 6))\n"
        "import torch_convbias.compiler as c\n"
        "from torch._dynamo.backends.registry import lookup_backend\n"
        "assert lookup_backend('convbias') is c.convbias_backend\n"
        "assert c.reports[-1].count(activation='relu') == 1, c.reports\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_every_activation_fused_and_matches_float64_eager() -> None:
    torch.manual_seed(0)
    model = activation_stack()
    compiled, recorder = compile_recorded(model)
    check_against_float64(model, compiled, torch.randn(2, 3, 12, 12))
    ops = recorder.ops()
    assert [n.args[7] for n in ops] == ["relu", "gelu_tanh", "silu", "leaky_relu", "gelu", "sigmoid", "tanh", "identity"]
    assert ops[3].args[2] is None and ops[3].args[8] == pytest.approx(0.2)  # the bias-free conv fused with LeakyReLU
    assert ops[1].args[4] == [2, 2] and ops[1].args[5] == [2, 2]  # padding='same' resolved (dilation 2)
    assert ops[2].args[6] == 4 and ops[4].args[3] == [2, 2]
    assert recorder.conv2d_nodes() == []
    report = compiler.reports[-1]
    assert report.count() == 8 and report.count(activation="relu") == 1 and report.skipped == []


def test_functional_and_method_activations_are_fused() -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3), nn.Conv2d(8, 8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.a(x))
            x = self.b(x).sigmoid()
            return torch.nn.functional.leaky_relu(self.c(x), 0.3)

    torch.manual_seed(0)
    model = Functional()
    compiled, recorder = compile_recorded(model)
    check_against_float64(model, compiled, torch.randn(2, 3, 10, 10))
    assert [(n.args[7], n.args[8]) for n in recorder.ops()] == [("relu", 0.01), ("sigmoid", 0.01), ("leaky_relu", pytest.approx(0.3))]


def test_conv_output_used_elsewhere_keeps_the_activation_separate() -> None:
    """A residual use of the convolution's output: the conv + bias is rewritten, the ReLU stays a separate node."""

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return torch.relu(y) + y

    torch.manual_seed(0)
    model = Residual()
    compiled, recorder = compile_recorded(model)
    check_against_float64(model, compiled, torch.randn(2, 4, 8, 8))
    assert [n.args[7] for n in recorder.ops()] == ["identity"]
    assert any(n.target is torch.relu for gm in recorder.graphs for n in gm.graph.nodes)
    assert any("other users" in s["reason"] for s in compiler.reports[-1].skipped)


def test_hooks_that_change_or_keep_the_conv_output_are_respected() -> None:
    """A forward pre-hook on the activation that changes its input, and a forward hook on the convolution that keeps
    its output: neither pair is fused (what the hooks see and do is unchanged); the convolutions still are."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Conv2d(6, 6, 3), nn.ReLU())
    model[1].register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
    seen: list[torch.Tensor] = []
    model[2].register_forward_hook(lambda module, args, output: seen.append(output.detach()))
    compiled, recorder = compile_recorded(model)
    check_against_float64(model, compiled, torch.randn(2, 3, 10, 10))
    assert [n.args[7] for n in recorder.ops()] == ["identity", "identity"]
    assert len(seen) >= 2  # the hook ran in the compiled model too


def test_an_activation_after_conv_bias2d_is_fused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(torch_convbias.ConvBias2d(3, 8, 3, padding=1), nn.GELU(), torch_convbias.ConvBias2d(8, 4, 3))
    compiled, recorder = compile_recorded(model)
    check_against_float64(model, compiled, torch.randn(2, 3, 9, 9))
    assert [n.args[7] if len(n.args) > 7 else "identity" for n in recorder.ops()] == ["gelu", "identity"]
    assert compiler.reports[-1].count() == 1


# The asymmetric padding='same' case is the point of the test; nn.Conv2d's own warning about it is expected.
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")
def test_unsupported_convolutions_are_left_alone() -> None:
    """float64, a CPU model with the default devices (CUDA only), a bias-free conv with nothing to fuse, and
    padding='same' needing asymmetric padding: no rewrite, each with its reason."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).double()
    compiled, recorder = compile_recorded(model)
    compiled(torch.randn(1, 3, 8, 8, dtype=torch.float64))
    assert recorder.ops() == [] and "dtype torch.float64" in compiler.reports[-1].skipped[0]["reason"]

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    compiled, recorder = compile_recorded(model, devices=("cuda",))
    compiled(torch.randn(1, 3, 8, 8))
    assert recorder.ops() == [] and "device cpu" in compiler.reports[-1].skipped[0]["reason"]

    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.Conv2d(4, 4, 2, padding="same"))
    compiled, recorder = compile_recorded(model)
    check_against_float64(model, compiled, torch.randn(1, 3, 8, 8))
    reasons = [s["reason"] for s in compiler.reports[-1].skipped]
    assert recorder.ops() == [] and len(recorder.conv2d_nodes()) == 2
    assert any("no bias" in r for r in reasons) and any("asymmetric" in r for r in reasons)


class BasicBlock(nn.Module):
    """ResNet's basic block: conv -> BN -> ReLU -> conv -> BN, plus the shortcut, then ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


def residual_net() -> nn.Sequential:
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), BasicBlock(8), BasicBlock(8))
    # Running statistics and affine parameters away from their initial values, so that folding is exercised.
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return net


def test_batchnorm_is_folded_for_inference() -> None:
    torch.manual_seed(0)
    model = residual_net().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        compiled, recorder = compile_recorded(model)
        check_against_float64(model, compiled, x, grads=False)
    report = compiler.reports[-1]
    # Every conv folded its BN; the stem and each block's first conv also took the ReLU; the blocks' second convs
    # took the residual add and the ReLU after it.
    assert report.count(batchnorm=True) == 5 and report.count(activation="relu") == 5
    assert report.count(residual=True, activation="relu") == 2 and report.count(residual=False, activation="relu") == 3
    assert not any(n.target in (torch.nn.functional.batch_norm,) for gm in recorder.graphs for n in gm.graph.nodes)
    # Folding reads the live statistics on every call: nothing is frozen.
    with torch.no_grad():
        model[1].running_mean.add_(0.25)
        check_against_float64(model, compiled, x, grads=False)


def compile_inference_code(model: nn.Module, x: torch.Tensor, *, frozen: bool, **options: Any) -> tuple[torch.Tensor, str]:
    """The backend compiling ``model`` (CPU convolutions included, Inductor) and its first call under no_grad, with
    Inductor's freezing set globally (``frozen``) or not; the output and the generated code."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="convbias", options={"convbias.devices": ("cpu", "cuda"), **options})
    with torch.no_grad(), torch._inductor.config.patch(freezing=frozen, fx_graph_cache=False):
        out, code = run_and_get_code(compiled, x)
    return out, "\n".join(code)


def test_freezing_turns_the_folded_batchnorm_into_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Inductor's freezing (set globally, as Dynamo reads it while tracing) the parameters and the batch norm
    folded into the convolution become constants computed once at compile time; without it the fold is computed
    from the live statistics on every call (rsqrt of the running variance in the generated code)."""
    monkeypatch.setattr(compiler, "_FREEZING_WARNED", False)
    torch.manual_seed(0)
    model = residual_net().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        expected = copy.deepcopy(model).double()(x.double())
    for frozen in (False, True):
        out, code = compile_inference_code(model, x, frozen=frozen)
        assert compiler.reports[-1].count(batchnorm=True) == 5
        assert code.count("torch.ops.convbias.forward") >= 3  # the op in the generated code (forward and _residual)
        assert ("_frozen_param" in code) is frozen and ("rsqrt" in code) is not frozen, code[-3000:]
        torch.testing.assert_close(out, expected.float(), rtol=1e-4, atol=1e-4)


def test_freezing_only_in_the_options_warns_that_it_freezes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """``options={"freezing": True}`` alone leaves the parameters graph inputs (Dynamo decided while tracing): the
    backend says so once, in inference; not in training, nor when freezing is set globally."""
    monkeypatch.setattr(compiler, "_FREEZING_WARNED", False)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU()).eval()
    x = torch.randn(1, 3, 6, 6)
    with pytest.warns(UserWarning, match=r"options=\{'freezing': True\} freezes no parameter.*config.freezing = True"):
        _, code = compile_inference_code(model, x, frozen=False, freezing=True)
    assert "_frozen_param" not in code  # what the warning says
    monkeypatch.setattr(compiler, "_FREEZING_WARNED", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, code = compile_inference_code(model, x, frozen=True, freezing=True)
        assert "_frozen_param" in code
        torch._dynamo.reset()
        torch.compile(model.train(), backend="convbias", options={"convbias.devices": ("cpu",), "freezing": True})(x)


def test_batchnorm_is_not_folded_while_training() -> None:
    """Training mode (batch statistics) and eval mode with gradients recorded both keep the batch norm."""
    torch.manual_seed(0)
    model = residual_net()
    compiled, recorder = compile_recorded(model)
    check_against_float64(model.eval(), compiled, torch.randn(2, 3, 8, 8), tol=1e-4)
    report = compiler.reports[-1]
    assert report.count(batchnorm=True) == 0 and report.count() == 1  # only the stem conv has a bias
    assert any("folded for inference only" in s["reason"] for s in report.skipped)


def test_options_are_checked_and_passed_on() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    x = torch.randn(1, 3, 6, 6)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown option.*convbias.fuse"):
        torch.compile(model, backend="convbias", options={"convbias.fuse": True})(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="convbias.devices"):
        torch.compile(model, backend="convbias", options={"convbias.devices": "cpu"})(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="need convbias.inner='inductor'"):
        opts = {"convbias.devices": ("cpu", "cuda"), "convbias.inner": "aot_eager", "max_autotune": True}
        torch.compile(model, backend="convbias", options=opts)(x)
    with pytest.raises(ValueError, match="the backend is convbias"):
        torch_convbias.compile(model, backend="inductor")
    # rewrite_graph alone, on a graph Dynamo captured: the same rewrite, its report returned.
    captured: list[torch.fx.GraphModule] = []
    torch._dynamo.reset()
    torch.compile(model, backend=lambda gm, inputs: captured.append(gm) or gm)(x)
    report = compiler.rewrite_graph(captured[0], devices=("cpu", "cuda"))
    assert report.count(activation="relu") == 1 and compiler.reports[-1] is report
    # fuse_activations=False: the conv + bias is rewritten, the ReLU is not fused.
    compiled, recorder = compile_recorded(model, **{"convbias.fuse_activations": False})
    compiled(x)
    assert [n.args[7] for n in recorder.ops()] == ["identity"]


def test_inductor_compiles_the_rewritten_graph_with_dynamic_batch() -> None:
    """Default inner backend (Inductor), fullgraph, dynamic batch sizes: one graph, rewritten, equal to float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3))
    torch._dynamo.reset()
    compiler.reports.clear()
    compiled = torch_convbias.compile(model, fullgraph=True, dynamic=True, options={"convbias.devices": ("cpu", "cuda")})
    for batch in (2, 3, 5):
        check_against_float64(model, compiled, torch.randn(batch, 3, 8, 8))
    assert len(compiler.reports) == 1  # one graph for every batch size
    assert compiler.reports[-1].count() == 2 and compiler.reports[-1].count(activation="relu") == 1


# ---------------------------------------------------------------------------------------------------------------
# CUDA: the default devices, Inductor, channels_last, against eager nn.Conv2d models.


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_training_step_matches_eager(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = activation_stack().cuda().to(dtype).to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="convbias")
    x = torch.randn(8, 3, 16, 16, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        expected = model(x)
        expected.float().square().sum().backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        actual = compiled(x)
        actual.float().square().sum().backward()
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    assert compiler.reports[-1].count() == 8
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=tol, atol=tol * max(1.0, g.abs().max().item()))


def test_symbolic_leaky_relu_slope_is_not_fused_and_says_why() -> None:
    """torch.compile(dynamic=True) traces nn.LeakyReLU's float slope as a graph input (no guard on its value): fusing
    its present value would go stale silently, so the activation stays as it is, with a reason; specialised floats
    fuse."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.LeakyReLU(0.2))
    x = torch.randn(2, 3, 8, 8)
    expected = model(x)
    for specialize_float in (False, True):
        torch._dynamo.reset()
        with torch._dynamo.config.patch(specialize_float=specialize_float):
            compiled = torch.compile(model, backend="convbias", dynamic=True, options={"convbias.devices": ("cpu",)})
            torch.testing.assert_close(compiled(x), expected)
        report = compiler.reports[-1]
        assert report.count() == 1  # the conv + bias is rewritten either way
        assert report.count(activation="leaky_relu") == int(specialize_float), report
        reasons = [s["reason"] for s in report.skipped]
        assert any("negative_slope" in r and "specialize_float" in r for r in reasons) != specialize_float, reasons


@cuda
def test_cuda_training_under_reduce_overhead_and_dynamic_batch() -> None:
    """CUDA graphs (mode="reduce-overhead") over the rewritten training step, and a dynamic batch: every step's
    parameter gradients equal eager nn.Conv2d's (strict fp32)."""
    torch.manual_seed(0)
    model = activation_stack().cuda().to(memory_format=torch.channels_last)
    twin = copy.deepcopy(model)
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        # Under dynamic=True nn.LeakyReLU's slope is traced as a symbolic float: that one activation stays unfused
        # (its conv has no bias: nothing left to rewrite) unless floats are specialised.
        for mode, dynamic, specialize_float, rewritten in (
            ("reduce-overhead", False, False, 8), (None, True, False, 7), (None, True, True, 8)
        ):
            torch._dynamo.reset()
            with torch._dynamo.config.patch(specialize_float=specialize_float):
                compiled = torch.compile(twin, backend="convbias", mode=mode, dynamic=dynamic)
                for batch in (4, 4, 4, 6, 6):
                    x = torch.randn(batch, 3, 16, 16, device="cuda").to(memory_format=torch.channels_last)
                    model.zero_grad(set_to_none=True)
                    twin.zero_grad(set_to_none=True)
                    model(x).square().sum().backward()
                    compiled(x).square().sum().backward()
                    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
                        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-3 * max(1.0, p.grad.abs().max().item()), msg=name)
            assert compiler.reports[-1].count() == rewritten, (mode, dynamic, specialize_float, compiler.reports[-1])
            assert compiler.reports[-1].count(activation="leaky_relu") == rewritten - 7
    finally:
        torch.backends.cudnn.allow_tf32 = saved


@cuda
def test_cuda_inference_folds_batchnorm_under_reduce_overhead() -> None:
    torch.manual_seed(0)
    model = residual_net().cuda().eval().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 16, 16, device="cuda").to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="convbias", mode="reduce-overhead")
    reference = copy.deepcopy(model).double()
    with torch.inference_mode():
        expected = reference(x.double()).float()
        for _ in range(3):  # recorded, then replayed
            actual = compiled(x)
    assert compiler.reports[-1].count(batchnorm=True) == 5
    assert compiler.reports[-1].count(residual=True, activation="relu") == 2  # the blocks' endings: forward_residual
    torch.testing.assert_close(actual, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only default")
def test_cpu_models_are_untouched_by_default() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    torch._dynamo.reset()
    torch.compile(model, backend="convbias", options={"convbias.inner": "aot_eager"})(torch.randn(1, 3, 6, 6))
    assert compiler.reports[-1].count() == 0


def test_rewrites_and_skips_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The log TORCH_CONVBIAS_COMPILE_LOG=1 prints (logger torch_convbias.compile): each rewrite, each skip with why."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3, bias=False))
    with caplog.at_level("INFO", logger="torch_convbias.compile"):
        compiled, _ = compile_recorded(model)
        compiled(torch.randn(1, 3, 8, 8))
    messages = [r.getMessage() for r in caplog.records if r.name == "torch_convbias.compile"]
    assert any("into convbias.forward (activation relu)" in m for m in messages), messages
    assert any("no bias, batch norm or activation to fuse" in m for m in messages), messages


def compile_logged_in_a_fresh_process(layers: str, env: dict[str, str], setup: str = "") -> str:
    """A fresh process compiling ``nn.Sequential(<layers>)`` on CPU tensors with the backend (AOT eager) under ``env``,
    after ``setup``; its stderr, where the log goes."""
    script = (
        "import logging, torch, torch_convbias\n"
        f"{setup}"
        f"m = torch.nn.Sequential({layers})\n"
        "opts = {'convbias.devices': ('cpu', 'cuda'), 'convbias.inner': 'aot_eager'}\n"
        "torch.compile(m, backend='convbias', options=opts)(torch.randn(1, 3, 8, 8))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def test_log_switch_in_a_fresh_process() -> None:
    env = {**os.environ, "TORCH_CONVBIAS_COMPILE_LOG": "1"}
    stderr = compile_logged_in_a_fresh_process("torch.nn.Conv2d(3, 4, 3), torch.nn.SiLU()", env)
    assert "[torch_convbias.compile] rewrote" in stderr and "activation silu" in stderr


@pytest.mark.parametrize("switch", ["TORCH_LOGS", "set_logs"])
def test_torch_logging_system_shows_the_rewrites(switch: str) -> None:
    """torch's own logging system turns the log on too: ``TORCH_LOGS=torch_convbias`` or
    ``torch._logging.set_logs(modules={"torch_convbias": logging.INFO})`` (the package name as a module log), and the
    lines come out in torch's format, each rewrite and each candidate left alone with the reason."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TORCH_CONVBIAS_COMPILE_LOG")}
    if switch == "TORCH_LOGS":
        env["TORCH_LOGS"] = "torch_convbias"
    setup = "torch._logging.set_logs(modules={'torch_convbias': logging.INFO})\n" if switch == "set_logs" else ""
    layers = "torch.nn.Conv2d(3, 4, 3), torch.nn.GELU(), torch.nn.Conv2d(4, 4, 3, bias=False)"
    stderr = compile_logged_in_a_fresh_process(layers, env, setup)
    lines = [line for line in stderr.splitlines() if "torch_convbias/compiler.py" in line]
    assert any("into convbias.forward (activation gelu" in line for line in lines), stderr[-3000:]
    assert any("no bias, batch norm or activation to fuse" in line for line in lines), stderr[-3000:]
    assert "[torch_convbias.compile]" not in stderr  # our own switch's format: not asked for here


def test_autocast_region_is_rewritten_and_matches_eager_autocast() -> None:
    """Under CPU autocast (bfloat16) the rewritten op casts as nn.Conv2d does: same dtype, close values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3))
    x = torch.randn(2, 3, 8, 8)
    compiled, recorder = compile_recorded(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
        actual = compiled(x)
    assert actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected, rtol=3e-2, atol=3e-2)
    assert [n.args[7] for n in recorder.ops()] == ["relu", "identity"]


# ---------------------------------------------------------------------------------------------------------------
# Residual block endings: act(conv + r) into convbias.forward_residual.


class TorchvisionBasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock as written there: one ReLU(inplace=True) module used twice, ``out +=
    identity``, and a downsample shortcut (1x1 conv + BN) when the stride or the channel count changes."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


def randomise_batchnorm(net: nn.Module) -> nn.Module:
    """Running statistics and affine parameters away from their initial values, so that folding is exercised."""
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                nn.init.uniform_(m.weight, 0.5, 1.5)
                nn.init.uniform_(m.bias, -0.5, 0.5)
    return net


class PlainResidualBlock(nn.Module):
    """A residual block without batch norm: conv (+ bias) -> ReLU -> conv (+ bias), ``out += identity``, ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.conv1(x))
        out = self.conv2(out)
        out += identity
        return self.relu(out)


def graph_targets(recorder: Recorder) -> list[Any]:
    return [n.target for gm in recorder.graphs for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


@pytest.mark.parametrize("downsample", [False, True])
def test_torchvision_basic_blocks_end_in_forward_residual_for_inference(downsample: bool) -> None:
    """A stem and two torchvision BasicBlocks (the first with a downsample shortcut when ``downsample``), eval mode,
    no_grad, compiled by the default Inductor route: each block's ending (conv2 -> bn2 -> ``+= identity`` -> ReLU)
    is one forward_residual with the batch norm folded and the ReLU fused, each first conv is fused with its BN and
    ReLU as before, the downsample conv with its BN alone; the output equals eager's (float32 and float64)."""
    torch.manual_seed(0)
    width, stride = (16, 2) if downsample else (8, 1)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        TorchvisionBasicBlock(8, width, stride),
        TorchvisionBasicBlock(width, width),
    )
    model = randomise_batchnorm(model).eval()
    assert (model[3].downsample is not None) == downsample
    x = torch.randn(2, 3, 12, 12)
    torch._dynamo.reset()
    compiler.reports.clear()
    with torch.no_grad():
        compiled = torch.compile(model, backend="convbias", options={"convbias.devices": ("cpu",)})
        expected = model(x)
        actual = compiled(x)
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
        check_against_float64(model, compiled, x, grads=False)
    report = compiler.reports[-1]
    assert report.count(residual=True) == 2, report
    assert report.count(residual=True, activation="relu", batchnorm=True) == 2
    assert report.count(residual=False, activation="relu", batchnorm=True) == 3  # the stem and both conv1
    assert report.count(residual=False, activation="identity") == int(downsample)  # the downsample conv + BN
    assert report.count() == 5 + int(downsample) and report.skipped == []


def test_residual_block_is_fused_while_training() -> None:
    """Gradients on, no batch norm: each block's conv2 -> ``+= identity`` -> ReLU(inplace) becomes one
    forward_residual whose residual is the block's input, the in-place add and ReLU gone from the graph; the forward,
    every parameter gradient and the input gradient equal the float64 eager model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), PlainResidualBlock(8), PlainResidualBlock(8))
    compiled, recorder = compile_recorded(model)
    check_against_float64(model, compiled, torch.randn(2, 3, 8, 8))
    report = compiler.reports[-1]
    assert report.count(residual=True, activation="relu", batchnorm=False) == 2, report
    assert report.count(residual=False) == 3 and report.skipped == []
    residual_ops = recorder.ops("forward_residual")
    assert len(residual_ops) == 2 and [n.args[8] for n in residual_ops] == ["relu", "relu"]
    # Each block's residual is its input, which its conv1 also reads.
    assert all(n.args[3] is n.args[0].args[0] for n in residual_ops)
    targets = graph_targets(recorder)
    assert operator.iadd not in targets and torch.nn.functional.relu not in targets



def _iadd(y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    y += r
    return y


ADD_SPELLINGS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "y + r": lambda y, r: y + r,
    "r + y": lambda y, r: r + y,
    "torch.add(y, r)": lambda y, r: torch.add(y, r),
    "torch.add(r, y, alpha=1)": lambda y, r: torch.add(r, y, alpha=1),
    "y.add(r)": lambda y, r: y.add(r),
    "r.add(y)": lambda y, r: r.add(y),
    "y.add_(r)": lambda y, r: y.add_(r),
    "y += r": _iadd,
}


@pytest.mark.parametrize("spelling", list(ADD_SPELLINGS))
def test_every_spelling_of_the_residual_add_is_fused(spelling: str) -> None:
    """conv(x) + r written each way Dynamo records an add (operator.add, operator.iadd, torch.add, the add / add_
    methods), conv first or second, then a ReLU: one forward_residual with the ReLU, matching float64 eager in the
    forward and every gradient (the residual is computed after the convolution, as a downsample branch is)."""
    add = ADD_SPELLINGS[spelling]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.shortcut = nn.Conv2d(4, 6, 3, padding=1), nn.Conv2d(4, 6, 1, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return torch.relu(add(y, self.shortcut(x) * 0.5))

    torch.manual_seed(0)
    model = Model()
    compiled, recorder = compile_recorded(model)
    check_against_float64(model, compiled, torch.randn(2, 4, 7, 7))
    report = compiler.reports[-1]
    assert report.count(residual=True, activation="relu") == 1, report
    assert [n.args[8] for n in recorder.ops("forward_residual")] == ["relu"]
    assert not any("residual" in s["reason"] for s in report.skipped), report.skipped


class UnfusableResidual(nn.Module):
    """conv(x) (+ bias) followed by an add the op must not take, per ``case``."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        if case == "broadcast":
            self.shift = nn.Parameter(torch.randn(1, 4, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.case == "broadcast":
            return torch.relu(self.conv(x) + self.shift)
        if self.case == "dtype":
            return torch.relu(self.conv(x) + x.double())
        if self.case == "used twice":
            y = self.conv(x)
            return torch.relu(y + x) * y
        if self.case == "alpha":
            return torch.relu(torch.add(self.conv(x), x, alpha=2))
        if self.case == "into the residual":
            r = x * 2
            r += self.conv(x)
            return torch.relu(r)
        if self.case == "mutated in between":  # (without gradients: autograd forbids changing the conv's saved input)
            h = x * 1
            y = self.conv(h)
            h.relu_()  # the convolution read h before this; the add reads it after
            return y + h
        if self.case == "layout":
            # A channels_last convolution output added to a contiguous tensor, the contiguous one first: the sum is
            # contiguous (the op's output would be channels_last, which .view below could not take).
            y = self.conv(x.contiguous(memory_format=torch.channels_last))
            return (x + y).view(x.shape[0], -1)
        raise AssertionError(self.case)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("broadcast", "broadcasting"),
        ("dtype", "type promotion"),
        ("used twice", "other users"),
        ("alpha", "alpha=2"),
        ("into the residual", "in place into the other operand"),
        ("mutated in between", "in-place operation"),
        ("layout", "memory layout"),
    ],
)
def test_residual_adds_that_are_not_equivalent_are_left_alone(case: str, reason: str) -> None:
    """A broadcast residual ([1, C, 1, 1]), another dtype (type promotion), the conv output read twice, torch.add with
    alpha=2, ``r += conv`` (writes into r), the conv's input changed in place before the add, a sum whose layout is
    not the convolution's: no forward_residual, the conv + bias still rewritten alone, the skip says why (once), and
    the model still equals float64 eager (forward and gradients where autograd allows them)."""
    torch.manual_seed(0)
    model = UnfusableResidual(case)
    compiled, recorder = compile_recorded(model)
    grads = case != "mutated in between"
    with torch.set_grad_enabled(grads):
        check_against_float64(model, compiled, torch.randn(2, 4, 6, 6), grads=grads)
    report = compiler.reports[-1]
    assert recorder.ops("forward_residual") == [] and report.count(residual=True) == 0
    assert report.count(residual=False) == 1  # the conv + bias, as without a residual add
    reasons = [s["reason"] for s in report.skipped if s["reason"].startswith("residual add not fused: ")]
    assert len(reasons) == 1 and reason in reasons[0], report.skipped


def test_fuse_residual_option_turns_it_off() -> None:
    """convbias.fuse_residual=False: the residual add and the ReLU after it stay in the graph, each conv is rewritten
    as before (conv1 with its ReLU, conv2 alone), no skip is recorded for the add; the option must be a bool."""
    torch.manual_seed(0)
    model = PlainResidualBlock(4)
    compiled, recorder = compile_recorded(model, **{"convbias.fuse_residual": False})
    check_against_float64(model, compiled, torch.randn(2, 4, 6, 6))
    report = compiler.reports[-1]
    assert report.count(residual=True) == 0 and report.count() == 2 and report.count(activation="relu") == 1
    assert recorder.ops("forward_residual") == [] and operator.iadd in graph_targets(recorder)
    assert report.skipped == []
    # The same model with the default: fused.
    compiled, recorder = compile_recorded(model)
    check_against_float64(model, compiled, torch.randn(2, 4, 6, 6))
    assert compiler.reports[-1].count(residual=True) == 1 and len(recorder.ops("forward_residual")) == 1
    torch._dynamo.reset()
    with pytest.raises(Exception, match="convbias.fuse_residual"):
        torch.compile(model, backend="convbias", options={**CPU_OPTIONS, "convbias.fuse_residual": "no"})(torch.randn(1, 4, 6, 6))


def test_residual_fusion_with_dynamic_batch() -> None:
    """dynamic=True (symbolic batch size): conv(x) + x without an activation is still provably of the output's shape,
    so one graph serves every batch size with one forward_residual (activation identity), equal to float64 eager."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x) + x

    model = Model()
    torch._dynamo.reset()
    compiler.reports.clear()
    compiled = torch.compile(model, backend="convbias", dynamic=True, fullgraph=True, options=CPU_OPTIONS)
    for batch in (2, 3, 5):
        check_against_float64(model, compiled, torch.randn(batch, 4, 6, 6))
    assert len(compiler.reports) == 1
    report = compiler.reports[-1]
    assert report.count(residual=True, activation="identity") == 1 and report.rewrites[0]["bias"] is False, report
