"""Probe (issue 14): a model's training step one convolution at a time, ours against nn.Conv2d's.

``bench_models`` times whole steps; where the backend's step is not faster by the target (AlexNet fp32 training:
1.07x of 1.10x on the H100 at eba1f4e) its kernel list says only which kinds of kernels differ. This probe runs
each convolution layer of the model (with its ReLU, on the model's shapes at the row's batch) as one layer of a
training step, on both sides:

===========  =====================================================================================================
nn           ``F.relu(F.conv2d(x, w, b, ...))`` and its backward (weight, bias and, but for the stem, input gradients)
ours         ``torch_convbias.functional.conv_bias2d(..., activation="relu")`` and its backward: the ops the
             backend rewrites ``nn.Conv2d`` + ReLU into (the timed choices of ``cudnn.benchmark`` included)
===========  =====================================================================================================

Per layer: GPU time per step (profiler kernel sums over ``--iters`` steps) and its largest kernels, back-to-back rates,
the gradients and output checked against float64, and how the op ran the layer (explain(): forward path and engine,
regrouped or padded input, the weight gradient's path and engine). Under ``cudnn.benchmark`` with the mode's TF32
flags, as ``bench_models`` runs. ``--phase infer`` runs the forward alone under ``torch.no_grad`` at the model's inference batch, each convolution
with the ending it has in the model (ResNet-50's residual add + ReLU, its downsample's none): where the backend's
inference is slower (ResNet-50 fp32 0.96x on the H100 at 4c318d3), which layers' choices lose.
``python -m bench.probe_layers --model alexnet --modes fp32 [--batch 512]``;
``--device cpu --tiny`` is the CPU smoke test's (tests/test_probe_layers.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from . import common

NAME = "layers"
# Per model: (C, H=W, K, kernel, stride, padding) of each convolution at a 224x224 input, in order; the first (the
# stem) takes no input gradient in a training step.
MODELS: dict[str, list[tuple[int, int, int, int, int, int]]] = {
    "alexnet": [(3, 224, 64, 11, 4, 2), (64, 27, 192, 5, 1, 2), (192, 13, 384, 3, 1, 1), (384, 13, 256, 3, 1, 1),
                (256, 13, 256, 3, 1, 1)],
    "vgg11": [(3, 224, 64, 3, 1, 1), (64, 112, 128, 3, 1, 1), (128, 56, 256, 3, 1, 1), (256, 56, 256, 3, 1, 1),
              (256, 28, 512, 3, 1, 1), (512, 28, 512, 3, 1, 1), (512, 14, 512, 3, 1, 1), (512, 14, 512, 3, 1, 1)],
    # torchvision's ResNet-50 (v1.5: the stride in the 3x3), each distinct convolution once: the stem, then per stage
    # the first block's 1x1 reduce, its strided (or not) 3x3, the 1x1 expand, the downsample, and the later blocks'
    # 1x1 reduce and 3x3 (the first stage's 3x3 is its first block's).
    "resnet50": [(3, 224, 64, 7, 2, 3),
                 (64, 56, 64, 1, 1, 0), (64, 56, 64, 3, 1, 1), (64, 56, 256, 1, 1, 0), (64, 56, 256, 1, 1, 0),
                 (256, 56, 64, 1, 1, 0),
                 (256, 56, 128, 1, 1, 0), (128, 56, 128, 3, 2, 1), (128, 28, 512, 1, 1, 0), (256, 56, 512, 1, 2, 0),
                 (512, 28, 128, 1, 1, 0), (128, 28, 128, 3, 1, 1),
                 (512, 28, 256, 1, 1, 0), (256, 28, 256, 3, 2, 1), (256, 14, 1024, 1, 1, 0), (512, 28, 1024, 1, 2, 0),
                 (1024, 14, 256, 1, 1, 0), (256, 14, 256, 3, 1, 1),
                 (1024, 14, 512, 1, 1, 0), (512, 14, 512, 3, 2, 1), (512, 7, 2048, 1, 1, 0), (1024, 14, 2048, 1, 2, 0),
                 (2048, 7, 512, 1, 1, 0), (512, 7, 512, 3, 1, 1)],
    "tiny": [(3, 17, 4, 5, 2, 1), (4, 8, 6, 3, 1, 1)],
}  # fmt: skip
# How each convolution of a model ends, where not with a ReLU: ResNet-50's 1x1 expand adds the block's residual before
# its ReLU (the backend's residual ending), its downsample has no activation (batch norm folded, nothing after it).
ENDINGS: dict[str, dict[int, str]] = {
    "resnet50": {3: "residual_relu", 8: "residual_relu", 14: "residual_relu", 20: "residual_relu",
                 4: "identity", 9: "identity", 15: "identity", 21: "identity"},
    "tiny": {1: "residual_relu"},
}  # fmt: skip
DEFAULT_BATCH = {"alexnet": 512, "vgg11": 128, "resnet50": 128, "tiny": 2}
# The inference batches of bench_models.
INFER_BATCH = {"alexnet": 1024, "vgg11": 256, "resnet50": 256, "tiny": 2}
SIDES = ("nn", "ours")
TOP_KERNELS = 6


def _top(kernels: dict[str, float] | None, calls: int) -> dict[str, float] | None:
    """The largest kernels (ms per step), the rest summed as "other"."""
    if kernels is None:
        return None
    items = list(kernels.items())
    top = {name[:160]: ms / calls for name, ms in items[:TOP_KERNELS]}
    rest = sum(ms for _, ms in items[TOP_KERNELS:]) / calls
    return {**top, "other": rest} if rest else top


def _total(rows: Sequence[dict[str, Any]], mode: str, side: str) -> float | None:
    """A side's GPU time summed over the layers of ``mode`` measured so far; None without GPU times (the CPU, errors)."""
    times = [(r.get("gpu_ms") or {}).get(side) for r in rows if r.get("mode") == mode]
    return sum(times) if times and all(t is not None for t in times) else None


