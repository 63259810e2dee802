// The launch size of the memory-bound copy kernels (pad_channels.cu, space_to_depth_regroup.cu), which walk their work
// in grid-stride loops.
#pragma once

#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cstdint>

namespace convbias::cuda {

// Blocks of `threads` for `units` work items: one item a thread, but at most 32 blocks per multiprocessor (enough to
// keep the memory system busy; the loop takes the rest), and at least one.
inline int64_t grid_stride_blocks(int64_t units, int64_t threads) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return std::max<int64_t>(1, std::min<int64_t>((units + threads - 1) / threads, sms * 32));
}

} // namespace convbias::cuda
