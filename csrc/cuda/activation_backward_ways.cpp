// convbias::_activation_backward on CUDA: the fused kernel (activation_backward.cu) where it applies, else what the
// backward did before it existed: ATen's pointwise backward, then the bias gradient as param_grad computes it.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/activation_backward.h"
#include "cuda/bias_grad.h"
#include "cuda/knobs.h"

namespace convbias::cuda {

ActivationBackwardWay activation_backward_way(
    const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& activation, bool with_bias_grad) {
  if (activation.is_identity()) {
    return {false, {"identity has no derivative to fuse: grad_z is a copy of grad_output"}};
  }
  if (!with_bias_grad) {
    // One pointwise pass either way; ATen's is the reference.
    return {false, {"no bias gradient asked for: ATen's pointwise backward"}};
  }
  // TORCH_CONVBIAS_BIAS_GRAD names the bias gradient's way; the fused kernel is ours ("kernel", the default).
  const std::string& way = knobs().bias_grad;
  if (way != "kernel") {
    return {false, {"TORCH_CONVBIAS_BIAS_GRAD=" + way}};
  }
  if (auto refusal = fused_activation_backward_refusal(grad_output, saved, activation)) {
    return {false, {*refusal}};
  }
  return {true, {}};
}

std::tuple<at::Tensor, std::optional<at::Tensor>> activation_backward(
    const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& activation, bool with_bias_grad) {
  const c10::cuda::CUDAGuard device_guard(grad_output.device());
  if (activation_backward_way(grad_output, saved, activation, with_bias_grad).fused) {
    auto [grad_z, grad_bias] = fused_activation_backward(grad_output, saved, activation);
    return {std::move(grad_z), std::move(grad_bias)};
  }
  at::Tensor grad_z = at::empty(
      grad_output.sizes(), grad_output.options().memory_format(activation_grad_memory_format(grad_output, saved)));
  activation_backward_out(grad_z, grad_output, saved, activation);
  std::optional<at::Tensor> grad_bias;
  if (with_bias_grad) {
    grad_bias = bias_grad(grad_z);
  }
  return {std::move(grad_z), std::move(grad_bias)};
}

} // namespace convbias::cuda
