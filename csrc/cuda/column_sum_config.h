// How the column-sum kernels (column_sum.cuh: the bias gradient of bias_grad.cu and the fused activation backward of
// activation_backward.cu) are launched, and the choice of that launch per shape: timed once where timing is allowed,
// the default otherwise. Host code (column_sum_config.cpp), so that the choice lives in one place for both kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <utility>

namespace convbias::cuda {

// Blocks of 256 threads per SM, 16-byte loads in flight per thread (16 or 4; a kernel reading two tensors keeps
// half as many rows in flight), and whether each band of rows is one contiguous range or interleaved with the others.
struct LaunchConfig {
  int blocks_per_sm;
  int unroll;
  bool contiguous;
};

// The configuration used untimed (benchmark off, CUDA graph capture, determinism): see column_sum_config.cpp.
constexpr LaunchConfig kDefaultLaunchConfig = {4, 16, false};

// A launch configuration as explain() reports it.
struct KernelLaunch {
  int blocks_per_sm;
  int loads_in_flight;
  bool contiguous_bands; // each band of rows one range (else bands interleave)
  bool timed;
};

// Which column-sum kernel a configuration is chosen for: the plain bias gradient, or the fused activation backward
// of one activation (1 + its Activation enum value). Timed separately: the fused kernels move twice the bytes.
using ColumnSumKernel = int64_t;
constexpr ColumnSumKernel kBiasGradKernel = 0;

// The configuration for a column sum over `like` (a channels_last [N, K, H, W] tensor: rows N*H*W, K columns) by
// `kernel`, and whether it was measured (false: the default). Timed once per (device, dtype, rows, K, kernel) among a
// few candidates by calling `run` with each, where timing is asked for (cudnn.benchmark, TORCH_CONVBIAS_AUTOTUNE=
// quick/on) and the stream is not capturing; never under determinism, where the summation order must not depend on a
// timing. `run` must launch the kernel on the current stream with the given configuration and may write its outputs.
std::pair<LaunchConfig, bool> column_sum_config(
    const at::Tensor& like, ColumnSumKernel kernel, const std::function<void(LaunchConfig)>& run);

} // namespace convbias::cuda