# How much larger than nn.Conv2d's own error (same inputs, same float64 reference) ours may be where both exceed the
# dtype's error model: "as exact as nn.Conv2d", not as exact as a model of the dtype that nn.Conv2d itself misses.
NN_ERROR_FACTOR = 2.0


def judge_against_nn(ours: dict[str, Any], nn: dict[str, Any]) -> dict[str, Any]:
    """``ours`` (a ``common.check_against_float64`` record) passed as it stands, or where it failed the dtype's error
    model only, passed if its error is within ``NN_ERROR_FACTOR`` times nn.Conv2d's on the same quantity."""
    if ours.get("passed") or "rel_rms_error" not in ours or "rel_rms_error" not in nn:
        return ours
    bound = NN_ERROR_FACTOR * nn["rel_rms_error"]
    if not ours["rel_rms_error"] <= bound:  # NaN fails too
        return {**ours, "nn_bound": bound}
    return {**ours, "passed": True, "nn_bound": bound,
            "message": f"{ours['message']}, but within {NN_ERROR_FACTOR:g}x nn.Conv2d's own error ({nn['rel_rms_error']:.3g})"}  # fmt: skip


def measure_layer(
    index: int, layer: tuple[int, ...], batch: int, mode: common.Mode, args: argparse.Namespace, ending: str = "relu"
) -> dict[str, Any]:
    """One convolution (with its ``ending``: "relu", "identity" or "residual_relu") on both sides: a training step
    (``args.phase == "train"``) or a forward under ``torch.no_grad`` ("infer")."""
    from torch_convbias import explain, explain_param_grad
    from torch_convbias.functional import conv_bias2d

    c, side, k, kernel, stride, padding = layer
    device = args.device
    cl = torch.channels_last
    generator = torch.Generator(device=device).manual_seed(index)
    out = (side + 2 * padding - kernel) // stride + 1
    training = args.phase == "train"

    def draw(*size: int, scale: float = 1.0) -> torch.Tensor:
        t = (torch.randn(*size, generator=generator, device=device) * scale).to(mode.dtype)
        return t.contiguous(memory_format=cl) if t.dim() == 4 else t

    needs_input_grad = training and index > 0
    x = draw(batch, c, side, side).requires_grad_(needs_input_grad)
    w = draw(k, c, kernel, kernel, scale=(c * kernel * kernel) ** -0.5).requires_grad_(training)
    b = draw(k).requires_grad_(training)
    z = draw(batch, k, out, out) if ending == "residual_relu" else None
    dy = draw(batch, k, out, out)
    inputs = (x, w, b) if needs_input_grad else (w, b)
    strides, paddings = [stride, stride], [padding, padding]
    activation = "identity" if ending == "identity" else "relu"

    def nn_ending(y: torch.Tensor) -> torch.Tensor:
        return y if ending == "identity" else F.relu(y if z is None else y + z)

    forwards: dict[str, Callable[[], torch.Tensor]] = {
        "nn": lambda: nn_ending(F.conv2d(x, w, b, strides, paddings)),
        "ours": lambda: conv_bias2d(x, w, b, strides, paddings, activation=activation, residual=z),
    }

    def step(forward: Callable[[], torch.Tensor]) -> Callable[[], Any]:
        if training:
            return lambda: torch.autograd.grad(forward(), inputs, dy)
        return lambda: _no_grad(forward)

    steps = {name: step(forward) for name, forward in forwards.items()}
    row: dict[str, Any] = {"layer": index, "input": [batch, c, side, side], "weight": [k, c, kernel, kernel],
                           "stride": stride, "padding": padding, "ending": ending, "phase": args.phase,
                           "mode": mode.name}  # fmt: skip
    # The float64 oracle: autograd over F.conv2d on the same values in float64 (no code of ours).
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    z64 = None if z is None else z.double()
    y64 = F.conv2d(x64, w64, b64, strides, paddings)
    y64 = y64 if ending == "identity" else F.relu(y64 if z64 is None else y64 + z64)
    expected: tuple[torch.Tensor, ...] = (y64.detach(),)
    if training:
        expected += torch.autograd.grad(y64, (x64, w64, b64) if needs_input_grad else (w64, b64), dy.double())
    terms = {"output": c * kernel * kernel, "weight": batch * out * out, "bias": batch * out * out, "input": k * kernel * kernel}
    names = ("output",) + ((("input", "weight", "bias") if needs_input_grad else ("weight", "bias")) if training else ())
    row["numerics"] = {}
    for side_name, forward in forwards.items():
        if training:
            y = forward()
            actual = (y.detach(), *torch.autograd.grad(y, inputs, dy))
        else:
            actual = (_no_grad(forward),)
        for name, got, want in zip(names, actual, expected):
            row["numerics"][f"{side_name}_{name}"] = common.check_against_float64(got, want, mode, terms[name])
    for name in names:
        key = f"ours_{name}"
        row["numerics"][key] = judge_against_nn(row["numerics"][key], row["numerics"][f"nn_{name}"])
    # The verdict is ours: nn.Conv2d's own checks are recorded beside it (cuDNN's FFT / Winograd picks and its bf16
    # reductions can exceed the dtype's error model; that is the baseline, not a failure of this probe).
    row["numerics_passed"] = all(row["numerics"][f"ours_{name}"].get("passed") for name in names)
    for _ in range(args.warmup):
        for fn in steps.values():
            fn()
    # GPU time: the profiler's kernel sums over --iters steps per side.
    kernels = {name: common.gpu_kernels([fn] * args.iters, device) for name, fn in steps.items()}
    row["gpu_ms"] = {name: (sum(k.values()) / args.iters if k is not None else None) for name, k in kernels.items()}
    row["gpu_kernels"] = {name: _top(k, args.iters) for name, k in kernels.items()}
    row["back_to_back"] = common.time_back_to_back(steps, args.calls, args.repeats, device)
    gpu = row["gpu_ms"]
    rate = {name: timing["median_ms"] for name, timing in row["back_to_back"].items()}
    row["nn_over_ours_gpu"] = gpu["nn"] / gpu["ours"] if gpu["nn"] and gpu["ours"] else None
    row["nn_over_ours_rate"] = rate["nn"] / rate["ours"]
    with torch.no_grad():
        info = explain(x.detach(), w.detach(), b.detach(), stride=strides, padding=paddings, activation=activation,
                       for_backward=training and z is None, residual=z)  # fmt: skip
        grad = (explain_param_grad(dy, x.detach(), w.detach(), stride=strides, padding=paddings)["weight_grad"]
                if training else {})  # fmt: skip
    row["paths"] = {
        "forward": info.get("path"), "engine": (info.get("engine") or {}).get("name"),
        "space_to_depth": info.get("space_to_depth"), "padded_channels": info.get("padded_channels"),
        "layout_timings": info.get("layout_timings"),
        # The timed choice's measurements (cudnn.benchmark): the chosen graph's and ATen's route's ms for the key.
        **{key: info.get(key) for key in ("graph_ms", "aten_ms", "fused_ms", "unfused_ms", "residual_fused", "notes")},
        "weight_grad": grad.get("path"), "weight_grad_engine": (grad.get("engine") or {}).get("name"),
    }  # fmt: skip
    return row


