// The "space to depth" way of running a strided stem convolution: the same convolution, exactly, as a stride-1
// convolution over the input regrouped into blocks of stride_h x stride_w pixels (each block's pixels become channels)
// with the weight regrouped alike, zero-padded to whole blocks:
//
//   X[n, (c, a, b), i, j] = x_pad[n, c, sh*i + a, sw*j + b]      W'[k, (c, a, b), u, v] = w_pad[k, c, sh*u + a, sw*v + b]
//   conv(X, W', stride 1)[n, k, i, j] = sum x_pad[n, c, sh*i + r, sw*j + t] * w_pad[k, c, r, t] = conv(x, w, stride s)
//
// A network's first convolution reads 3 channels with a large kernel and stride (AlexNet 11x11 / 4, ResNet 7x7 / 2),
// which cuDNN runs far below the GPU's rate: AlexNet's stem took 3.1 of its 7.5 ms TF32 inference on the H100, and
// its bf16 one went through float32 conversions on the H200 (bench/results/models-*.json). Regrouped it has 48
// (resp. 12) channels and a 3x3 (4x4) kernel, at 1.19x (1.31x) the multiply-adds (the zeros). Whether that pays, the
// regrouping's passes included, is measured per problem when choices are timed (fprop.cpp).
//
// A stride-1 stem (VGG's 3x3 over RGB) has no blocks to regroup; it runs as a 1x1 convolution over its input unfolded
// into patches instead ("patches" below): X[n, (c, r, t), i, j] = x_pad[n, c, i + r, j + t], W'[k, (c, r, t)] =
// w[k, c, r, t], the channels zero-padded to 16-byte rows (27 -> 32 in 16-bit). cuDNN ran VGG-11's bf16 stem at a
// fraction of the GPU's rate (2.0 of 7.8 ms of its inference on the H200, models-nvidia-h200.json): over the
// patches it is a memory-bound GEMM with the bias and activation in its epilogue, at the price of writing the
// patches (half the output's bytes).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <string>

#include "conv_args.h"

namespace convbias::cuda {

// Where a problem's regrouping comes from, per spatial dimension (0: height, 1: width).
struct SpaceToDepth {
  // Blocks: each output pixel reads one block of `block` pixels, blocks side by side (the stride). Patches: each
  // reads the `block` pixels (the kernel) from its own position, patches overlapping (stride 1).
  bool patches = false;
  std::array<int64_t, 2> block; // blocks: the stride; patches: the kernel
  std::array<int64_t, 2> kernel_blocks; // ceil(kernel / stride): the regrouped kernel (patches: 1x1)
  std::array<int64_t, 2> input_blocks; // output - 1 + kernel_blocks: the regrouped input's size
  // The padding of x before the regrouping: `before` is the convolution's; `after` makes the padded extent
  // block * input_blocks (negative: rows past the last one any output reads, cropped). Patches: 0 (unused).
  std::array<int64_t, 2> before, after;
  // Patches: the unfolded channels C * R * S, and those rounded up to 16-byte rows (the rest zeros).
  int64_t patch_taps = 0;
  int64_t patch_channels = 0;

  int64_t channels(int64_t c) const { return patches ? patch_channels : c * block[0] * block[1]; }
  // The regrouped problem's input and weight dims, from the original's, and its parameters (stride 1, no padding).
  std::array<int64_t, 4> input_dims(const std::array<int64_t, 4>& x) const {
    return {x[0], channels(x[1]), input_blocks[0], input_blocks[1]};
  }
  std::array<int64_t, 4> weight_dims(const std::array<int64_t, 4>& w) const {
    return {w[0], channels(w[1]), kernel_blocks[0], kernel_blocks[1]};
  }
  ConvParams params(ConvParams p) const {
    p.stride = {1, 1};
    p.padding = {0, 0};
    return p;
  }
};

// `p` (a forward or a weight-gradient problem: x_dims, w_dims, params, alignments) as the problem its regrouping `g`
// makes. The regrouped input and weight (or weight gradient) are new tensors, 16-byte aligned: their alignment slots
// are `x_slot` and `w_slot`.
template <typename Problem>
Problem regrouped_problem(const Problem& p, const SpaceToDepth& g, size_t x_slot, size_t w_slot) {
  Problem q = p;
  q.x_dims = g.input_dims(p.x_dims);
  q.w_dims = g.weight_dims(p.w_dims);
  q.params = g.params(p.params);
  q.alignments[x_slot] = 16;
  q.alignments[w_slot] = 16;
  return q;
}

// The regrouping of a channels_last convolution of x [N, C, H, W] by w [K, C, R, S] into y [N, K, P, Q], elements of
// `element_size` bytes, or nullopt where the way does not apply: one group, no dilation, at most 4 input channels (the
// stems: RGB, RGBA, grey), and the regrouped input within INT32_MAX elements (cuDNN's engines index with 32 bits).
// Blocks: a stride above 1, the kernel's zeros at most doubling the multiply-adds (a 1x1 stride-2 convolution would
// quadruple them). Patches: stride 1, a kernel above 1x1, at most 64 channels unfolded (C * R * S).
std::optional<SpaceToDepth> space_to_depth_of(
    const std::array<int64_t, 4>& x_dims, const std::array<int64_t, 4>& w_dims, const std::array<int64_t, 4>& y_dims,
    const ConvParams& params, int64_t element_size);

// x [N, C, H, W] regrouped: a new channels_last [N, C*sh*sw, input_blocks...] tensor (16-byte aligned), on x's device
// and current stream; any layout of x.
at::Tensor space_to_depth_input(const at::Tensor& x, const SpaceToDepth& g);

// The regrouping of an input into blocks in one pass on the GPU (space_to_depth_regroup.cu), and its unfolding into
// patches (unfold_patches.cu), which space_to_depth_input takes wherever regroups_on_gpu: a 4-D CUDA tensor of 2 or
// 4-byte elements (float16, bfloat16, float32), any layout.
bool regroups_on_gpu(const at::Tensor& x);
at::Tensor regroup_input_on_gpu(const at::Tensor& x, const SpaceToDepth& g);
at::Tensor unfold_patches_on_gpu(const at::Tensor& x, const SpaceToDepth& g);

// w [K, C, R, S] regrouped: a new channels_last [K, C*sh*sw, kernel_blocks...] tensor, zeros past the kernel (patches:
// [K, patch_channels, 1, 1], zeros past C * R * S).
at::Tensor space_to_depth_weight(const at::Tensor& w, const SpaceToDepth& g);

// The gradient of the original weight [K, C, `kernel`] from the regrouped weight's `grad` (channels_last [K, C*sh*sw,
// kernel_blocks...]; patches: [K, patch_channels, 1, 1]): the regrouping undone, the entries of the zero padding
// dropped (no weight's). A new channels_last tensor.
at::Tensor weight_grad_from_space_to_depth(
    const at::Tensor& grad, const SpaceToDepth& g, const std::array<int64_t, 2>& kernel);

// "input regrouped into 4x4 blocks (3 -> 48 channels, a 3x3 kernel at stride 1)" or "input unfolded into 3x3 patches
// (3 -> 27 channels, zero-padded to 32; a 1x1 kernel)": the note a plan carries.
std::string space_to_depth_note(const SpaceToDepth& g, int64_t channels);

} // namespace convbias::cuda
