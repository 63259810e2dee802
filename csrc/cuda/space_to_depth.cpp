#include "cuda/space_to_depth.h"

#include <ATen/ATen.h>

#include <limits>
#include <sstream>

namespace convbias::cuda {

namespace {

constexpr int64_t kMaxStemChannels = 4;
// Patches: at most this many unfolded channels (C * R * S), so that the patches stay within the output's bytes for
// a stem of 64 filters (VGG: 27; a 7x7 RGB stem's 147 would write more than its output).
constexpr int64_t kMaxPatchChannels = 64;

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

// `t` [A, C, H, W] unfolded into the patches of g (stride 1): a new channels_last [A, patch_channels, P, Q] tensor whose
// channel (c, r, s) = (c * R + r) * S + s holds t_pad[a, c, p + r, q + s], the channels past C * R * S zeros. One
// copy from a strided view of the padded input.
at::Tensor unfold_patches(const at::Tensor& t, const SpaceToDepth& g) {
  const int64_t a = t.size(0), c = t.size(1), r = g.block[0], s = g.block[1];
  const int64_t p = g.input_blocks[0], q = g.input_blocks[1], taps = c * r * s;
  const at::Tensor padded = at::constant_pad_nd(t, {g.before[1], g.before[1], g.before[0], g.before[0]}, 0);
  const auto st = padded.strides();
  const at::Tensor windows = padded.as_strided({a, p, q, c, r, s}, {st[0], st[2], st[3], st[1], st[2], st[3]});
  at::Tensor out = at::empty({a, p, q, g.patch_channels}, t.options());
  out.narrow(3, 0, taps).view({a, p, q, c, r, s}).copy_(windows);
  out.narrow(3, taps, g.patch_channels - taps).zero_(); // only the padding channels: the rest was just written
  return out.permute({0, 3, 1, 2});
}

// The patches of a stride-1 stem (see space_to_depth_of), or nullopt.
std::optional<SpaceToDepth> patches_of(
    const std::array<int64_t, 4>& x_dims, const std::array<int64_t, 4>& w_dims, const std::array<int64_t, 4>& y_dims,
    int64_t element_size, const ConvParams& params) {
  const int64_t taps = x_dims[1] * w_dims[2] * w_dims[3];
  if (w_dims[2] * w_dims[3] == 1 || taps > kMaxPatchChannels || y_dims[2] < 1 || y_dims[3] < 1 || element_size < 1 ||
      element_size > 16) {
    return std::nullopt;
  }
  SpaceToDepth g;
  g.patches = true;
  g.patch_taps = taps;
  const int64_t per_row = 16 / element_size;
  g.patch_channels = (taps + per_row - 1) / per_row * per_row;
  for (int d = 0; d < 2; ++d) {
    g.block[d] = w_dims[2 + d];
    g.kernel_blocks[d] = 1;
    g.input_blocks[d] = y_dims[2 + d];
    g.before[d] = params.padding[d];
    g.after[d] = 0;
  }
  if (x_dims[0] * g.patch_channels * g.input_blocks[0] * g.input_blocks[1] > std::numeric_limits<int32_t>::max()) {
    return std::nullopt;
  }
  return g;
}

} // namespace

std::optional<SpaceToDepth> space_to_depth_of(
    const std::array<int64_t, 4>& x_dims, const std::array<int64_t, 4>& w_dims, const std::array<int64_t, 4>& y_dims,
    const ConvParams& params, int64_t element_size) {
  const int64_t c = x_dims[1];
  if (params.groups != 1 || params.dilation[0] != 1 || params.dilation[1] != 1 || c > kMaxStemChannels) {
    return std::nullopt;
  }
  if (params.stride[0] == 1 && params.stride[1] == 1) {
    return patches_of(x_dims, w_dims, y_dims, element_size, params);
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
    return g.patches ? unfold_patches_on_gpu(x, g) : regroup_input_on_gpu(x, g);
  }
  return g.patches ? unfold_patches(x, g) : regroup(x, g.block, g.input_blocks, g.before, g.after);
}

at::Tensor space_to_depth_weight(const at::Tensor& w, const SpaceToDepth& g) {
  if (g.patches) {
    // [K, C, R, S] in its logical order is [K, (c, r, s)]: the patches' channel order.
    const int64_t k = w.size(0), taps = w.size(1) * w.size(2) * w.size(3);
    at::Tensor out = at::zeros({k, g.patch_channels, 1, 1}, w.options().memory_format(at::MemoryFormat::ChannelsLast));
    out.view({k, g.patch_channels}).narrow(1, 0, taps).copy_(w.reshape({k, taps}));
    return out;
  }
  const std::array<int64_t, 2> after{
      g.kernel_blocks[0] * g.block[0] - w.size(2), g.kernel_blocks[1] * g.block[1] - w.size(3)};
  return regroup(w, g.block, g.kernel_blocks, {0, 0}, after);
}

at::Tensor weight_grad_from_space_to_depth(
    const at::Tensor& grad, const SpaceToDepth& g, const std::array<int64_t, 2>& kernel) {
  if (g.patches) {
    const int64_t k = grad.size(0);
    TORCH_INTERNAL_ASSERT(grad.size(1) == g.patch_channels && grad.size(2) == 1 && grad.size(3) == 1);
    return grad.reshape({k, g.patch_channels})
        .narrow(1, 0, g.patch_taps)
        .reshape({k, g.patch_taps / (kernel[0] * kernel[1]), kernel[0], kernel[1]})
        .contiguous(at::MemoryFormat::ChannelsLast);
  }
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
  if (g.patches) {
    note << "input unfolded into " << g.block[0] << "x" << g.block[1] << " patches (" << channels << " -> "
         << g.patch_taps << " channels";
    if (g.patch_channels > g.patch_taps) {
      note << ", zero-padded to " << g.patch_channels;
    }
    note << "; a 1x1 kernel)";
    return note.str();
  }
  note << "input regrouped into " << g.block[0] << "x" << g.block[1] << " blocks (" << channels << " -> "
       << g.channels(channels) << " channels, a " << g.kernel_blocks[0] << "x" << g.kernel_blocks[1]
       << " kernel at stride 1)";
  return note.str();
}

} // namespace convbias::cuda
