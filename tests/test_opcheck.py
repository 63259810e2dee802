"""torch.library.opcheck on the ops (forward, forward_residual, param_grad: schema, autograd registration, fake tensors,
AOT dispatch), torch.compile(fullgraph=True) of a model built from ConvBias2d layers, torch.export, and AOTInductor
packages."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cases import Case
from conftest import DEVICES
from torch import nn

import torch_convbias
from torch_convbias import ConvBias2d

ROOT = Path(__file__).resolve().parents[1]

SAMPLE_CASES = [
    Case(2, 4, 8, 7, 6, (3, 3), (1, 1), (1, 1), (1, 1), 1, True, False),
    Case(2, 4, 8, 7, 6, (3, 2), (2, 1), (0, 1), (1, 2), 2, False, True),
    Case(1, 4, 6, 6, 4, (3, 3), (1, 1), (1, 1), (1, 1), 4, True, True),
]


def forward_samples(device: str) -> list[tuple]:
    samples = []
    for case in SAMPLE_CASES:
        for requires_grad in (False, True):
            x, w, b = case.tensors(device, torch.float32)
            tensors = [t.requires_grad_(requires_grad) if t is not None else None for t in (x, w, b)]
            samples.append((*tensors, *case.conv_args()))
    return samples


def param_grad_samples(device: str) -> list[tuple]:
    samples = []
    for case in SAMPLE_CASES:
        x, w, _ = case.tensors(device, torch.float32)
        stride, padding, dilation, groups = case.conv_args()
        grad = torch.randn_like(F.conv2d(x, w, None, stride, padding, dilation, groups))
        for mask in ([True, True], [True, False], [False, True]):
            samples.append((grad, x, w, stride, padding, dilation, groups, mask))
    return samples


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_forward(device: str) -> None:
    for sample in forward_samples(device):
        torch.library.opcheck(torch.ops.convbias.forward.default, sample)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_forward_residual(device: str) -> None:
    """forward_residual with every input requiring grad or none, with activations of both derivative sources."""
    for i, sample in enumerate(forward_samples(device)):
        x, w, b, stride, padding, dilation, groups = sample
        shape = F.conv2d(x.detach(), w.detach(), None, stride, padding, dilation, groups).shape
        residual = torch.randn(shape, device=device).requires_grad_(x.requires_grad)
        activation = ("identity", "relu", "gelu")[i % 3]
        torch.library.opcheck(
            torch.ops.convbias.forward_residual.default, (x, w, b, residual, stride, padding, dilation, groups, activation)
        )


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_param_grad(device: str) -> None:
    for sample in param_grad_samples(device):
        torch.library.opcheck(torch.ops.convbias.param_grad.default, sample)


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            ConvBias2d(3, 8, 3, padding=1),
            nn.ReLU(),
            ConvBias2d(8, 16, 3, stride=2, padding="valid"),
            nn.ReLU(),
            ConvBias2d(16, 16, (3, 1), padding="same", groups=4, padding_mode="reflect"),
        )
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device: str) -> None:
    torch.manual_seed(0)
    model = SmallNet().to(device)
    x = torch.randn(4, 3, 12, 12, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    expected = model(x)
    out = compiled(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    expected.sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled(x).sum().backward()
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-4)


def test_ops_are_registered_with_expected_schema() -> None:
    schema = str(torch.ops.convbias.forward.default._schema)
    assert "SymInt[2] stride" in schema and "Tensor? bias" in schema
    assert "(Tensor? grad_weight, Tensor? grad_bias)" in str(torch.ops.convbias.param_grad.default._schema)
    info = torch_convbias.versions()
    assert info["cudnn_compiled"].startswith("9.") and info["cudnn_frontend"].startswith("1.")


@pytest.mark.parametrize("device", DEVICES)
def test_compile_dynamic_batch_compiles_once(device: str) -> None:
    """fullgraph with a dynamic batch: one graph serves every batch size (the fake kernels take SymInts)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    model = SmallNet().to(device)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    for batch in (2, 3, 7):
        x = torch.randn(batch, 3, 12, 12, device=device)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert counter.frame_count == 1, counter.frame_count


@pytest.mark.parametrize("device", DEVICES)
def test_export_with_dynamic_batch(device: str) -> None:
    """torch.export keeps convbias.forward as an op in the graph and the exported program runs other batches."""
    torch.manual_seed(0)
    model = SmallNet().to(device).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (torch.randn(4, 3, 12, 12, device=device),), dynamic_shapes={"x": {0: batch}})
    assert "convbias.forward" in str(program.graph)
    for n in (1, 5):
        x = torch.randn(n, 3, 12, 12, device=device)
        torch.testing.assert_close(program.module()(x), model(x), rtol=1e-4, atol=1e-4)


