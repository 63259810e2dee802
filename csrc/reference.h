// Reference kernels built on ATen: the CPU implementation of the convbias ops, and the semantics that the
// cuDNN graphs on CUDA must reproduce.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

#include "activation.h"

namespace convbias {

// `t` as ATen's CPU convolutions can take it: float32 for a bfloat16/half CPU tensor (rounded back by the caller),
// else `t` itself. ATen's 16-bit CPU convolution segfaults on some valid problems (torch 2.14.1, found by
// tests/test_fuzz.py: e.g. a bf16 NCHW input 1x2x2x7, kernel 4x3, padding (4, 3), dilation 3), and it accumulates
// in float32 anyway. Used by the reference kernels and by the input gradient (autograd.cpp).
at::Tensor cpu_computable(const at::Tensor& t);

// act(conv(input, weight) + bias) by ATen, the activation applied before a 16-bit CPU result is rounded (one
// rounding, as a fused epilogue). Arguments must have passed check_forward_args.
at::Tensor forward_reference(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const ActivationSpec& activation = {});

// act(conv(input, weight) + bias + residual) by ATen: convolution, then the residual added and the activation applied
// before a 16-bit CPU result is rounded (on CUDA the convolution's 16-bit output is rounded before the add), in the
// layout F.conv2d returns. Arguments must have passed check_forward_residual_call.
at::Tensor forward_residual_reference(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& residual,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const ActivationSpec& activation);

// (act(z), z) for z = conv(input, weight) + bias by ATen: z rounded to the input's dtype first, then the activation
// applied to it out of place (for identity a copy, so that the two outputs never alias). The second rounding is what
// the CUDA route without the activation in its graph computes too; a graph writing both may read the FP32 z instead, so
// 16-bit outputs may differ from this by one rounding of the activation's input. Both tensors in the layout
// F.conv2d returns. Arguments must have passed check_forward_args.
std::tuple<at::Tensor, at::Tensor> forward_with_preactivation_reference(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const ActivationSpec& activation);

// act(z) of a forward's pre-activation z, as a new tensor with the strides of `format` (a copy for identity): the
// activation pass of the routes that keep z.
at::Tensor activation_after_preactivation(
    const at::Tensor& z, const ActivationSpec& activation, at::MemoryFormat format);

// grad_output.sum((0, 2, 3)) with FP32 accumulation (FP64 for double), rounded once to grad_output's dtype, as ATen's
// convolution_backward computes the bias gradient.
at::Tensor bias_grad_reference(const at::Tensor& grad_output);

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> param_grad_reference(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 2> output_mask);

// The input gradient of F.conv2d (ATen's convolution backward; on the CPU 16-bit problems in float32, rounded once),
// in input's dtype and the memory format of output_memory_format(input, weight); `input` gives the shape and layout
// only (autograd may pass a stand-in whose data is never read).
at::Tensor input_grad_reference(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups);

} // namespace convbias
