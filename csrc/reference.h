// Reference kernels built on ATen: the CPU implementation of the convbias ops, and the semantics that the
// cuDNN graphs on CUDA must reproduce.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

namespace convbias {

at::Tensor forward_reference(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups);

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> param_grad_reference(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 2> output_mask);

} // namespace convbias
