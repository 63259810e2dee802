// The bias add (or a residual's) and the activation in one pass over a convolution's output: what Inductor's fused pointwise kernel does
// after nn.Conv2d's convolution under torch.compile. The conv graph + this pass is the route that competes with the
// fused conv+bias graph + an activation pass (two passes after a slower engine, on strict fp32 where fused engines
// cost 0-20% more than conv-only ones) when choices are timed.
#pragma once

#include <ATen/core/Tensor.h>

#include "activation.h"

namespace convbias::cuda {

// y = act(y + addend) in place, computed in the opmath type (FP32 for 16-bit and float, FP64 for double) and rounded
// once; y is a CUDA tensor of any layout, `addend` of its dtype and device, broadcastable to it (a residual of y's
// shape, in any layout). Returns y.
at::Tensor& add_activation_(at::Tensor& y, const at::Tensor& addend, const ActivationSpec& activation);

// add_activation_ of the bias [K] of a [N, K, H, W] output, broadcast along N, H and W.
at::Tensor& bias_activation_(at::Tensor& y, const at::Tensor& bias, const ActivationSpec& activation);

// y = act(y + bias + residual) in place, in one pass: the bias [K] broadcast along N, H and W, the residual of y's
// shape in any layout; add_activation_'s math (summed in the opmath type, rounded once). The pass after ATen's
// convolution run without its bias in a residual block ending (run_aten_then_residual).
at::Tensor& bias_residual_activation_(
    at::Tensor& y, const at::Tensor& bias, const at::Tensor& residual, const ActivationSpec& activation);

// The activation pass after a cuDNN graph that did not apply it (the fused conv+bias graph, or one writing only the
// pre-activation z). float16 / bfloat16: a pass of ours with add_activation_'s math (the cheaper float math of
// activation_math.cuh, within one ulp: ATen's erff-based 16-bit GELU pass is arithmetic-bound on the H200); float and
// double: ATen's own kernel, so that those results stay exactly ATen's.
// In place over y (any layout):
at::Tensor& activation_after_graph_(at::Tensor& y, const ActivationSpec& activation);
// Out of place over z, into a new tensor with the strides of `format` (z is kept: the derivative needs it):
at::Tensor activation_after_graph(const at::Tensor& z, const ActivationSpec& activation, at::MemoryFormat format);

// out = act(in) by our pass (float16 / bfloat16 CUDA tensors; out may be in, any layouts): one kernel per activation,
// with the cheaper float math (fast, as activation_after_graph runs it) or ATen's formulas in float. For comparisons
// (convbias::_activation_pass).
void activation_16bit(at::Tensor& out, const at::Tensor& in, const ActivationSpec& activation, bool fast);

// What explain() calls that pass for `dtype`.
const char* activation_pass_name(at::ScalarType dtype);

} // namespace convbias::cuda
