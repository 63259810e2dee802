// Zero-padding a channels_last tensor's channels up to a 16-byte row: the "padded channels" way of running a forward
// problem whose channel count leaves its rows misaligned (C=3 RGB inputs above all: 6 bytes a pixel in 16-bit, 12 in
// float32). cuDNN's fast engines, and every fused (conv + bias + activation) one on the H200, need 16-byte aligned
// channel rows; without them the graph falls to engines that convert the data to float32 first or run 1.4x slower
// (shared/design.md, bench/results/models-nvidia-h200.json's AlexNet rows). The zeros change no sum: the convolution
// over the padded input and weight is the convolution over the original ones.
#pragma once

#include <ATen/core/Tensor.h>

namespace convbias::cuda {

// The input channel count a channels_last convolution of `dtype` with `channels` input channels in `groups` groups runs
// with when padded: the next multiple of 16 bytes' worth of elements; 0 where padding does not apply: rows already
// 16-byte multiples, grouped convolutions, dtypes other than float16, bfloat16 and float32 (those cuDNN's aligned
// engines take), and inputs of `pixels` rows (N * H * W) whose padded copy would pass INT32_MAX elements (the limit
// above which forward_setup.cpp's aten_only_reason sends a problem to ATen: cuDNN's engines index with 32 bits).
int64_t padded_channel_count(at::ScalarType dtype, int64_t channels, int64_t groups, int64_t pixels);

// `t` ([A, C, B, D], fully packed channels_last: rows of C elements in memory) copied into a new channels_last tensor
// [A, channels, B, D] whose channels C..channels-1 are zeros, in one pass over the output on the current stream.
// `channels` >= C, and channels * element size a multiple of 16 bytes.
at::Tensor pad_channels(const at::Tensor& t, int64_t channels);

// Test hook (convbias::_inject_padded_way_failures): the next `count` tries of the padded way fail before they run,
// as c10::OutOfMemoryError (`out_of_memory`) or as another c10::Error; 0 clears it.
void inject_padded_way_failures(int64_t count, bool out_of_memory);

// Throws the injected failure when the hook takes this try (padded_choice.h's padded_or_own calls it first).
void throw_injected_padded_way_failure();

} // namespace convbias::cuda
