// Public C++ API of torch_convbias for LibTorch programs (no Python needed): link against the library
// (torch_convbias/libtorch_convbias.so; examples/libtorch/ shows how) and call these. They go through the PyTorch dispatcher, so they run the same
// kernels, autocast and autograd as torch.ops.convbias.* from Python.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/string_view.h>

#include <array>
#include <optional>
#include <tuple>
#include <utility>

namespace convbias {

// act(F.conv2d(input, weight, bias, stride, padding, dilation, groups)), bias and activation fused into the
// convolution. activation: "identity" (none), "relu", "leaky_relu" (with negative_slope), "gelu", "gelu_tanh"
// (tanh approximation), "silu", "sigmoid", "tanh".
inline at::Tensor forward_symint(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation,
    c10::SymInt groups,
    c10::string_view activation = "identity",
    double negative_slope = 0.01) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("convbias::forward", "")
                             .typed<at::Tensor(
                                 const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                 c10::SymIntArrayRef, c10::SymIntArrayRef, c10::SymIntArrayRef, c10::SymInt,
                                 c10::string_view, double)>();
  return op.call(input, weight, bias, stride, padding, dilation, std::move(groups), activation, negative_slope);
}

inline at::Tensor forward(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    c10::string_view activation = "identity",
    double negative_slope = 0.01) {
  return forward_symint(
      input, weight, bias, c10::fromIntArrayRefSlow(stride), c10::fromIntArrayRefSlow(padding),
      c10::fromIntArrayRefSlow(dilation), c10::SymInt(groups), activation, negative_slope);
}

// act(F.conv2d(input, weight, bias, ...) + residual): a residual block's ending in one op (csrc/ops.cpp).
inline at::Tensor forward_residual_symint(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& residual,
    c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation,
    c10::SymInt groups,
    c10::string_view activation = "identity",
    double negative_slope = 0.01) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("convbias::forward_residual", "")
                             .typed<at::Tensor(
                                 const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                 const at::Tensor&, c10::SymIntArrayRef, c10::SymIntArrayRef, c10::SymIntArrayRef,
                                 c10::SymInt, c10::string_view, double)>();
  return op.call(input, weight, bias, residual, stride, padding, dilation, std::move(groups), activation, negative_slope);
}

inline at::Tensor forward_residual(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& residual,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    c10::string_view activation = "identity",
    double negative_slope = 0.01) {
  return forward_residual_symint(
      input, weight, bias, residual, c10::fromIntArrayRefSlow(stride), c10::fromIntArrayRefSlow(padding),
      c10::fromIntArrayRefSlow(dilation), c10::SymInt(groups), activation, negative_slope);
}

// (grad_weight, grad_bias) of forward for the given grad_output; output_mask says which to compute.
inline std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> param_grad_symint(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation,
    c10::SymInt groups,
    std::array<bool, 2> output_mask = {true, true}) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("convbias::param_grad", "")
          .typed<std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef, c10::SymIntArrayRef,
              c10::SymIntArrayRef, c10::SymInt, std::array<bool, 2>)>();
  return op.call(grad_output, input, weight, stride, padding, dilation, std::move(groups), output_mask);
}

inline std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> param_grad(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 2> output_mask = {true, true}) {
  return param_grad_symint(
      grad_output, input, weight, c10::fromIntArrayRefSlow(stride), c10::fromIntArrayRefSlow(padding),
      c10::fromIntArrayRefSlow(dilation), c10::SymInt(groups), output_mask);
}

} // namespace convbias
