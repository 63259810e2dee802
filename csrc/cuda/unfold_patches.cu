// A stride-1 stem's input unfolded into patches on the GPU (space_to_depth.h's "patches"): out[n, p, q, (c, r, s)] =
// x_pad[n, c, p + r, q + s], the channels past C * R * S zeros. The blocks' one-pass kernel (space_to_depth_regroup.cu)
// did this with a scattered 2-byte load per output word, each input element fetched R * S times: on the H100 it wrote
// VGG's bf16 patches at batch 256 (822 MB) in 0.98 ms, a third of the memory's rate, nearly as long as the 1x1
// convolution over them (bench/results/space_to_depth-nvidia-h100-80gb-hbm3.json). Here a block unfolds a tile of
// kTile pixels of one output row: it stages the R input rows the tile reads in shared memory (coalesced loads, each
// input element loaded R times, not R * S), then writes the tile's patches, one contiguous run, in 16-byte stores.
#include "cuda/space_to_depth.h"
#include "cuda/grid_stride.h"
#include "cuda/regroup_geometry.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace convbias::cuda {
namespace {

constexpr int kTile = 128; // output pixels a block unfolds at a time
constexpr int kThreads = 256;
// space_to_depth_of takes at most 64 unfolded channels (C * R * S), rounded up to 16-byte rows: still 64.
constexpr int kMaxRow = 64;

// The geometry (regroup_geometry.h; block_h x block_w: the kernel, R x S; out_h x out_w: the convolution's output, P x Q)
// and what the tiles add.
struct PatchShape : RegroupGeometry {
  int32_t taps; // C * R * S
  int32_t tiles_w; // tiles per output row: ceil(Q / kTile)
  int32_t stage_cols; // input columns a full tile reads: kTile + S - 1
};

// Shared memory: the row's source offsets into the stage (-1: a padding channel), then the stage, the R input rows
// [r][column][c] a tile reads (zeros outside the input).
template <typename Word>
__global__ void unfold_patches(const Word* __restrict__ in, Word* __restrict__ out, PatchShape s, int64_t tiles) {
  extern __shared__ __align__(16) unsigned char shared[];
  int32_t* const source = reinterpret_cast<int32_t*>(shared);
  Word* const stage = reinterpret_cast<Word*>(shared + kMaxRow * sizeof(int32_t));
  constexpr int kWords = sizeof(uint4) / sizeof(Word);
  const int32_t per_channel = s.block_h * s.block_w;
  for (int32_t k = threadIdx.x; k < s.row; k += blockDim.x) {
    const int32_t c = k / per_channel, r = k / s.block_w % s.block_h, t = k % s.block_w;
    source[k] = k < s.taps ? (r * s.stage_cols + t) * s.channels + c : -1;
  }
  const int32_t stage_row = s.stage_cols * s.channels; // words of one staged input row
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int32_t q0 = static_cast<int32_t>(tile % s.tiles_w) * kTile;
    const int64_t rest = tile / s.tiles_w;
    const int32_t p = static_cast<int32_t>(rest % s.out_h);
    const int64_t n = rest / s.out_h;
    const int32_t pixels = min(kTile, s.out_w - q0);
    // The staged columns w0 .. w0 + pixels + S - 2; those inside the input are words [lo, hi) of a staged row.
    const int64_t w0 = static_cast<int64_t>(q0) - s.before_w;
    const int32_t cols = pixels + s.block_w - 1;
    const int32_t lo = static_cast<int32_t>(w0 < 0 ? -w0 : 0) * s.channels;
    const int32_t hi = static_cast<int32_t>(cols < s.width - w0 ? cols : s.width - w0) * s.channels;
    __syncthreads(); // the previous tile's reads of the stage (and, the first time, the source table) are done
    for (int32_t r = 0; r < s.block_h; ++r) {
      const int64_t h = static_cast<int64_t>(p) + r - s.before_h;
      const bool row_inside = h >= 0 && h < s.height;
      const int64_t row = ((n * s.height + h) * s.width + w0) * s.channels; // read only at lo <= e < hi
      for (int32_t e = threadIdx.x; e < cols * s.channels; e += blockDim.x) {
        stage[r * stage_row + e] = row_inside && e >= lo && e < hi ? in[row + e] : Word(0);
      }
    }
    __syncthreads();
    Word* const first = out + ((n * s.out_h + p) * s.out_w + q0) * s.row;
    const int32_t units = pixels * s.row / kWords;
    for (int32_t unit = threadIdx.x; unit < units; unit += blockDim.x) {
      const int32_t word = unit * kWords;
      const int32_t pixel = word / s.row, k0 = word - pixel * s.row;
      const Word* const at_pixel = stage + pixel * s.channels;
      union {
        Word words[kWords];
        uint4 store;
      } chunk;
#pragma unroll
      for (int j = 0; j < kWords; ++j) {
        const int32_t from = source[k0 + j];
        chunk.words[j] = from >= 0 ? at_pixel[from] : Word(0);
      }
      reinterpret_cast<uint4*>(first)[unit] = chunk.store;
    }
  }
}

template <typename Word>
void launch(const at::Tensor& in, at::Tensor& out, const PatchShape& shape) {
  const int64_t tiles = static_cast<int64_t>(out.size(0)) * shape.out_h * shape.tiles_w;
  const size_t shared_bytes =
      kMaxRow * sizeof(int32_t) + static_cast<size_t>(shape.block_h) * shape.stage_cols * shape.channels * sizeof(Word);
  TORCH_INTERNAL_ASSERT(shared_bytes <= 48 * 1024, "unfold_patches: a stage of ", shared_bytes, " bytes");
  const int64_t blocks = grid_stride_blocks(tiles * kThreads, kThreads);
  unfold_patches<Word><<<blocks, kThreads, shared_bytes, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const Word*>(in.const_data_ptr()), static_cast<Word*>(out.mutable_data_ptr()), shape, tiles);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

} // namespace

at::Tensor unfold_patches_on_gpu(const at::Tensor& x, const SpaceToDepth& g) {
  TORCH_INTERNAL_ASSERT(regroups_on_gpu(x) && g.patches);
  const c10::cuda::CUDAGuard device_guard(x.device());
  auto [in, out, geometry] = regroup_buffers(x, g);
  TORCH_INTERNAL_ASSERT(geometry.row <= kMaxRow && geometry.row * in.element_size() % 16 == 0);
  if (out.numel() > 0) {
    const PatchShape shape{
        geometry,
        static_cast<int32_t>(g.patch_taps),
        (geometry.out_w + kTile - 1) / kTile,
        kTile + geometry.block_w - 1};
    if (in.element_size() == 2) {
      launch<uint16_t>(in, out, shape);
    } else {
      launch<uint32_t>(in, out, shape);
    }
  }
  return out.permute({0, 3, 1, 2});
}

} // namespace convbias::cuda