class ResidualEnding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = ConvBias2d(4, 4, 3, padding=1, activation="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x, residual=x)


@pytest.mark.parametrize("device", DEVICES)
def test_export_keeps_forward_residual_with_dynamic_batch(device: str) -> None:
    """torch.export of a module calling ConvBias2d(x, residual=x): convbias.forward_residual stays in the graph, and
    the program runs other batch sizes."""
    torch.manual_seed(0)
    model = ResidualEnding().to(device).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (torch.randn(4, 4, 8, 8, device=device),), dynamic_shapes={"x": {0: batch}})
    assert "convbias.forward_residual" in str(program.graph)
    for n in (1, 5):
        x = torch.randn(n, 4, 8, 8, device=device)
        expected = F.relu(F.conv2d(x, model.conv.weight, model.conv.bias, padding=1) + x)
        torch.testing.assert_close(program.module()(x), expected, rtol=1e-4, atol=1e-4)


class Deployable(nn.Module):
    """Two fused layers, the second ending a residual block: convbias.forward and convbias.forward_residual."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = ConvBias2d(3, 8, 3, padding=1, activation="relu")
        self.conv2 = ConvBias2d(8, 8, 3, padding=1, activation="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(x)
        return self.conv2(y, residual=y)


# Prints each step, so that a failure shows how far the loading process got.
_LOAD_AND_RUN = """
import sys, torch, torch_convbias
print("imported", flush=True)
runner = torch._inductor.aoti_load_package(sys.argv[1])
print("loaded", flush=True)
inputs = torch.load(sys.argv[2])
torch.save([runner(x) for x in inputs], sys.argv[3])
print("ran", flush=True)
"""


def native_backtrace(command: list[str]) -> str:
    """``command`` run again under a debugger (gdb, or cuda-gdb, which the GPU machine has instead), with the native
    stack of the thread that crashed: what faulthandler's Python stack cannot say about a crash inside a library."""
    debugger = shutil.which("gdb") or shutil.which("cuda-gdb")
    if debugger is None:
        return "(no gdb or cuda-gdb on PATH: no native backtrace)"
    script = ["-batch", "-nx", "-ex", "set pagination off", "-ex", "run", "-ex", "bt 40"]
    try:
        result = subprocess.run([debugger, *script, "--args", *command], cwd=ROOT, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as timeout:
        return f"({debugger} did not finish in {timeout.timeout} s)"
    return f"{debugger}:\n" + (result.stdout + result.stderr)[-8000:]


@pytest.mark.skipif(shutil.which("gdb") is None and shutil.which("cuda-gdb") is None, reason="needs gdb or cuda-gdb")
def test_native_backtrace_names_the_frame_that_crashed() -> None:
    """The diagnosis the AOTInductor test attaches to a crash: a process reading address 0 is reported with its signal
    and native stack down to the library that made the call (ctypes; by function name only where the machine has its
    symbols: the GPU machine's Python has none, so there the frames name _ctypes' shared object)."""
    trace = native_backtrace([sys.executable, "-c", "import ctypes; ctypes.string_at(0)"])
    assert "SIGSEGV" in trace and "#0 " in trace and ("string_at" in trace or "_ctypes" in trace), trace


def test_native_backtrace_says_why_it_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a debugger, or with one that does not finish, the failure message says so instead of a backtrace."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert native_backtrace(["true"]) == "(no gdb or cuda-gdb on PATH: no native backtrace)"
    monkeypatch.setattr(shutil, "which", lambda name: "/opt/cuda-gdb" if name == "cuda-gdb" else None)

    def hangs(command: list[str], **kwargs: object) -> None:
        assert command[0] == "/opt/cuda-gdb" and command[-1] == "true" and kwargs["timeout"] == 240
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])  # type: ignore[arg-type]

    monkeypatch.setattr(subprocess, "run", hangs)
    assert native_backtrace(["true"]) == "(/opt/cuda-gdb did not finish in 240 s)"


# A fresh process that never imports torch_convbias loads a package and runs it.
_LOAD_AND_RUN_PLAIN = """
import sys, torch
runner = torch._inductor.aoti_load_package(sys.argv[1])
print(runner(torch.randn(2, 3, 10, 10, device=sys.argv[2])).shape, flush=True)
"""


