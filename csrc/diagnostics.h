// What the extension was built against, what it runs with, and what its plan cache holds: for
// torch_convbias.versions(), cache_info() and the doctor.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace convbias {

// {CUDNN_VERSION at build time, cudnnGetVersion() at run time, CUDNN_FRONTEND_VERSION}.
std::vector<int64_t> cudnn_versions();

// The plan cache's statistics as a JSON object: hits, misses, evictions, size, capacity, build_seconds.
std::string plan_cache_stats();

// Drops every cached plan and resets the statistics.
void plan_cache_clear();

// The flags a CUDA call would run under now, as a JSON object: allow_tf32 (the convolution's TF32 setting),
// deterministic, benchmark, cudnn_enabled and tuning (how a new problem's choices are made: untimed, quick,
// exhaustive; without the capture state). Callable without a GPU.
std::string math_flags();

// Test hook: the next `count` cuDNN graph executions fail as a failing execute would (0 clears it).
void inject_execution_failures(int64_t count);

// Test hook: the next `count` forward graphs with an epilogue (an activation, a residual add) are refused as if by
// cuDNN (0 clears it).
void inject_epilogue_rejections(int64_t count);

// Test hook: the next `count` timed comparisons of a forward graph against ATen's convolution take ATen's as if it
// had measured faster (0 clears it).
void inject_aten_preferences(int64_t count);

// Test hook: the next `count` timed comparisons where a 1x1 float32 forward fits one matrix multiply take that way as
// if it had measured fastest (0 clears it).
void inject_matmul_preferences(int64_t count);

// Test hook: the next `count` tries of the padded-channels way fail before they run, as out of memory for the copies
// (`out_of_memory`) or as another error would (0 clears it).
void inject_padded_way_failures(int64_t count, bool out_of_memory);

// How many samples each part of the batch takes when a call of this input, weight and output element count runs in
// parts (cuda/batch_parts.h), or nullopt when it runs whole; device-independent (meta tensors work), for tests.
std::optional<int64_t> batch_part_size(const at::Tensor& input, const at::Tensor& weight, int64_t output_numel);

// Test hook: the space-to-depth regrouping of forward's input and weight for these arguments (cuda/space_to_depth.h),
// [regrouped input, regrouped weight], or empty where that way does not apply; the regrouping runs on any device.
std::vector<at::Tensor> space_to_depth(
    const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups);

// Test hook: the original weight's gradient from the regrouped weight's `grad` (cuda/space_to_depth.h) for these
// arguments; ValueError where the way does not apply.
at::Tensor space_to_depth_weight_grad(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding);

} // namespace convbias