def _no_grad(forward: Callable[[], torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return forward()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="alexnet", choices=[m for m in MODELS if m != "tiny"])
    parser.add_argument("--phase", default="train", choices=["train", "infer"], help="a training step, or a forward")
    parser.add_argument("--batch", type=int, default=None, help="default: the phase's batch of bench_models")
    common.add_probe_arguments(parser, ["fp32"], warmup=3, iters=10, calls=10, repeats=5)
    parser.add_argument("--layers", type=int, nargs="*", default=None, help="indices of the model's convolutions")
    parser.add_argument("--tiny", action="store_true", help="two tiny layers (smoke tests) instead of the model's")
    args = parser.parse_args(argv)
    if not common.probe_can_run(args, "probe_layers"):
        return 2

    model = "tiny" if args.tiny else args.model
    batch = args.batch or (DEFAULT_BATCH if args.phase == "train" else INFER_BATCH)[model]
    layers = MODELS[model]
    chosen = args.layers if args.layers else range(len(layers))
    config = {**vars(args), "model": model, "batch": batch}
    results = {"environment": common.environment(), "config": config, "rows": []}

    def report(name: str, row: dict[str, Any]) -> None:
        print(name, "layer", row["layer"], {key: round(v, 3) for key, v in (row.get("gpu_ms") or {}).items() if v},
              "nn/ours", common.fmt(row.get("nn_over_ours_gpu")), row.get("paths", {}),
              "numerics", common.verdict(row.get("numerics_passed")), row.get("error", ""), flush=True)
        for side_name in SIDES:
            for kernel_name, ms in ((row.get("gpu_kernels") or {}).get(side_name) or {}).items():
                print(f"   {side_name:4} {ms:8.3f} {kernel_name[:110]}")

    common.run_probe_rows(
        args, results, f"{NAME}-{model}" + ("-infer" if args.phase == "infer" else ""), chosen,
        label=lambda index: (model, "layer", index, layers[index]),
        measure=lambda index, mode: measure_layer(
            index, layers[index], batch, mode, args, ENDINGS.get(model, {}).get(index, "relu")),
        failed_row=lambda index: {"layer": index},
        report=report,
        summarize=lambda rows: {m: {f"{side}_ms": _total(rows, m, side) for side in SIDES} for m in args.modes},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
