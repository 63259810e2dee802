// Calls whose input or output side passes 2^31 - 1 elements (cuDNN's engines index with 32 bits), run in parts of
// the batch that fit, as ATen's own cuDNN convolution does, so that such a layer (N >= 1024 images into 64 channels
// at 224 x 224) keeps its fused graph: each part runs the plan of its own size, writing into its slice of one output
// (forward) or into a sum over the parts (weight gradient).
#pragma once

#include <ATen/core/Tensor.h>

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

// The note explain gives for a call run in parts of `part` samples.
std::string batch_parts_note(int64_t batch, int64_t part);

} // namespace convbias::cuda
