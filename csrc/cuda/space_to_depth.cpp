#include "cuda/space_to_depth.h"

#include <ATen/ATen.h>

#include <limits>
#include <sstream>

namespace convbias::cuda {

namespace {

constexpr int64_t kMaxStemChannels = 4;

// `t` [A, C, H, W] zero-padded by (before, after) per spatial dimension (negative amounts crop) to blocks * block
// pixels, then each block's pixels made channels: a new channels_last [A, C*bh*bw, blocks[0], blocks[1]] tensor, in one
// copy after the pad. Its storage is [A, blocks[0], blocks[1], C, bh, bw], so channel (c, a, b) = c*bh*bw + a*bw + b.
at::Tensor regroup(
    const at::Tensor& t, const std::array<int64_t, 2>& block, const std::array<int64_t, 2>& blocks,
    const std::array<int64_t, 2>& before, const std::array<int64_t, 2>& after) {
  const int64_t a = t.size(0), c = t.size(1);
  const at::Tensor padded = at::constant_pad_nd(t, {before[1], after[1], before[0], after[0]}, 0);
  TORCH_INTERNAL_ASSERT(padded.size(2) == blocks[0] * block[0] && padded.size(3) == blocks[1] * block[1]);
  at::Tensor out = at::empty({a, blocks[0], blocks[1], c, block[0], block[1]}, t.options());
  // Splitting a dimension is always a view, whatever padded's layout.
  out.permute({0, 3, 1, 4, 2, 5}).copy_(padded.view({a, c, blocks[0], block[0], blocks[1], block[1]}));
  return out.view({a, blocks[0], blocks[1], c * block[0] * block[1]}).permute({0, 3, 1, 2});
}

} // namespace

std::optional<SpaceToDepth> space_to_depth_of(
    const std::array<int64_t, 4>& x_dims, const std::array<int64_t, 4>& w_dims, const std::array<int64_t, 4>& y_dims,
    const ConvParams& params) {
  const int64_t c = x_dims[1];
  if (params.groups != 1 || params.dilation[0] != 1 || params.dilation[1] != 1 || c > kMaxStemChannels ||
      (params.stride[0] == 1 && params.stride[1] == 1)) {
    return std::nullopt;
  }
  SpaceToDepth g;
  int64_t regrouped_taps = 1, taps = 1;
  for (int d = 0; d < 2; ++d) {
    const int64_t s = params.stride[d], kernel = w_dims[2 + d], out = y_dims[2 + d];
    if (out < 1) {
      return std::nullopt;
    }
    g.block[d] = s;
    g.kernel_blocks[d] = (kernel + s - 1) / s;
    g.input_blocks[d] = out - 1 + g.kernel_blocks[d];
    g.before[d] = params.padding[d];
    g.after[d] = s * g.input_blocks[d] - params.padding[d] - x_dims[2 + d];
    regrouped_taps *= g.kernel_blocks[d] * s;
    taps *= kernel;
  }
  if (regrouped_taps > 2 * taps) {
    return std::nullopt;
  }
  const int64_t elements = x_dims[0] * g.channels(c) * g.input_blocks[0] * g.input_blocks[1];
  if (elements > std::numeric_limits<int32_t>::max()) {
    return std::nullopt;
  }
  return g;
}

at::Tensor space_to_depth_input(const at::Tensor& x, const SpaceToDepth& g) {
  if (regroups_on_gpu(x)) {
    return regroup_input_on_gpu(x, g);
  }
  return regroup(x, g.block, g.input_blocks, g.before, g.after);
}

at::Tensor space_to_depth_weight(const at::Tensor& w, const SpaceToDepth& g) {
  const std::array<int64_t, 2> after{
      g.kernel_blocks[0] * g.block[0] - w.size(2), g.kernel_blocks[1] * g.block[1] - w.size(3)};
  return regroup(w, g.block, g.kernel_blocks, {0, 0}, after);
}

at::Tensor weight_grad_from_space_to_depth(
    const at::Tensor& grad, const SpaceToDepth& g, const std::array<int64_t, 2>& kernel) {
  const int64_t k = grad.size(0), c = grad.size(1) / (g.block[0] * g.block[1]);
  const int64_t rb = g.kernel_blocks[0], sb = g.kernel_blocks[1];
  // [K, C*bh*bw, rb, sb] as [K, C, bh, bw, rb, sb] (any layout: splitting a dimension is a view), to [K, C, rb, bh, sb,
  // bw]: rows u*bh + a, columns v*bw + b of the whole-block kernel.
  const at::Tensor whole = grad.view({k, c, g.block[0], g.block[1], rb, sb})
                               .permute({0, 1, 4, 2, 5, 3})
                               .reshape({k, c, rb * g.block[0], sb * g.block[1]});
  return whole.narrow(2, 0, kernel[0]).narrow(3, 0, kernel[1]).contiguous(at::MemoryFormat::ChannelsLast);
}

std::string space_to_depth_note(const SpaceToDepth& g, int64_t channels) {
  std::ostringstream note;
  note << "input regrouped into " << g.block[0] << "x" << g.block[1] << " blocks (" << channels << " -> "
       << g.channels(channels) << " channels, a " << g.kernel_blocks[0] << "x" << g.kernel_blocks[1]
       << " kernel at stride 1)";
  return note.str();
}

} // namespace convbias::cuda
