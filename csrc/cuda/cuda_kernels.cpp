// CUDA kernels of the convbias ops. forward runs the cuDNN graph chosen for the problem (fused conv+bias,
// conv + bias add, or ATen where no graph builds); param_grad still runs the ATen reference until the
// parameter-gradient graphs land.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>

#include "conv_args.h"
#include "cuda/forward_setup.h"
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
  const ConvParams params = check_forward_args(input, weight, bias, stride, padding, dilation, groups);
  const c10::cuda::CUDAGuard device_guard(input.device());
  if (cuda::aten_only_reason(input, weight)) {
    return forward_reference(input, weight, bias, stride, padding, dilation, groups);
  }
  const cuda::PreparedForward prepared = cuda::prepare_forward(input, weight, bias, params);
  const auto plan = cuda::fprop_plan(prepared.problem, prepared.x, prepared.w, prepared.b, prepared.y);
  if (plan->path == cuda::FpropPath::Aten) {
    return forward_reference(input, weight, bias, stride, padding, dilation, groups);
  }
  cuda::run_fprop(*plan, prepared.problem, prepared.x, prepared.w, prepared.b, prepared.y);
  // The graph writes channels_last; F.conv2d gives NCHW for NCHW input and weight.
  return prepared.y.contiguous(output_memory_format(input, weight));
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
