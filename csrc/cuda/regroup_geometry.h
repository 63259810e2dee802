// What the GPU's two regroupings of a stem's input share (space_to_depth_regroup.cu: blocks; unfold_patches.cu:
// patches): the input packed channels_last, the regrouped input's storage, and the sizes their kernels index with.
#pragma once

#include "cuda/space_to_depth.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

namespace convbias::cuda {

// Output positions are 32-bit (space_to_depth_of keeps the regrouped input within INT32_MAX elements); input
// offsets are 64-bit.
struct RegroupGeometry {
  int64_t height, width; // the input's
  int32_t channels; // the input's, C
  int32_t block_h, block_w; // blocks: the stride; patches: the kernel (R, S)
  int32_t out_h, out_w; // the regrouped input's spatial size
  int32_t before_h, before_w; // the convolution's padding before the input
  int32_t row; // the regrouped input's channels (patches: padded to 16-byte rows, the rest zeros)
};

struct RegroupBuffers {
  at::Tensor in; // x, packed channels_last: element (n, h, w, c) at ((n * H + h) * W + w) * C + c
  at::Tensor out; // the regrouped input's storage, [N, out_h, out_w, row], uninitialized
  RegroupGeometry geometry;
};

// x (any layout; a copy only where it is not packed channels_last) and g's regrouped input, allocated on x's device.
// The caller holds a device guard for x's device.
inline RegroupBuffers regroup_buffers(const at::Tensor& x, const SpaceToDepth& g) {
  at::Tensor in = x.contiguous(at::MemoryFormat::ChannelsLast);
  const int64_t row = g.channels(in.size(1));
  at::Tensor out = at::empty({in.size(0), g.input_blocks[0], g.input_blocks[1], row}, in.options());
  TORCH_INTERNAL_ASSERT(out.numel() <= std::numeric_limits<int32_t>::max());
  const RegroupGeometry geometry{
      in.size(2),
      in.size(3),
      static_cast<int32_t>(in.size(1)),
      static_cast<int32_t>(g.block[0]),
      static_cast<int32_t>(g.block[1]),
      static_cast<int32_t>(g.input_blocks[0]),
      static_cast<int32_t>(g.input_blocks[1]),
      static_cast<int32_t>(g.before[0]),
      static_cast<int32_t>(g.before[1]),
      static_cast<int32_t>(row)};
  return {std::move(in), std::move(out), geometry};
}

} // namespace convbias::cuda
