// CUDA kernels of the convbias ops. forward runs the cuDNN graph chosen for the problem (fused conv+bias,
// conv + bias add, or ATen where no graph builds). param_grad runs the ATen reference unless
// TORCH_CONVBIAS_PARAM_GRAD=cudnn selects the conv_wgrad graph (not yet verified on a GPU, so not the default).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>

#include "conv_args.h"
#include "cuda/forward_setup.h"
#include "cuda/wgrad.h"
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
  const cuda::ForwardRoute route = cuda::route_forward(input, weight, bias, params);
  if (route.aten_reason || route.plan->path == cuda::FpropPath::Aten) {
    return forward_reference(input, weight, bias, stride, padding, dilation, groups);
  }
  const cuda::PreparedForward& prepared = *route.prepared;
  cuda::run_fprop(*route.plan, prepared.problem, prepared.x, prepared.w, prepared.b, prepared.y);
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
  const ConvParams params = check_param_grad_args(grad_output, input, weight, stride, padding, dilation, groups);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const bool use_graphs = cuda::knobs().param_grad == "cudnn" && !cuda::aten_only_reason(input, weight);
  if (!use_graphs || !output_mask[0]) {
    return param_grad_reference(grad_output, input, weight, stride, padding, dilation, groups, output_mask);
  }
  constexpr auto cl = at::MemoryFormat::ChannelsLast;
  const at::Tensor dy = cuda::aligned_for_cudnn(grad_output.contiguous(cl), cl);
  const at::Tensor x = cuda::aligned_for_cudnn(input.contiguous(cl), cl);
  std::optional<at::Tensor> grad_weight = cuda::weight_grad(dy, x, weight, params);
  if (!grad_weight) {
    return param_grad_reference(grad_output, input, weight, stride, padding, dilation, groups, output_mask);
  }
  std::optional<at::Tensor> grad_bias;
  if (output_mask[1]) {
    // Summed over N, H, W with FP32 accumulation, rounded once to the gradient's dtype.
    grad_bias = at::sum(dy, {0, 2, 3}, /*keepdim=*/false, at::kFloat).to(grad_output.scalar_type());
  }
  return {grad_weight, grad_bias};
}

} // namespace

TORCH_LIBRARY_IMPL(convbias, CUDA, m) {
  m.impl("forward", &forward_cuda);
  m.impl("param_grad", &param_grad_cuda);
}

} // namespace convbias
