// The bias gradient: dy summed over N, H and W with FP32 accumulation, for channels_last dy, by a kernel of our
// own: the column sum of column_sum.cuh over dy itself (SumOf), launched as column_sum_config chooses. Bitwise
// repeatable (fixed reduction order, no atomics).
#include "cuda/bias_grad.h"
#include "cuda/column_sum.cuh"
#include "cuda/column_sum_config.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

namespace convbias::cuda {
namespace {

using column_sum::kVectorBytes;

template <typename T>
at::Tensor launch(const at::Tensor& dy, LaunchConfig config) {
  const int64_t columns = dy.size(1);
  const column_sum::SumOf<T> source{static_cast<const uint4*>(dy.const_data_ptr())};
  return column_sum::column_sums(source, dy.numel() / columns, columns, dy.options(), config);
}

} // namespace

bool bias_grad_kernel_applies(const at::Tensor& grad_output) {
  if (grad_output.dim() != 4 || grad_output.numel() == 0 || !grad_output.is_cuda() ||
      !grad_output.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    return false;
  }
  const auto dtype = grad_output.scalar_type();
  if (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16 && dtype != at::kDouble) {
    return false;
  }
  // 16-byte vectors along K: K a multiple of the vector width and a 16-byte aligned base.
  const int64_t vec = kVectorBytes / grad_output.element_size();
  return grad_output.size(1) % vec == 0 && reinterpret_cast<uintptr_t>(grad_output.const_data_ptr()) % 16 == 0;
}

namespace {

at::Tensor launch_for(const at::Tensor& grad_output, LaunchConfig config) {
  switch (grad_output.scalar_type()) {
    case at::kFloat: return launch<float>(grad_output, config);
    case at::kDouble: return launch<double>(grad_output, config);
    case at::kHalf: return launch<at::Half>(grad_output, config);
    case at::kBFloat16: return launch<at::BFloat16>(grad_output, config);
    default: TORCH_CHECK(false, "convbias: no bias-gradient kernel for ", grad_output.scalar_type());
  }
}

std::pair<LaunchConfig, bool> config_for(const at::Tensor& grad_output) {
  return column_sum_config(
      grad_output, kBiasGradKernel, [&](LaunchConfig config) { (void)launch_for(grad_output, config); });
}

} // namespace

at::Tensor bias_grad_channels_last(const at::Tensor& grad_output) {
  TORCH_INTERNAL_ASSERT(bias_grad_kernel_applies(grad_output));
  const c10::cuda::CUDAGuard guard(grad_output.device());
  return launch_for(grad_output, config_for(grad_output).first);
}

BiasKernelLaunch bias_grad_kernel_launch(const at::Tensor& grad_output) {
  TORCH_INTERNAL_ASSERT(bias_grad_kernel_applies(grad_output));
  const c10::cuda::CUDAGuard guard(grad_output.device());
  const auto [config, timed] = config_for(grad_output);
  return {config.blocks_per_sm, config.unroll, config.contiguous, timed};
}

} // namespace convbias::cuda
