// The bias gradient (grad_output summed over N, H, W, accumulated in FP32) by a kernel of our own.
#pragma once

#include <ATen/core/Tensor.h>

#include "cuda/column_sum_config.h"

#include <string>
#include <vector>

namespace convbias::cuda {

// Whether the kernel takes this grad_output: a CUDA channels_last (NHWC-packed) 4-D tensor of float, double,
// half or bfloat16 whose channel rows are whole 16-byte vectors (K a multiple of 4 in fp32, 8 in 16-bit types)
// on a 16-byte aligned base. Others go to ATen's sum.
bool bias_grad_kernel_applies(const at::Tensor& grad_output);

// grad_output.sum((0, 2, 3)) with FP32 (FP64 for double) accumulation, rounded once to grad_output's dtype;
// deterministic (fixed reduction order). Requires bias_grad_kernel_applies(grad_output).
at::Tensor bias_grad_channels_last(const at::Tensor& grad_output);

// The kernel's launch configuration for grad_output, as a call would use it: timed once per (device, dtype,
// rows, K) among a few where timing is allowed, else the default (`timed` false). column_sum_config.h says how.
using BiasKernelLaunch = KernelLaunch;
BiasKernelLaunch bias_grad_kernel_launch(const at::Tensor& grad_output);

// Which way param_grad computes the bias gradient of grad_output ("kernel", "cudnn" or "aten"), and why.
struct BiasGradWay {
  std::string way;
  std::vector<std::string> notes;
};
BiasGradWay bias_grad_way(const at::Tensor& grad_output);

// The bias gradient as param_grad computes it (bias_grad_ways.cpp): by TORCH_CONVBIAS_BIAS_GRAD's way (kernel by
// default; cudnn: the reduction graph of bias_reduction.h) where it applies, else by ATen's sum (FP32
// accumulation, FP64 for double, rounded once).
at::Tensor bias_grad(const at::Tensor& grad_output);

// convbias::_bias_grad(grad_output, way): one way by name, "kernel", "cudnn" or "aten" (benchmarks and tests).
at::Tensor bias_grad_with(const at::Tensor& grad_output, c10::string_view way);

} // namespace convbias::cuda
