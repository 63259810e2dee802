// Calls whose input or output side passes 2^31 - 1 elements (cuDNN's engines index with 32 bits), run in parts of
// the batch that fit, as ATen's own cuDNN convolution does, so that such a layer (N >= 1024 images into 64 channels
// at 224 x 224) keeps its fused graph: each part runs the plan of its own size, writing into its slice of one output
// (forward) or into a sum over the parts (weight gradient).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

namespace convbias::cuda {

// How many samples each part of the batch takes (the last part may take fewer), when the call needs parts: its input
// or output side (`output_numel`: the forward's output, the gradients' grad_output) passes 2^31 - 1 elements while
// one sample's does not. nullopt when the whole call fits, or when it cannot be split (one sample alone, or the
// weight, passes the limit: ATen then, aten_only_reason), or when the call goes to ATen whatever its size
// (aten_only_setting_reason). Parts are balanced, so a call has at most two part sizes,
// hence at most two plans.
std::optional<int64_t> batch_part_size(const at::Tensor& input, const at::Tensor& weight, int64_t output_numel);

// How many parts a batch of `batch` samples runs in, in parts of `part`.
inline int64_t batch_part_count(int64_t batch, int64_t part) {
  return (batch + part - 1) / part;
}

// f(start, samples) for each part of a batch of `batch` samples, in order.
template <typename F>
void for_each_batch_part(int64_t batch, int64_t part, F&& f) {
  for (int64_t start = 0; start < batch; start += part) {
    f(start, std::min(part, batch - start));
  }
}

// The note explain gives for a call run in parts of `part` samples.
std::string batch_parts_note(int64_t batch, int64_t part);

} // namespace convbias::cuda