def plain_package_dies(device: str, tmp_path: Path) -> str | None:
    """The control for a crash of the deployment test: AOTInductor's package of an nn.Conv2d model (none of our ops),
    loaded by a process that does not import torch_convbias. What killed it, or None when it ran. (The H200 machine's
    CPU packages died of SIGSEGV inside the generated wrapper's own device-string parsing, std::regex, before any op
    ran.)"""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()).to(device).eval()
    program = torch.export.export(model, (torch.randn(4, 3, 10, 10, device=device),))
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "plain.pt2"))
    command = [sys.executable, "-X", "faulthandler", "-c", _LOAD_AND_RUN_PLAIN, package, device]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if result.returncode >= 0:
        return None
    return f"signal {-result.returncode} loading a plain nn.Conv2d package\n{result.stderr[-1500:]}"


def test_plain_package_control_reports_the_signal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The control says what killed the plain package's process (a negative return code), and nothing when it ran."""
    compiled: list[str] = []
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package",
                        lambda program, package_path: compiled.append(package_path) or package_path)  # fmt: skip
    outcomes = iter([-11, 0])

    def load(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert command[-2:] == [str(tmp_path / "plain.pt2"), "cpu"] and "torch_convbias" not in command[-3]
        return subprocess.CompletedProcess(command, next(outcomes), "", "Fatal Python error: Segmentation fault")

    monkeypatch.setattr(subprocess, "run", load)
    died = plain_package_dies("cpu", tmp_path)
    assert died is not None and died.startswith("signal 11 loading a plain nn.Conv2d package") and "Segmentation" in died
    assert plain_package_dies("cpu", tmp_path) is None and len(compiled) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_aot_inductor_package_runs_in_a_fresh_process(device: str, tmp_path: Path) -> None:
    """Deployment without Python model code: torch.export, then AOTInductor compiles and packages the program with
    the ops inside (called through the dispatcher); a fresh process that imports torch_convbias loads the package and
    runs other batch sizes, equal to F.conv2d computed from the same parameters."""
    torch.manual_seed(0)
    model = Deployable().to(device).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (torch.randn(4, 3, 10, 10, device=device),), dynamic_shapes={"x": {0: batch}})
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "deployable.pt2"))
    inputs = [torch.randn(n, 3, 10, 10, device=device) for n in (1, 7)]
    torch.save(inputs, tmp_path / "inputs.pt")
    # -X faulthandler: a crash in the loading process reports its Python stack in stderr.
    command = [sys.executable, "-X", "faulthandler", "-c", _LOAD_AND_RUN, package, str(tmp_path / "inputs.pt"),
               str(tmp_path / "outputs.pt")]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if result.returncode < 0 and (plain := plain_package_dies(device, tmp_path)) is not None:
        pytest.skip(f"AOTInductor's {device} packages crash on this machine without torch_convbias too: {plain}")
    if result.returncode < 0:  # killed by a signal (the H200 machine saw SIGSEGV): where, natively
        pytest.fail(f"the loading process died of signal {-result.returncode}:\n{result.stdout[-1000:]}"
                    f"{result.stderr[-3000:]}\n{native_backtrace(command)}")  # fmt: skip
    assert result.returncode == 0, result.stdout[-1000:] + result.stderr[-3000:]
    outputs = torch.load(tmp_path / "outputs.pt")
    c1, c2 = model.conv1, model.conv2
    for x, actual in zip(inputs, outputs):
        y = F.relu(F.conv2d(x, c1.weight, c1.bias, padding=1))
        expected = F.relu(F.conv2d(y, c2.weight, c2.bias, padding=1) + y)
        assert actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compile_reduce_overhead_training_step_matches_eager() -> None:
    """torch.compile(mode="reduce-overhead"), i.e. CUDA graphs recorded then replayed: forward output and parameter
    gradients of every step equal eager's (strict fp32 on both sides)."""
    torch.manual_seed(0)
    model = SmallNet().cuda().to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead")
    # flags() defaults to enabled=False, which would send both sides to ATen's convolution without cuDNN.
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for step in range(4):  # the first calls warm up and record, the later ones replay
            x = torch.randn(4, 3, 12, 12, device="cuda").contiguous(memory_format=torch.channels_last)
            model.zero_grad(set_to_none=True)
            out = compiled(x)
            out.sum().backward()
            got = [out.detach().clone()] + [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            reference = model(x)
            reference.sum().backward()
            expected = [reference.detach()] + [p.grad for p in model.parameters()]
            for i, (a, b) in enumerate(zip(got, expected)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}, tensor {i}: {m}")
