"""Why a call takes the path it takes, what the plan cache holds, and what the extension runs with."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ._validation import activation_grad_memory_format
from .functional import _pair, _resolve_string_padding


def _version_string(encoded: int) -> str:
    """cuDNN 9 and the frontend both encode major*10000 + minor*100 + patch."""
    return f"{encoded // 10000}.{encoded // 100 % 100}.{encoded % 100}"


def versions() -> dict[str, str | None]:
    """Versions of torch, CUDA and cuDNN (compiled against and loaded), and of the cuDNN frontend."""
    compiled, loaded, frontend = torch.ops.convbias._cudnn_versions()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn_compiled": _version_string(compiled),
        "cudnn_loaded": _version_string(loaded),
        "cudnn_frontend": _version_string(frontend),
    }


def explain(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | Sequence[int] = 1,
    padding: str | int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    activation: str = "identity",
    negative_slope: float = 0.01,
    for_backward: bool = False,
    residual: torch.Tensor | None = None,
) -> dict[str, Any]:
    """The path ``conv_bias2d`` with these arguments takes, under the current torch flags.

    Keys: ``path`` (``fused``: one conv+bias graph; ``conv``: the conv graph of a call without bias;
    ``conv+bias_add``: conv graph then a bias add; ``aten``: ATen's convolution), ``notes`` (why, and why
    alternatives were rejected) and, on CUDA, ``engine`` (name, workspace, build time, runtime-compiled or not,
    timings of the candidates, rejections), ``layout`` (``channels_last``, ``copied to channels_last``, or for
    NCHW input and weight ``nchw graph`` / ``nchw via channels_last copies`` / ``nchw (aten)``), ``layout_timings``
    (``[way, ms]`` of each way measured: of running NCHW tensors, or for channels_last tensors with misaligned
    channel rows ``as_is`` and ``padded_channels``, for strided stems then ``space_to_depth``), ``padded_channels``
    (the input channel count the convolution ran with on zero-padded copies of input and weight,
    ``TORCH_CONVBIAS_PAD_CHANNELS``; null when it ran as it is), ``space_to_depth`` (a strided stem of at most 4
    channels run as a stride-1 convolution over its input regrouped into stride-sized blocks,
    ``TORCH_CONVBIAS_SPACE_TO_DEPTH``: ``blocks``, the regrouped ``channels`` and ``kernel``, and the regrouped
    problem's ``padded_channels``; or, ``patches`` true, a stride-1 stem run as a 1x1 convolution over its input
    unfolded into ``blocks``-sized patches, ``channels`` = C * R * S zero-padded to 16-byte rows; null when it ran its
    own way), ``matmul`` (true when the ATen path runs a channels_last float32 1x1 stride-1 convolution as one cuBLAS
    matrix multiply, the bias and a ReLU in its epilogue: measured faster than the graph and ATen's convolution under
    ``cudnn.benchmark``; never for strict fp32 while cuBLAS may use TF32, nor under deterministic algorithms) with
    ``matmul_ms`` (-1 when not measured), ``converted_input``, ``output``,
    ``alignment``, ``math`` (the flags that select engines), ``graph_ops`` (the cuDNN graph's operations in order,
    e.g. ``["CONV_FPROP", "ADD", "RELU_FWD"]``; empty on the ATen path), ``activation`` (``name``; ``fused``: true when
    the activation is the graph's last node, its epilogue, false when ATen's pointwise kernel runs it after the graph
    or after ATen's convolution; ``how``; ``why``: the graph that cuDNN rejected, the knob, or the timings;
    ``epilogue_ms`` / ``separate_ms``: the two routes, measured when choices are timed, -1 otherwise;
    ``keeps_preactivation``; ``preactivation_output``: the graph writes the pre-activation too), ``graph_outputs``
    (what the graph writes: ``["output"]``, or ``["output", "preactivation"]``), ``cached`` and
    ``plan_build_seconds``; ``batch_parts`` (``samples``, ``count``) when the call's input or output passes
    2^31 - 1 elements and it runs in parts of the batch that fit cuDNN's 32-bit indexing (the other keys then
    describe the first part). Builds and caches the plan if needed, exactly as the call would; on CUDA that may run the
    convolution a few times to time candidates.

    ``for_backward=True`` explains the call as autograd makes it when a gradient is needed: gelu, gelu_tanh, silu and
    leaky_relu with a negative slope then keep the pre-activation for their derivative
    (``torch.ops.convbias._forward_with_preactivation``: on CUDA channels_last one graph writing both tensors, its own
    plan); the other activations take the same path as without it.

    With ``residual`` it explains ``conv_bias2d(..., residual=residual)`` (``torch.ops.convbias.forward_residual``):
    the same keys, and ``residual`` (``fused``: the residual ADD is in the cuDNN graph, before the activation;
    ``bias_in_pass``: not fused, ATen's convolution runs without the bias and one pass adds the bias and the residual
    and applies the activation (two passes over the output, as Inductor's): where forward's route is ATen's
    convolution, or, timed, where that measured faster than forward's route (a graph) + the pass; ``path`` is then
    ``"aten"``; ``how``; ``why``;
    ``graph_ms`` / ``separate_ms``: the two routes, when timed). ``for_backward`` does not apply to it.
    """
    stride, dilation = _pair("stride", stride), _pair("dilation", dilation)
    if isinstance(padding, str):
        input, padding = _resolve_string_padding(input, weight, padding, stride, dilation)
    if residual is not None:
        if for_backward:
            raise ValueError("explain: `for_backward` does not apply with a `residual`")
        return json.loads(
            torch.ops.convbias._explain_residual(
                input, weight, bias, residual, stride, _pair("padding", padding), dilation, groups, activation,
                float(negative_slope),
            )
        )
    return json.loads(
        torch.ops.convbias._explain(
            input,
            weight,
            bias,
            stride,
            _pair("padding", padding),
            dilation,
            groups,
            activation,
            float(negative_slope),
            for_backward,
        )
    )


def explain_param_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    activation: str = "identity",
    negative_slope: float = 0.01,
    saved: torch.Tensor | None = None,
) -> dict[str, Any]:
    """How ``torch.ops.convbias.param_grad`` computes the weight and bias gradients for these arguments.

    ``padding`` is numeric here (the backward of ``padding='same'`` sees the resolved padding). Keys:
    ``weight_grad``: ``path`` (``cudnn graph``: a cuDNN conv_wgrad graph; ``aten``: ATen's weight gradient,
    nn.Conv2d's own) with ``notes`` saying why, and for channels_last tensors ``problem``, ``cached``,
    ``plan_build_seconds``, ``graph_ms`` / ``aten_ms`` (both measured once per key when timing is allowed, the
    faster kept; -1 when not measured), ``padded_channels`` (the input channel count the gradient ran with on a
    zero-padded copy of the input, ``TORCH_CONVBIAS_PAD_CHANNELS``; null when as it is) with ``padded_ms`` / ``as_is_ms``
    (the two ways, when measured), ``space_to_depth`` (a strided stem's gradient computed as the regrouped problem's,
    ``TORCH_CONVBIAS_SPACE_TO_DEPTH``: ``blocks``, ``channels``, ``kernel``, ``patches`` as in :func:`explain`; null
    otherwise) with ``space_to_depth_ms``
    / ``own_way_ms``, ``engine`` as in :func:`explain`, and ``batch_parts`` as there (the parts' weight
    gradients summed, in FP32 for half-precision weights). ``input_grad``: the path, problem, timings, notes and engine for the input gradient that autograd computes when the input requires grad (``cudnn graph``: a
    conv_dgrad graph, with choices timed under ``TORCH_CONVBIAS_INPUT_GRAD=timed`` (the default) where it measured
    faster, or wherever it builds under ``TORCH_CONVBIAS_INPUT_GRAD=graph``; ``aten``). ``bias_grad``: ``way`` (``kernel``:
    ours; ``cudnn``: a reduction graph; ``aten``: ATen's sum), ``notes`` and, for the kernel, ``launch``
    (``blocks_per_sm``, ``loads_in_flight``, ``bands``: ``contiguous`` or ``interleaved``, ``timed``). ``math``: the flags that select engines. Builds and caches
    plans exactly as the call would; on CUDA that may run the gradients a few times to time candidates.

    With an ``activation`` other than identity, ``grad_output`` is the gradient at the activation's output, as the
    backward of ``conv_bias2d(..., activation=...)`` receives it, and ``saved`` the tensor its derivative is computed
    from (the layer's output or pre-activation; by default a tensor like ``grad_output``). Then
    ``activation_backward`` says how the derivative and the bias gradient are computed
    (:func:`explain_activation_backward`); ``bias_grad`` is that pass's (``way`` ``fused`` when the fused kernel
    computes it) and ``weight_grad`` the weight gradient of the derivative's result.
    """
    conv_args = (_pair("stride", stride), _pair("padding", padding), _pair("dilation", dilation), groups)
    if activation == "identity":
        return json.loads(torch.ops.convbias._explain_param_grad(grad_output, input, weight, *conv_args))
    if saved is None:
        saved = torch.empty_like(grad_output)
    backward = explain_activation_backward(grad_output, saved, activation, negative_slope, bias_grad=True)
    # The weight gradient is taken of grad_z, which the backward allocates in this layout.
    grad_z = torch.empty(
        grad_output.shape,
        dtype=grad_output.dtype,
        device=grad_output.device,
        memory_format=activation_grad_memory_format(grad_output, saved),
    )
    info = json.loads(torch.ops.convbias._explain_param_grad(grad_z, input, weight, *conv_args))
    info["activation_backward"] = backward
    info["bias_grad"] = backward["bias_grad"]
    return info


def explain_activation_backward(
    grad_output: torch.Tensor,
    saved: torch.Tensor,
    activation: str,
    negative_slope: float = 0.01,
    bias_grad: bool = True,
) -> dict[str, Any]:
    """How ``torch.ops.convbias._activation_backward`` computes ``grad_z = grad_output * act'(saved)`` and (when
    ``bias_grad``) the bias gradient for these arguments.

    Keys: ``activation``; ``derivative_from`` (``output`` or ``pre-activation``: what ``saved`` is); ``way``
    (``fused kernel``: one pass that writes grad_z and sums it into the bias gradient; ``aten``: ATen's pointwise
    backward, then the bias gradient as param_grad computes it); ``notes`` (why the fused kernel did not run);
    ``launch`` for the fused kernel (as in :func:`explain_param_grad`); ``bias_grad`` (``way``: ``fused``, or the
    bias gradient's own way over grad_z, or ``none``, with its ``notes`` and ``launch``); on CUDA ``math``. May time
    the kernel's launch configurations once per shape, exactly as the call would.
    """
    return json.loads(
        torch.ops.convbias._explain_activation_backward(grad_output, saved, activation, float(negative_slope), bias_grad)
    )


def explain_input_grad_activation(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    saved: torch.Tensor,
    activation: str,
    negative_slope: float = 0.01,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    dilation: int | tuple[int, int] = 1,
    groups: int = 1,
) -> dict[str, Any]:
    """How ``torch.ops.convbias._input_grad_activation`` computes a layer's input gradient times the derivative of
    the activation below (``saved``: what that activation's backward keeps, of ``input``'s shape) and its bias
    gradient; the convbias backend puts that op into backward graphs where our input gradient feeds our activation
    backward.

    Keys: ``path`` (``cudnn graph``: one conv_dgrad graph with the activation's derivative in it, then the bias
    gradient; ``separate``: the input gradient as :func:`explain_param_grad`'s ``input_grad`` says, then the
    activation's backward as :func:`explain_activation_backward` says); ``activation``, ``derivative_from``,
    ``notes`` (why); when a plan was looked up ``problem``, ``cached``, ``plan_build_seconds``, ``graph_ms`` and
    ``separate_ms`` (both ways timed once per shape, bias gradient included; -1 when not measured) and ``engine``
    for the graph; on CUDA ``math``. The graph is tried only under ``TORCH_CONVBIAS_INPUT_GRAD=timed`` (the default)
    with choices timed (building the plan may run both ways a few times, exactly as the call would), or taken
    unmeasured wherever it builds under ``TORCH_CONVBIAS_INPUT_GRAD=graph``.
    """
    conv_args = (_pair("stride", stride), _pair("padding", padding), _pair("dilation", dilation), groups)
    return json.loads(
        torch.ops.convbias._explain_input_grad_activation(
            grad_output, input, weight, *conv_args, saved, activation, float(negative_slope)
        )
    )


def cache_info() -> dict[str, float]:
    """Plan cache statistics: hits, misses, evictions, size (= forward_plans + weight_grad_plans +
    input_grad_plans + input_grad_activation_plans + bias_grad_plans), capacity (TORCH_CONVBIAS_CACHE_SIZE, per kind of plan), build_seconds (time spent
    building and timing plans, or loading them from disk), workspace_fallbacks (calls that ran a lower-workspace
    plan because their plan's workspace could not be allocated), and the persistent plan cache's counters
    (TORCH_CONVBIAS_PLAN_CACHE_DIR): disk_enabled, disk_hits (plans loaded instead of built), disk_misses (no
    file for a key), disk_writes (plans stored) and disk_rejected (files found but not used: corrupted,
    truncated, written for another GPU / cuDNN / frontend or problem, or not rebuilt by cuDNN)."""
    return json.loads(torch.ops.convbias._plan_cache_stats())


def cache_clear() -> None:
    """Drop every cached plan (the next call of each shape builds again) and reset the statistics."""
    torch.ops.convbias._plan_cache_clear()


def self_check(device: str = "cuda") -> tuple[bool, str]:
    """Run the project's seed case (N=C=H=W=K=16, 3x3, pad 1, fp32, NCHW) against F.conv2d on `device`.

    Returns (passed, a one-line report with the path taken)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 16, 16, 16, generator=g).to(device)
    w = (torch.randn(16, 16, 3, 3, generator=g) / 12).to(device)
    b = torch.randn(16, generator=g).to(device)
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        out = torch.ops.convbias.forward(x, w, b, [1, 1], [1, 1], [1, 1], 1)
        error = (out - F.conv2d(x, w, b, padding=1)).abs().max().item()
        info = explain(x, w, b, padding=1)
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    passed = error < 1e-4
    where = f"path={info['path']}" + (f", layout={info['layout']}" if "layout" in info else "")
    return passed, f"seed case on {device}: {where}, max |error| vs F.conv2d = {error:.2e}"
