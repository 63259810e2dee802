// CUDA kernels of the convbias ops. For now they run the ATen reference (cuDNN through PyTorch's own
// convolution); the cuDNN Graph API forward and parameter-gradient graphs replace them.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "reference.h"

namespace convbias {
namespace {

at::Tensor forward_cuda(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups) {
  const c10::cuda::OptionalCUDAGuard device_guard(input.device());
  return forward_reference(input, weight, bias, stride, padding, dilation, groups);
}

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> param_grad_cuda(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 2> output_mask) {
  const c10::cuda::OptionalCUDAGuard device_guard(input.device());
  return param_grad_reference(grad_output, input, weight, stride, padding, dilation, groups, output_mask);
}

} // namespace

TORCH_LIBRARY_IMPL(convbias, CUDA, m) {
  m.impl("forward", &forward_cuda);
  m.impl("param_grad", &param_grad_cuda);
}

} // namespace convbias
