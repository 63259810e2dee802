// Zero-padding a channels_last tensor's channels up to a 16-byte row: the "padded channels" way of running a forward
// problem whose channel count leaves its rows misaligned (C=3 RGB inputs above all: 6 bytes a pixel in 16-bit, 12 in
// float32). cuDNN's fast engines, and every fused (conv + bias + activation) one on the H200, need 16-byte aligned
// channel rows; without them the graph falls to engines that convert the data to float32 first or run 1.4x slower
// (shared/design.md, bench/results/models-nvidia-h200.json's AlexNet rows). The zeros change no sum: the convolution
// over the padded input and weight is the convolution over the original ones.
#pragma once

#include <ATen/core/Tensor.h>

namespace convbias::cuda {

// The channel count a channels_last forward of `dtype` with `channels` input channels runs with when padded: the next
// multiple of 16 bytes' worth of elements, or `channels` itself when its rows are already 16-byte multiples or the
// dtype is not one cuDNN's aligned engines take (float16, bfloat16, float32).
int64_t padded_channel_count(at::ScalarType dtype, int64_t channels);

// `t` ([A, C, B, D], fully packed channels_last: rows of C elements in memory) copied into a new channels_last tensor
// [A, channels, B, D] whose channels C..channels-1 are zeros, in one pass over the output on the current stream.
// `channels` >= C, and channels * element size a multiple of 16 bytes.
at::Tensor pad_channels(const at::Tensor& t, int64_t channels);

} // namespace convbias::cuda
