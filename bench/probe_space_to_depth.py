"""Probe (issue 14): strided stems as stride-1 convolutions over space-to-depth inputs.

A network's first convolution reads C=3 channels with a large kernel and stride (AlexNet: 11x11, stride 4; ResNet:
7x7, stride 2). cuDNN runs it far below the GPU's rate (on the H100 at 690a2ff AlexNet's stem took 3.1 of its 7.5 ms
TF32 inference, with an sm80 "indexed_wo_smem" kernel: `models-nvidia-h100-80gb-hbm3.json`), and zero-padding the
channels to 16-byte rows measured slower still. The same convolution, exactly, is a stride-1 convolution of
``C * sh * sw`` channels and a ``ceil(R / sh) x ceil(S / sw)`` kernel over the input regrouped into ``sh x sw``
blocks (space-to-depth), with the weight regrouped alike (zeros where the kernel does not reach a whole block):

    X[n, (c, a, b), i, j] = x_pad[n, c, sh*i + a, sw*j + b]        W'[k, (c, a, b), u, v] = w_pad[k, c, sh*u + a, sw*v + b]
    conv(X, W', stride 1)[n, k, i, j] = sum x_pad[n, c, sh*i + r, sw*j + t] * w_pad[k, c, r, t] = conv(x, w, stride s)

AlexNet's stem becomes 48 channels, 3x3 (1.19x the multiply-adds, the zeros); ResNet's 12 channels, 4x4 (1.31x).
Whether that is faster on the GPU, with the regrouping's pass over the input counted, is what this measures before
the op gets such a way. A stride-1 stem (VGG's 3x3 over RGB) has no blocks: its rows unfold the input into patches
instead (``C * R * S`` channels zero-padded to 16-byte rows, a 1x1 kernel), the op's ``patches`` way; the variants
below then name the unfolded problem. Per shape and mode, all with bias and ReLU (the stems' own):

=================  ===============================================================================================
aten               ``F.relu(F.conv2d(x, w, b, stride, padding))``: nn.Conv2d's computation
ours               ``torch.ops.convbias.forward(x, w, b, ..., "relu")`` as it is
ours_s2d           the input and weight regrouped (``space_to_depth_input``: a pad and a permuted copy, two passes
                   where one kernel of the op would make one), then ``convbias.forward`` at stride 1
ours_s2d_conv      ``convbias.forward`` on the regrouped tensors alone (what a one-pass regrouping leaves to add)
aten_s2d_conv      ``F.relu(F.conv2d(...))`` on the regrouped tensors (whether ATen's cuDNN call gains as well)
regroup            the input's regrouping alone, as ``ours_s2d`` makes it (ATen's pad and permuted copy)
regroup_op         the input's regrouping by the op's own way (``convbias::_space_to_depth``: its one-pass kernel
                   on the GPU, for patches the shared-memory unfolding; the weight's regrouping, a few KB, included)
ours_wgrad         ``convbias.param_grad`` of the stem as it is (a stem's input needs no gradient)
ours_s2d_wgrad     ``convbias.param_grad`` of the regrouped problem (forward saved the regrouped input) and the
                   weight gradient regrouped back (``weight_grad_from_space_to_depth``)
=================  ===============================================================================================

GPU time: each variant captured in a CUDA graph and the replays timed interleaved (``common.time_side_by_side``);
beside it back-to-back rates of the calls themselves. Under ``cudnn.benchmark`` (every choice of ours timed, the
padded-channels way included). Each forward and weight gradient is checked against the original problem computed in
float64 (``common.check_against_float64``). Where the op has the way itself (``TORCH_CONVBIAS_SPACE_TO_DEPTH``, default
``auto``: measured under ``cudnn.benchmark``), ``ours`` may already run regrouped (``paths`` records explain()'s
``space_to_depth``): set the knob ``off`` to measure the problem's own way. Run on a GPU: ``python -m bench.probe_space_to_depth [--out DIR]``;
``--device cpu --tiny`` is the CPU smoke test's (tests/test_probe_space_to_depth.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from . import common

NAME = "space_to_depth"
# (label, N, C, H=W, K, kernel, stride, padding)
SHAPES = [
    ("alexnet stem, inference batch", 1024, 3, 224, 64, 11, 4, 2),
    ("alexnet stem, training batch", 512, 3, 224, 64, 11, 4, 2),
    ("resnet50 stem", 256, 3, 224, 64, 7, 2, 3),
    ("3x3 stride-2 stem (MobileNet, EfficientNet)", 512, 3, 224, 32, 3, 2, 1),
    ("vgg stem, inference batch (patches)", 256, 3, 224, 64, 3, 1, 1),
    ("vgg stem, training batch (patches)", 128, 3, 224, 64, 3, 1, 1),
]
TINY = [
    ("tiny 5x5 stride 2", 2, 3, 13, 4, 5, 2, 1),
    ("tiny 11x11 stride 4", 2, 3, 30, 4, 11, 4, 2),
    ("tiny 3x3 stride 1 (patches)", 2, 3, 9, 4, 3, 1, 1),
]
FORWARD = ("aten", "ours", "ours_s2d", "ours_s2d_conv", "aten_s2d_conv", "regroup", "regroup_op")
WGRAD = ("ours_wgrad", "ours_s2d_wgrad")


def regrouped_geometry(size: int, kernel: int, stride: int, padding: int) -> tuple[int, int, int]:
    """(output size, kernel in blocks, padded input size) along one spatial dimension: the padded input spans exactly the
    blocks the stride-1 convolution reads, ``stride * (out - 1 + blocks)`` elements from ``-padding`` on (more than
    the input plus padding: zeros; fewer: rows no output reads, cropped)."""
    out = (size + 2 * padding - kernel) // stride + 1
    if out < 1:
        raise ValueError(f"kernel {kernel} with padding {padding} does not fit an input of size {size}")
    blocks = -(-kernel // stride)
    return out, blocks, stride * (out - 1 + blocks)


def _blocks_to_channels(t: torch.Tensor, sh: int, sw: int) -> torch.Tensor:
    """[A, C, sh*P, sw*Q] -> channels_last [A, C*sh*sw, P, Q], channel (c, a, b) = element (sh*p + a, sw*q + b) of c."""
    a, c, h, w = t.shape
    blocks = t.reshape(a, c, h // sh, sh, w // sw, sw).permute(0, 1, 3, 5, 2, 4)
    return blocks.reshape(a, c * sh * sw, h // sh, w // sw).contiguous(memory_format=torch.channels_last)


def space_to_depth_input(x: torch.Tensor, kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int]) -> torch.Tensor:
    """The input of the stride-1 problem equal to ``conv2d(x, w, stride=stride, padding=padding)`` (module docstring)."""
    (_, _, ph_total), (_, _, pw_total) = (
        regrouped_geometry(x.shape[2], kernel[0], stride[0], padding[0]),
        regrouped_geometry(x.shape[3], kernel[1], stride[1], padding[1]),
    )
    # F.pad's negative amounts crop: rows past the padded extent are read by no output.
    padded = F.pad(x, (padding[1], pw_total - padding[1] - x.shape[3], padding[0], ph_total - padding[0] - x.shape[2]))
    return _blocks_to_channels(padded, stride[0], stride[1])


def space_to_depth_weight(w: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    """The weight of the stride-1 problem: ``w`` zero-padded to whole blocks, each block's elements made channels."""
    (_, _, r, s), (sh, sw) = w.shape, stride
    rb, sb = -(-r // sh), -(-s // sw)
    return _blocks_to_channels(F.pad(w, (0, sb * sw - s, 0, rb * sh - r)), sh, sw)


def weight_grad_from_space_to_depth(grad: torch.Tensor, kernel: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """The original weight's gradient from the regrouped weight's: the regrouping undone, the padding's zeros dropped
    (their gradient is no weight's)."""
    k, cbb, rb, sb = grad.shape
    (sh, sw), (r, s) = stride, kernel
    c = cbb // (sh * sw)
    whole = grad.reshape(k, c, sh, sw, rb, sb).permute(0, 1, 4, 2, 5, 3).reshape(k, c, rb * sh, sb * sw)
    return whole[:, :, :r, :s].contiguous(memory_format=torch.channels_last)


def patch_channels(taps: int, dtype: torch.dtype) -> int:
    """The unfolded channels ``taps`` = C * R * S rounded up to 16-byte rows, as the op pads them."""
    per_row = 16 // torch.empty((), dtype=dtype).element_size()
    return -(-taps // per_row) * per_row


def patches_input(x: torch.Tensor, kernel: Sequence[int], padding: Sequence[int], channels: int) -> torch.Tensor:
    """x unfolded into kernel-sized patches at stride 1 (``F.unfold``'s (c, r, s) order): channels_last [N, channels,
    P, Q], the channels past C * R * S zeros."""
    n = x.shape[0]
    p, q = (x.shape[2 + d] + 2 * padding[d] - kernel[d] + 1 for d in range(2))
    columns = F.unfold(x, list(kernel), padding=list(padding))  # [N, C*R*S, P*Q]
    out = x.new_zeros(n, p, q, channels)
    out[..., : columns.shape[1]] = columns.transpose(1, 2).reshape(n, p, q, -1)
    return out.permute(0, 3, 1, 2)


def patches_weight(w: torch.Tensor, channels: int) -> torch.Tensor:
    """The 1x1 weight over the patches: w's (c, r, s) entries as channels, zeros past them."""
    k, taps = w.shape[0], w[0].numel()
    out = w.new_zeros(k, channels, 1, 1)
    out[:, :taps, 0, 0] = w.reshape(k, taps)
    return out.contiguous(memory_format=torch.channels_last)


def weight_grad_from_patches(grad: torch.Tensor, weight_shape: Sequence[int]) -> torch.Tensor:
    """The original weight's gradient from the 1x1 weight's: its first C * R * S channels, shaped back."""
    k, c, r, s = weight_shape
    return grad[:, : c * r * s, 0, 0].reshape(k, c, r, s).contiguous(memory_format=torch.channels_last)


def measure_row(shape: tuple[Any, ...], mode: common.Mode, args: argparse.Namespace) -> dict[str, Any]:
    label, n, c, side, k, kernel, stride, padding = shape
    device = args.device
    kernels, strides, paddings, ones = [kernel, kernel], [stride, stride], [padding, padding], [1, 1]
    generator = torch.Generator(device=device).manual_seed(0)

    def draw(*size: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*size, generator=generator, device=device) * scale
        return t.to(mode.dtype).contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t.to(mode.dtype)

    out = regrouped_geometry(side, kernel, stride, padding)[0]
    x, dy = draw(n, c, side, side), draw(n, k, out, out)
    w = draw(k, c, kernel, kernel, scale=(c * kernel * kernel) ** -0.5)
    b = draw(k)
    # The regrouping this shape takes: blocks for a strided stem, patches at stride 1 (the module docstring).
    patches = stride == 1
    channels = patch_channels(c * kernel * kernel, mode.dtype)
    regroup_x: Callable[[], torch.Tensor] = (
        (lambda: patches_input(x, kernels, paddings, channels)) if patches
        else (lambda: space_to_depth_input(x, kernels, strides, paddings))
    )  # fmt: skip
    regroup_w = (lambda: patches_weight(w, channels)) if patches else (lambda: space_to_depth_weight(w, strides))
    back: Callable[[torch.Tensor], torch.Tensor] = (
        (lambda grad: weight_grad_from_patches(grad, w.shape)) if patches
        else (lambda grad: weight_grad_from_space_to_depth(grad, kernels, strides))
    )  # fmt: skip
    xs, ws = regroup_x(), regroup_w()
    row: dict[str, Any] = {"label": label, "mode": mode.name, "shape": list(shape[1:]),
                           "regrouped": {"input": list(xs.shape), "weight": list(ws.shape), "patches": patches}}
    forward = torch.ops.convbias.forward
    param_grad = torch.ops.convbias.param_grad
    fns: dict[str, Callable[[], Any]] = {
        "aten": lambda: F.relu(F.conv2d(x, w, b, strides, paddings)),
        "ours": lambda: forward(x, w, b, strides, paddings, ones, 1, "relu"),
        "ours_s2d": lambda: forward(regroup_x(), regroup_w(), b, ones, [0, 0], ones, 1, "relu"),
        "ours_s2d_conv": lambda: forward(xs, ws, b, ones, [0, 0], ones, 1, "relu"),
        "aten_s2d_conv": lambda: F.relu(F.conv2d(xs, ws, b)),
        "regroup": regroup_x,
        "regroup_op": lambda: torch.ops.convbias._space_to_depth(x, w, strides, paddings, ones, 1)[0],
        "ours_wgrad": lambda: param_grad(dy, x, w, strides, paddings, ones, 1, [True, True]),
        "ours_s2d_wgrad": lambda: _regrouped_wgrad(param_grad(dy, xs, ws, ones, [0, 0], ones, 1, [True, True]), back),
    }
    with torch.no_grad():
        x64, w64, b64, dy64 = x.double(), w.double(), b.double(), dy.double()
        expected = F.relu(F.conv2d(x64, w64, b64, strides, paddings))
        with torch.enable_grad():
            w64.requires_grad_()
            z = F.conv2d(x64, w64, b64, strides, paddings)
            (expected_wgrad,) = torch.autograd.grad(z, w64, dy64)
        terms = c * kernel * kernel
        row["numerics"] = {
            name: common.check_against_float64(fns[name](), expected, mode, terms)
            for name in ("aten", "ours", "ours_s2d", "ours_s2d_conv", "aten_s2d_conv")
        }
        wgrad_terms = n * expected.shape[2] * expected.shape[3]
        for name in WGRAD:
            grad_w, grad_b = fns[name]()
            row["numerics"][name] = common.check_against_float64(grad_w, expected_wgrad, mode, wgrad_terms)
            row["numerics"][name + "_bias"] = common.check_against_float64(grad_b, dy64.sum((0, 2, 3)), mode, wgrad_terms)
        # The op's regrouping is a copy: exactly the probe's.
        same = bool(torch.equal(fns["regroup_op"](), xs))
        row["numerics"]["regroup_op"] = {"passed": same, "message": f"equal to the probe's regrouping: {same}"}
        row["numerics_passed"] = all(check.get("passed") for check in row["numerics"].values())
        if device == "cuda":
            replays = {name: common.capture_replay(fn) for name, fn in fns.items()}
        else:
            replays = fns
        row["gpu_time"] = common.time_side_by_side(replays, args.warmup, args.iters, device)
        row["back_to_back"] = common.time_back_to_back(fns, args.calls, args.repeats, device)
    gpu = {name: timing["median_ms"] for name, timing in row["gpu_time"].items()}
    row["gpu_ms"] = gpu
    row["s2d_over_ours_gpu"] = gpu["ours"] / gpu["ours_s2d"]
    row["s2d_conv_over_ours_gpu"] = gpu["ours"] / gpu["ours_s2d_conv"]
    row["s2d_over_aten_gpu"] = gpu["aten"] / gpu["ours_s2d"]
    row["s2d_wgrad_over_ours_gpu"] = gpu["ours_wgrad"] / gpu["ours_s2d_wgrad"]
    row["regroup_op_over_regroup_gpu"] = gpu["regroup"] / gpu["regroup_op"]
    if device == "cuda":
        from torch_convbias import explain, explain_param_grad

        row["paths"] = {
            "ours": explain(x, w, b, stride=strides, padding=paddings, activation="relu"),
            "ours_s2d": explain(xs, ws, b, activation="relu"),
            "ours_wgrad": explain_param_grad(dy, x, w, stride=strides, padding=paddings),
            "ours_s2d_wgrad": explain_param_grad(dy, xs, ws),
        }
    return row


# The ratios the summary takes the geometric mean of, per mode.
SUMMARY_RATIOS = ("s2d_over_ours_gpu", "s2d_conv_over_ours_gpu", "s2d_over_aten_gpu", "s2d_wgrad_over_ours_gpu",
                  "regroup_op_over_regroup_gpu")


def _regrouped_wgrad(
    grads: Sequence[torch.Tensor | None], back: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[Any, Any]:
    grad_w, grad_b = grads
    assert grad_w is not None
    return back(grad_w), grad_b


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_probe_arguments(parser, ["bf16", "tf32", "fp32"], warmup=3, iters=20, calls=10, repeats=5)
    parser.add_argument("--shapes", type=int, nargs="*", default=None, help="indices into SHAPES (default all)")
    parser.add_argument("--tiny", action="store_true", help="the tiny shapes (smoke tests) instead of SHAPES")
    args = parser.parse_args(argv)
    if not common.probe_can_run(args, "probe_space_to_depth"):
        return 2

    suite = TINY if args.tiny else SHAPES
    shapes = [suite[i] for i in args.shapes] if args.shapes else suite
    results = {"environment": common.environment(), "config": {**vars(args), "shapes": shapes}, "rows": []}

    def report(name: str, row: dict[str, Any]) -> None:
        print(name, row["label"], {key: round(value, 3) for key, value in row.get("gpu_ms", {}).items()},
              {key: round(value, 3) for key, value in row.items() if key.endswith("_gpu")},
              "numerics", common.verdict(row.get("numerics_passed")), row.get("error", ""), flush=True)

    def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {m: {key: common.geomean(r.get(key) for r in rows if r["mode"] == m) for key in SUMMARY_RATIOS}
                for m in args.modes}  # fmt: skip

    common.run_probe_rows(
        args, results, NAME, shapes,
        label=lambda shape: (shape[0],),
        measure=lambda shape, mode: measure_row(shape, mode, args),
        failed_row=lambda shape: {"label": shape[0], "shape": list(shape[1:])},
        report=report,
        summarize=summarize,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
