// The bias gradient as a cuDNN reduction graph: dy (channels_last) -> db [1, K, 1, 1], ADD with FP32 compute.
// One of the three ways measured for it (with our kernel and ATen's sum). On cuDNN 9.19 only a runtime-compiled
// engine takes this graph (150-700 ms to build per shape, design notes), and it carries a TENSOR_CORE note that
// means nothing for a reduction, so the TF32 filter is not applied to this graph kind.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "cuda/plan_cache.h"

namespace convbias::cuda {

// Whether the graph is tried: CUDA channels_last float/half/bfloat16 grad_output, 16-byte aligned, non-empty.
bool bias_reduction_applies(const at::Tensor& grad_output);

// grad_output summed over N, H, W in grad_output's dtype, or nullopt when no reduction plan builds.
std::optional<at::Tensor> bias_grad_cudnn(const at::Tensor& grad_output);

// Why no plan builds for this grad_output (after bias_grad_cudnn returned nullopt).
std::string bias_reduction_failure(const at::Tensor& grad_output);

// Its plan cache, reported and cleared with the others (torch_convbias.cache_info / cache_clear).
CacheStats bias_reduction_cache_stats();
void bias_reduction_cache_clear();

} // namespace convbias::cuda
